#!/usr/bin/env python3
"""Byte-level compatibility of kvmem's KV events with vLLM's (and SGLang's) own msgspec classes.

Both directions, on the same batches (hand-made ones covering every field, and the batches of a RadixCache
run at page size 16 and 1):

- vLLM decodes kvmem: kvmem's bytes in the "map" form go through vLLM's `KVEventBatch` decoder
  (`vllm.distributed.kv_events`, the classes vLLM's own subscribers use); the "array" form through
  array-like twins of those classes built from vLLM's own field list (vLLM's classes stopped being array
  like; its older releases declared the same fields, first six of them before `lora_name` existed), both
  with every field and with only the first six. The decoded fields must equal kvmem's, and vLLM's fields
  that kvmem does not send must be at their defaults.
- kvmem decodes vLLM: vLLM's encoder writes the same batches from its own classes; kvmem's `decode_batch`
  must give back the very same events. The bytes are also compared: equal, or equal once both are
  re-packed canonically (msgspec sizes a map header by the fields a class could have, so vLLM writes a
  16-key class's map with a map16 header where kvmem writes the smallest one).
- With `--sglang-python`, SGLang's `KVEventBatch` decodes kvmem's "map" bytes too.

The vLLM side runs this same file with `--peer vllm` under the python of a venv with vLLM installed
(`../shared/peers/setup_vllm.sh`); it is skipped with a note when that python does not exist. The JSON
report is printed on stdout, its `status` "ok" (every peer ran and passed), "skipped" (a peer was skipped and
those that ran passed: nothing was checked against the skipped one) or "failed"; `skipped` names the peers
skipped. The exit status is 0 unless a check failed.

    python scripts/check_vllm_events.py [--vllm-python PATH] [--sglang-python PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                          "lora_name"),
          "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


# ---- the kvmem side ----------------------------------------------------------------------------------------
def sample_batches():
    """Hand-made batches covering every field and value range, then real ones from a RadixCache."""
    from kvmem import RadixCache, ReqToTokenPool, TokenAllocator
    from kvmem.allocator import PagedTokenAllocator
    from kvmem.events import (
        MEDIUM_CPU_PINNED,
        MEDIUM_DISK,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        EventCollector,
    )

    batches = [
        EventBatch(1718000000.25, [BlockStored([0, 1, 2**63, 2**64 - 1], None, list(range(8)), 2)], 0),
        EventBatch(1.5, [BlockStored([7], 2**64 - 1, [2**31, -1, 0, 5], 4, lora_id=3, medium=MEDIUM_CPU_PINNED,
                                     lora_name="adapter-a"),
                         BlockStored([8], 7, [1], 1, medium=None),
                         BlockRemoved([7], MEDIUM_CPU_PINNED), BlockRemoved([8, 9], MEDIUM_DISK),
                         AllBlocksCleared()], 5),
        EventBatch(0.0, [], None),
    ]
    for page_size in (16, 1):
        alloc = TokenAllocator(512) if page_size == 1 else PagedTokenAllocator(512, page_size)
        sink = EventCollector(data_parallel_rank=0)
        cache = RadixCache(ReqToTokenPool(2, 8), alloc, page_size=page_size, event_sink=sink)
        for i in range(6):
            key = list(range(1000, 1000 + 64)) + [i] * (32 * (i % 3 + 1))
            slots = alloc.alloc(len(key))
            if slots is None:
                cache.evict(len(key))
                slots = alloc.alloc(len(key))
            n = cache.insert(key, slots)
            if n:
                alloc.free(slots[:n])
            if i == 3:
                cache.evict(100)
            batches.append(sink.take_batch())
        cache.reset()
        batches.append(sink.take_batch())
    return batches


def as_json(batch) -> dict:
    return {"ts": batch.ts, "rank": batch.data_parallel_rank,
            "events": [dict(type=type(e).__name__, **{f: _plain(getattr(e, f)) for f in FIELDS[type(e).__name__]})
                       for e in batch.events]}


def same(decoded: dict, expected: dict) -> bool:
    """The peer decoded `expected`: the same batch fields, events and event fields, where a layout that
    declares fewer fields (an older release's) must still hold the first six of BlockStored."""
    if (decoded["ts"], decoded["rank"], len(decoded["events"])) != (expected["ts"], expected["rank"],
                                                                     len(expected["events"])):
        return False
    for d, e in zip(decoded["events"], expected["events"]):
        if d["type"] != e["type"] or any(d[k] != e[k] for k in d):
            return False
        if not set(FIELDS[e["type"]][:6]) <= set(d):
            return False
    return True


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def run_peer(python: str, mode: str, request: dict) -> dict:
    if not os.path.exists(python):
        return {"skipped": f"{python} not found"}
    proc = subprocess.run([python, __file__, "--peer", mode], input=json.dumps(request), capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": f"{mode} side failed (exit {proc.returncode}): {proc.stderr[-3000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python")
    ap.add_argument("--sglang-python", default=None, help="also decode with SGLang's classes (e.g. "
                    "/tmp/sglang-peer/bin/python)")
    ap.add_argument("--out", help="also write the JSON report here")
    ap.add_argument("--peer", choices=["vllm", "sglang"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        print(json.dumps(PEERS[args.peer](json.loads(sys.stdin.read()))))
        return 0

    import msgpack

    from kvmem._checks import output_file_arg
    from kvmem.events import decode_batch, encode_batch

    # Checked here, on kvmem's side: the peers run this file under pythons without kvmem.
    for option, python in (("--vllm-python", args.vllm_python), ("--sglang-python", args.sglang_python)):
        if python is not None:
            _peer.check_python(ap, option, python)  # one that is not there is skipped, as the report says
    _peer.check_value(ap, "--out", args.out, output_file_arg)

    batches = sample_batches()
    expected = [as_json(b) for b in batches]
    request = {"batches": expected,
               "map": [encode_batch(b, "map").hex() for b in batches],
               "array": [encode_batch(b, "array").hex() for b in batches]}
    report = {"batches": len(batches), "events": sum(len(b.events) for b in batches)}
    ok, skipped = True, []
    vllm = run_peer(args.vllm_python, "vllm", request)
    if "decoded" in vllm:
        report["vllm_version"] = vllm["version"]
        checks = {}
        for layout, decoded in vllm["decoded"].items():
            checks[f"vllm_decodes_kvmem_{layout}"] = sum(same(d, e) for d, e in zip(decoded, expected))
        checks["vllm_extra_fields_at_default"] = vllm["extra_fields_at_default"]
        vllm_bytes = [bytes.fromhex(h) for h in vllm["encoded"]]
        kvmem_bytes = [bytes.fromhex(h) for h in request["map"]]
        checks["kvmem_decodes_vllm"] = sum(decode_batch(v) == b for v, b in zip(vllm_bytes, batches))
        checks["identical_bytes"] = sum(v == k for v, k in zip(vllm_bytes, kvmem_bytes))
        checks["identical_bytes_once_repacked"] = sum(
            msgpack.packb(msgpack.unpackb(v)) == k for v, k in zip(vllm_bytes, kvmem_bytes))
        report["vllm"] = checks
        ok &= all(v == len(batches) for k, v in checks.items() if k != "identical_bytes")
    else:
        report["vllm"] = vllm
        ok &= "skipped" in vllm
        skipped.append("vllm")
    if args.sglang_python:
        sglang = run_peer(args.sglang_python, "sglang", request)
        if "decoded" in sglang:
            decoded = sum(same(d, e) for d, e in zip(sglang["decoded"], expected))
            report["sglang"] = {"version": sglang["version"], "sglang_decodes_kvmem_map": decoded}
            ok &= report["sglang"]["sglang_decodes_kvmem_map"] == len(batches)
        else:
            report["sglang"] = sglang
            ok &= "skipped" in sglang
            skipped.append("sglang")
    report["status"] = "failed" if not ok else "skipped" if skipped else "ok"
    report["skipped"] = skipped
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if ok else 1


# ---- the peer sides (run under the peer's python: no kvmem import) -------------------------------------------
def _normalise(batch, rank_field: str) -> dict:
    events = []
    for e in batch.events:
        name = type(e).__name__
        events.append(dict(type=name, **{f: getattr(e, f) for f in FIELDS[name] if hasattr(e, f)}))
    return {"ts": batch.ts, "rank": getattr(batch, rank_field), "events": events}


def _extra_at_default(batch) -> bool:
    import msgspec

    for e in batch.events:
        for field in msgspec.structs.fields(e):
            if field.name not in FIELDS[type(e).__name__] and getattr(e, field.name) != field.default:
                return False
    return True


def _array_twins(module, keep: int | None):
    """Array-like twins of vLLM's event classes, from vLLM's own field list (the first `keep` fields of
    BlockStored, or all), as vLLM's releases before the named-field form declared them."""
    import msgspec

    base = msgspec.defstruct("KVCacheEvent", [], array_like=True, omit_defaults=True, tag=True)
    twins = []
    for cls in (module.BlockStored, module.BlockRemoved, module.AllBlocksCleared):
        fields = [(f.name, f.type) if f.required else (f.name, f.type, f.default) for f in msgspec.structs.fields(cls)]
        if keep is not None and cls is module.BlockStored:
            fields = fields[:keep]
        twins.append(msgspec.defstruct(cls.__name__, fields, bases=(base,), array_like=True, omit_defaults=True,
                                       tag=True))
    union = twins[0] | twins[1] | twins[2]
    return msgspec.defstruct("KVEventBatch", [("events", list[union])], bases=(module.EventBatch,), array_like=True,
                             omit_defaults=True)


def _vllm_peer(request: dict) -> dict:
    import msgspec
    import vllm
    from vllm.distributed import kv_events as kv

    decoded = {}
    named = msgspec.msgpack.Decoder(kv.KVEventBatch)
    batches = [named.decode(bytes.fromhex(h)) for h in request["map"]]
    decoded["map"] = [_normalise(b, "data_parallel_rank") for b in batches]
    extra_ok = sum(_extra_at_default(b) for b in batches)
    for layout, keep in (("array", None), ("array_first_6_fields", 6)):
        decoder = msgspec.msgpack.Decoder(_array_twins(kv, keep))
        out = [decoder.decode(bytes.fromhex(h)) for h in request["array"]]
        decoded[layout] = [_normalise(b, "data_parallel_rank") for b in out]
        if keep is None:
            extra_ok = min(extra_ok, sum(_extra_at_default(b) for b in out))
    classes = {"BlockStored": kv.BlockStored, "BlockRemoved": kv.BlockRemoved,
               "AllBlocksCleared": kv.AllBlocksCleared}
    encoder = msgspec.msgpack.Encoder()
    encoded = []
    for b in request["batches"]:
        events = [classes[e["type"]](**{k: v for k, v in e.items() if k != "type"}) for e in b["events"]]
        encoded.append(encoder.encode(kv.KVEventBatch(ts=b["ts"], events=events, data_parallel_rank=b["rank"])).hex())
    return {"version": vllm.__version__, "decoded": decoded, "extra_fields_at_default": extra_ok,
            "encoded": encoded}


def _sglang_peer(request: dict) -> dict:
    import msgspec
    import sglang
    from sglang.srt.disaggregation import kv_events as kv

    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    batches = [decoder.decode(bytes.fromhex(h)) for h in request["map"]]
    return {"version": sglang.__version__, "decoded": [_normalise(b, "attn_dp_rank") for b in batches]}


PEERS = {"vllm": _vllm_peer, "sglang": _sglang_peer}

if __name__ == "__main__":
    sys.exit(main())
