"""The compiled replay engine (`kvmem.replay._native`, C++ in kvmem/replay/native/) from Python: a trace's arrays
in, a ReplayReport out.

It replays one replica without host or storage tiers, under the eviction policies that are key functions of a
node (lru, lfu, fifo, priority), either schedule policy, with or without chunked prefill, decode-page caching,
in-batch prefix caching and pins, on the fixed or the roofline clock; and it makes the decisions of the Python
reference (`kvmem.replay.simulator.replay` over kvmem's Scheduler and RadixCache), so that its report is the
reference's field for field, timings aside. `unsupported` names what a configuration needs that it lacks;
`kvmem.replay.engine` picks the engine.

Mooncake prompts stay hash blocks: the engine computes a block's tokens (`traces.block_token_ids`) only where two
different blocks meet, so a 145M-token trace costs its hash ids, not its tokens. Outputs are drawn once per
request from the seeds the trace gives (`traces._output_draws`).

Torch-free: numpy and the replay's torch-free modules only, so that a planner's install without torch replays.
"""

from __future__ import annotations

import importlib
import sys
import time
from array import array
from collections.abc import Sequence
from functools import lru_cache
from types import SimpleNamespace

import numpy as np

from kvmem.replay.cost import RooflineCost, StepCost, cost_model
from kvmem.replay.report import ReplayReport
from kvmem.replay.traces import MooncakeTrace, TokenTrace, TraceRequest, _digest_seed

NATIVE_POLICIES = ("lru", "lfu", "fifo", "priority")
# kvmem.SchedulerConfig's admission defaults, which a replay's scheduler keeps (a test checks that they agree):
# copied here because kvmem.scheduler imports torch.
ADMISSION = {"lpm_window": 128, "init_new_token_ratio": 0.7, "min_new_token_ratio": 0.1,
             "new_token_ratio_decay": 0.001, "load_back_threshold": 16}
STEPS_PER_CALL = 2048  # steps between returns to Python: progress, and Ctrl-C taken within a fraction of a second
MAX_SKIP_NOTES = 10  # as simulator.MAX_SKIP_NOTES
_NOTE = "kvmem-replay: "


@lru_cache(maxsize=1)
def load_native():
    """The compiled module, or the ImportError that says why it is not there (not built, or built for another
    Python)."""
    try:
        return importlib.import_module("kvmem.replay._native")
    except ModuleNotFoundError as e:
        if e.name != "kvmem.replay._native":
            return e
        return ImportError("kvmem.replay._native is missing: the install found no working C++ compiler; with one, "
                           "pip install -e . builds it")
    except ImportError as e:
        return e


def _simulated_store(config) -> bool:
    """Whether `config`'s storage tier is a simulated store ("sim" or "sim:CAPACITY_TOKENS")."""
    return config.storage.split(":")[0] == "sim"


def native_built() -> bool:
    return not isinstance(load_native(), ImportError)


def unsupported(config, cost=None, policies=None) -> str | None:
    """What of a replay of `config` (on `cost`, with the tiers' `policies` objects) the native engine does not
    cover, in a few words; None when it covers all of it."""
    if config.storage is not None and not _simulated_store(config):
        return f"a {config.storage.split(':')[0]} store"
    if getattr(config, "hybrid", None) is not None:  # a torch-free caller's namespace may leave it out
        return "a hybrid model's window-aware pools"
    if config.eviction_policy not in NATIVE_POLICIES:
        return f"{config.eviction_policy} eviction"
    if policies:
        return "eviction by policy objects"
    if cost is not None and type(cost) not in (StepCost, RooflineCost):
        return f"cost model {type(cost).__name__}"
    return None


def replay(requests: Sequence[TraceRequest], config, progress: bool = False,
           cost: StepCost | RooflineCost | None = None) -> ReplayReport:
    """kvmem.replay.simulator.replay on the native engine: the same report (timings aside) for a configuration
    it covers (`unsupported(config, cost)` is None; ValueError otherwise, or RuntimeError when it is not built)."""
    t_start = time.perf_counter()
    native = load_native()
    if isinstance(native, ImportError):
        raise RuntimeError(f"the native replay engine is not built ({native})")
    why = unsupported(config, cost)
    if why is not None:
        raise ValueError(f"the native replay engine does not cover {why}")
    cost = cost_model(config) if cost is None else cost
    trace = native_trace(native, requests)
    order, arrivals = _arrival_order(requests, config.honour_arrivals)
    run = native.Replay(_engine_config(config, cost), trace, order.astype(np.int32), arrivals)
    bar = _progress_bar(len(order), progress)
    noted = 0
    done = False
    while not done:
        done = run.advance(STEPS_PER_CALL)
        noted = _note_rejections(run, noted, config, requests)
        if bar is not None:
            bar.update(run.finished + noted - bar.n)
    if bar is not None:
        bar.close()
    if noted > MAX_SKIP_NOTES:
        print(f"{_NOTE}skipped {noted - MAX_SKIP_NOTES} more requests that can never run here", file=sys.stderr)
    report = _report(run.report(), run.start_s, cost, config)
    report.replay_seconds = time.perf_counter() - t_start
    return report


def native_trace(native, requests: Sequence[TraceRequest]):
    """The engine's view of `requests`: Mooncake hash blocks or explicit prompt tokens, and every request's output
    tokens (explicit, or drawn in the engine from the seed `TraceRequest.output_tokens` would draw them from)."""
    n = len(requests)
    if isinstance(requests, MooncakeTrace):
        seeds = _mooncake_seeds(requests)
        no_outputs = np.zeros(n + 1, dtype=np.int64)
        return native.Trace.from_blocks(requests.hash_ids, requests.block_offsets, requests.input_lens,
                                        requests.output_lens, seeds, np.empty(0, np.int32), no_outputs)
    if isinstance(requests, TokenTrace):
        prompts, offsets = requests.token_ids, requests.offsets
        outputs = [requests._output_ids(i) for i in range(n)]
        output_lens = requests.output_lens
    else:
        reqs = [requests[i] for i in range(n)]
        lens = np.fromiter((len(r.input_ids) for r in reqs), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        prompts = np.concatenate([r.input_ids for r in reqs]) if n else np.empty(0, np.int32)
        outputs = [r.output_ids if r.output_ids is not None else
                   np.empty(0, np.int32) if r.output_seed is None else r.output_seed for r in reqs]
        output_lens = np.fromiter((r.output_len for r in reqs), dtype=np.int64, count=n)
    seeds = np.zeros(n, dtype=np.uint64)
    rows = []
    for i, out in enumerate(outputs):
        if isinstance(out, int):  # a seed (TraceRequest.output_seed)
            seeds[i] = out
            rows.append(np.empty(0, np.int32))
        elif out is None or len(out) == 0:  # synthetic_output_ids: seeded by a digest of the prompt
            seeds[i] = _digest_seed(prompts[offsets[i]:offsets[i + 1]].astype(np.int64).tobytes())
            rows.append(np.empty(0, np.int32))
        else:
            rows.append(out)
    out_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=out_offsets[1:])
    out_tokens = np.concatenate(rows).astype(np.int32) if rows else np.empty(0, np.int32)
    return native.Trace.from_tokens(np.ascontiguousarray(prompts, dtype=np.int32), offsets, output_lens, seeds,
                                    out_tokens, out_offsets)


def _mooncake_seeds(trace: MooncakeTrace) -> np.ndarray:
    """Every request's MooncakeTrace._output_seed (a digest of its hash ids and its input length, as int64 bytes),
    from one array that holds each request's hash ids followed by its input length: one digest call a request."""
    n, offsets = len(trace), trace.block_offsets
    ends = offsets[1:] + np.arange(n)  # where request i's input length goes
    is_len = np.zeros(len(trace.hash_ids) + n, dtype=bool)
    is_len[ends] = True
    ids = np.empty(len(is_len), dtype=np.int64)
    ids[is_len] = trace.input_lens
    ids[~is_len] = trace.hash_ids
    raw = memoryview(ids.tobytes())
    starts = (offsets[:-1] + np.arange(n)) * 8
    return np.fromiter((_digest_seed(raw[a:b], b"mooncake") for a, b in zip(starts.tolist(), (ends * 8 + 8).tolist())),
                       dtype=np.uint64, count=n)


def _arrival_order(requests: Sequence[TraceRequest], honour: bool) -> tuple[np.ndarray, np.ndarray]:
    """simulator._arrival_order and the arrival of each request in that order (0 when arrivals are not honoured)."""
    n = len(requests)
    if not honour:
        return np.arange(n), np.zeros(n)
    arrivals = getattr(requests, "arrival_s", None)
    if arrivals is None:
        arrivals = np.array([r.arrival_s for r in requests], dtype=np.float64)
    order = np.argsort(arrivals, kind="stable")
    return order, np.asarray(arrivals, dtype=np.float64)[order]


def _engine_config(config, cost: StepCost | RooflineCost) -> dict:
    ps = config.page_size
    if isinstance(cost, StepCost):
        clock = {"roofline": False, "decode_step_s": cost.decode_step_s,
                 "prefill_tokens_per_s": cost.prefill_tokens_per_s}
    else:
        clock = {"roofline": True, "flops_per_s": cost._flops_per_s, "bytes_per_s": cost._bytes_per_s,
                 "weight_bytes": cost._weight_bytes, "pair_flops": cost._pair_flops,
                 "token_flops": cost._token_flops, "window_pair_flops": cost._window_pair_flops,
                 "linear_flops": cost._linear_flops, "full_kv_bytes": float(cost._full_kv_bytes),
                 "window_kv_bytes": cost._window_kv_bytes, "state_bytes": float(cost._state_bytes),
                 "window": cost.window or 0, "chunked": cost._chunked}
    # Both clocks charge loads from lower tiers alike (kvmem.replay.cost.load_seconds).
    clock.update({"kv_bytes": float(cost._kv_bytes), "links": float(cost._links), "h2d_gbps": float(cost.h2d_gbps),
                  "storage_gbps": float(cost.storage_gbps), "storage_latency_us": float(cost.storage_latency_us)})
    host = None if config.host_capacity_tokens is None else config.host_pages * ps
    store = config.store_capacity_tokens if host is not None and config.storage is not None else None
    store = 0 if store is None else max(1, store // ps) * ps  # simulator.open_storage's: at least a page
    return {"capacity_tokens": config.capacity_tokens // ps * ps, "context_len": config.context_len,
            "host_capacity_tokens": host, "write_policy": None if host is None else config.write_policy,
            "storage": host is not None and config.storage is not None, "storage_capacity_tokens": store,
            "page_size": ps, "eviction_policy": config.eviction_policy, "schedule_policy": config.schedule_policy,
            "max_running": config.max_running, "chunked_prefill_size": config.chunked_prefill_size or 0,
            "cache_decode_pages": config.cache_decode_pages,
            "in_batch_prefix_caching": config.in_batch_prefix_caching,
            "pin_prefix_tokens": config.pin_prefix_tokens, "pin_budget": float(config.pin_budget),
            **ADMISSION, "cost": clock}


def _note_rejections(run, noted: int, config, requests) -> int:
    """Notes on stderr the requests rejected since the last call (the first MAX_SKIP_NOTES, as ReplicaSim does);
    returns how many have been rejected."""
    for rid, why in run.rejections(noted):
        noted += 1
        if noted <= MAX_SKIP_NOTES:
            _note_rejection("", rid, why, config, requests)
    return noted


def _note_rejection(replica: str, rid: int, why: str, config, requests) -> None:
    """ReplicaSim's note for a request it rejects (`why`: "capacity" or "context"); `replica` names a cluster's."""
    n_in, n_out = _lengths(requests, rid)
    limit = (f"the KV capacity {config.capacity_tokens // config.page_size * config.page_size}"
             if why == "capacity" else f"max_context_len {config.context_len}")
    print(f"{_NOTE}{replica}skipped: request {rid!r}: {n_in} prompt + {n_out} new tokens exceed {limit}",
          file=sys.stderr)


def _lengths(requests, rid: int) -> tuple[int, int]:
    """Request rid's prompt and output lengths."""
    if isinstance(requests, (MooncakeTrace, TokenTrace)):
        return int(requests.input_lens[rid]), int(requests.output_lens[rid])
    return len(requests[rid].input_ids), requests[rid].output_len


def _report(r: dict, start_s: float | None, cost: StepCost | RooflineCost, config) -> ReplayReport:
    """The ReplayReport of a replica of `config` whose native report is `r`, its first request arrived at
    `start_s`."""
    report = ReplayReport(capacity_tokens=r["capacity_tokens"], cost_model=cost.name, num_gpus=cost.num_gpus)
    report.start_s = start_s
    for name in ("requests", "prompt_tokens", "cached_tokens", "evicted_tokens", "retractions", "rejected",
                 "output_tokens", "prefill_seconds_saved", "cache_op_seconds", "host_cached_tokens"):
        setattr(report, name, r[name])
    if config.host_capacity_tokens is not None:
        report.host_capacity_tokens = config.host_pages * config.page_size
        report.storage_cached_tokens = r["storage_cached_tokens"]
        stats = SimpleNamespace(**{k: r[k] for k in ("loaded_tokens", "backed_up_tokens", "host_evicted_tokens")})
        link = None if config.storage is None else SimpleNamespace(
            stats=SimpleNamespace(prefetched_tokens=r["prefetched_tokens"], stored_tokens=r["stored_tokens"]),
            storage=SimpleNamespace(stats=SimpleNamespace(corrupt=0, failed_ops=r["storage_failed_ops"])))
        report.record_tiers(SimpleNamespace(stats=stats, storage_link=link), config)
    for name, code in (("time_s", "d"), ("tokens_used", "q"), ("evictable_tokens", "q"), ("running", "q"),
                       ("cumulative_hit_rate", "d"), ("ttft_s", "d"),
                       ("first_token_s", "d")):
        samples = array(code)
        samples.frombytes(r[name].tobytes())
        setattr(report, name, samples)
    parts = {"match": r["match_seconds"], "alloc": 0.0, "evict": r["evict_seconds"],
             "insert_release": r["insert_release_seconds"]}
    parts["batch"] = max(report.cache_op_seconds - sum(parts.values()), 0.0)
    report.cache_phases = parts
    return report


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
