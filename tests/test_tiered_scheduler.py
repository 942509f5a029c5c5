"""The Scheduler over a device pool and a host tier: real KV bytes move between tiers, and every running
request's whole row must read back its own tokens after every step; tensor-parallel ranks decide alike."""

import os
import random
import socket

import numpy as np
import pytest
import torch

from kvmem import (
    HiRadixCache,
    HostKVPool,
    MHAKVPool,
    PagedTokenAllocator,
    Req,
    ReqToTokenPool,
    Scheduler,
    SchedulerConfig,
    TokenAllocator,
)
from kvmem.tiers import WRITE_POLICIES, HostSlotPool, Transfer


def next_token(tokens):
    return (hash(tuple(tokens[-16:])) ^ len(tokens)) % 30000 + 10


def workload(seed, sessions=6, turns=4):
    """Chat sessions over one system prompt; each turn is the previous turn's prompt, its answer and a new
    question. Sessions interleave, so a later turn often finds its history evicted from the device and kept by
    the host."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 30000) for _ in range(40)]
    histories = [system + [rng.randrange(10, 30000) for _ in range(rng.randrange(5, 30))] for _ in range(sessions)]
    out = []
    for turn in range(turns):
        for s in range(sessions):
            n = rng.randrange(2, 8)
            out.append((f"s{s}t{turn}", list(histories[s]), n))
            histories[s] = histories[s] + expected(histories[s], n) + [rng.randrange(10, 30000)
                                                                       for _ in range(rng.randrange(5, 20))]
    return out


def expected(prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt):]


class TokenModel:
    """Writes each computed token's id into the device pool at its slot, then reads every running request's
    row back from the pool: a prefix loaded from the wrong host slots would show at once."""

    def __init__(self, sched, pool):
        self.sched, self.pool = sched, pool

    def forward(self, batch):
        tokens = []
        for r, p, s in zip(batch.reqs, batch.prefix_lens.tolist(), batch.seq_lens.tolist()):
            tokens += list(r.fill_ids[p:s])
        kv = torch.tensor(tokens, dtype=torch.float32).reshape(-1, 1, 1)
        self.pool.set_kv_buffer(0, batch.out_cache_loc, kv, kv)
        table = self.sched.req_to_token_pool.req_to_token
        for r, s in zip(batch.reqs, batch.seq_lens.tolist()):
            k, _ = self.pool.read_kv(0, table[r.req_pool_idx, :s].long())
            assert k.flatten().long().tolist() == list(r.fill_ids[:s]), f"{r.rid}: its row reads other tokens"
        return [next_token(list(r.fill_ids[:s])) for r, s in zip(batch.reqs, batch.seq_lens.tolist())]


def run(sched, model, reqs):
    for rid, prompt, n in reqs:
        sched.add_request(Req(rid, prompt, n))
    finished = {}
    while not sched.is_idle():
        batch = sched.step()
        for r in sched.process_batch_result(batch, model.forward(batch)):
            finished[r.rid] = r
        sched.check_invariants()
    return finished


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_reuse_host_copies_and_read_back_their_own_kv(page_size, write_policy):
    capacity = 160 if page_size == 1 else 320
    device = MHAKVPool(capacity, page_size, torch.float32, 1, 1, 1)
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    rows = ReqToTokenPool(8, 256)
    tree = HiRadixCache(rows, alloc, HostKVPool(device, ratio=8), page_size=page_size, write_policy=write_policy)
    # FCFS: LPM would run each session's next turn while its history is still on device.
    sched = Scheduler(rows, alloc, tree, SchedulerConfig(schedule_policy="fcfs", max_running_requests=4,
                                                         chunked_prefill_size=48, load_back_threshold=page_size))
    reqs = workload(seed=page_size, sessions=8)
    finished = run(sched, TokenModel(sched, device), reqs)
    assert {rid: r.output_ids for rid, r in finished.items()} == {rid: expected(p, n) for rid, p, n in reqs}
    if write_policy == "write_through_selective":  # only the system prompt is matched twice here
        assert tree.stats.backed_up_tokens >= 40
    else:
        assert tree.stats.loaded_tokens > 0 and any(r.host_hit_len for r in finished.values())
    tree.check_invariants()


@pytest.mark.parametrize("threshold, loaded", [(16, 0), (11, 0), (10, 10)])
def test_a_host_hit_is_loaded_back_from_the_threshold_on_and_recomputed_below_it(threshold, loaded):
    alloc = TokenAllocator(64)
    rows = ReqToTokenPool(4, 64)
    tree = HiRadixCache(rows, alloc, HostSlotPool(256))
    sched = Scheduler(rows, alloc, tree, SchedulerConfig(load_back_threshold=threshold))
    tree.insert(list(range(100, 110)), alloc.alloc(10))
    tree.evict(10)  # the 10 tokens are on the host only
    sched.add_request(Req("a", list(range(100, 110)) + [7], 1))
    batch = sched.step()
    assert batch.prefix_lens.tolist() == [loaded] and tree.stats.loaded_tokens == loaded


def test_a_host_hit_that_needs_eviction_to_load_is_admitted():
    alloc = TokenAllocator(64)
    rows = ReqToTokenPool(4, 64)
    tree = HiRadixCache(rows, alloc, HostSlotPool(256))
    sched = Scheduler(rows, alloc, tree, SchedulerConfig(load_back_threshold=16))
    prompt = list(range(100, 148))
    tree.insert(prompt, alloc.alloc(48))
    tree.evict(48)                                   # on host only now
    tree.insert(list(range(500, 554)), alloc.alloc(54))
    assert (alloc.available_size(), tree.evictable_size()) == (10, 54)
    sched.add_request(Req("a", prompt + [7, 8], 2))
    batch = sched.step()                             # loading the 48 host tokens evicts the other prefix
    assert batch.prefix_lens.tolist() == [48] and tree.stats.loaded_tokens == 48
    sched.process_batch_result(batch, [9])
    sched.check_invariants()


def test_admission_charges_a_load_back_for_the_slots_it_took():
    # 10 free slots, 54 evictable ones in 2-token leaves, 64 held by a running request. Loading the 48-token host
    # hit would evict 38 and leave 16 slots for the 20 tokens still to compute: the request does not fit, so its
    # hit must not be loaded (admission once counted the 10 free slots as still free after the load, admitted
    # it, failed to allocate, and stalled with the prefix loaded).
    alloc = TokenAllocator(128)
    rows = ReqToTokenPool(4, 128)
    tree = HiRadixCache(rows, alloc, HostSlotPool(512))
    sched = Scheduler(rows, alloc, tree, SchedulerConfig(load_back_threshold=16))
    prompt = list(range(100, 148))
    tree.insert(prompt, alloc.alloc(48))
    tree.evict(48)
    held = alloc.alloc(64)
    for i in range(27):
        tree.insert([1000 + 2 * i, 1001 + 2 * i], alloc.alloc(2))
    assert (alloc.available_size(), tree.evictable_size()) == (10, 54)
    sched.add_request(Req("a", prompt + list(range(7, 27)), 2))
    assert sched.step() is None and tree.stats.loaded_tokens == 0 and tree.evictable_size() == 54
    alloc.free(held)                                 # the running request finished
    batch = sched.step()
    assert batch.prefix_lens.tolist() == [48] and tree.stats.loaded_tokens == 48
    sched.process_batch_result(batch, [9])
    sched.check_invariants()


# ---- tensor parallelism ------------------------------------------------------------------------------------
class RankDelayedHost(HostSlotPool):
    """A host tier whose backups complete after a random, rank-dependent number of polls."""

    def __init__(self, size, seed):
        super().__init__(size)
        self.rng = random.Random(seed)

    def backup(self, host_slots, device_slots):
        return _Polls(self.rng.randrange(0, 4))


class _Polls(Transfer):
    def __init__(self, polls):
        super().__init__()
        self.polls = polls

    def done(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self):
        self.polls = -1


def _rank_main(rank, world, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        alloc, rows = TokenAllocator(160), ReqToTokenPool(8, 256)
        tree = HiRadixCache(rows, alloc, RankDelayedHost(800, seed=rank), tp_group=dist.group.WORLD)
        sched = Scheduler(rows, alloc, tree, SchedulerConfig(schedule_policy="fcfs", max_running_requests=4,
                                                             chunked_prefill_size=48))
        for rid, prompt, n in workload(seed=3, sessions=8, turns=3):
            sched.add_request(Req(rid, prompt, n))
        steps = idle = 0
        while not sched.is_idle():
            batch = sched.step()
            if batch is None:  # the device is held by backups in flight: poll again, as an engine would
                idle += 1
                assert idle < 1000, "no progress"
                continue
            sched.process_batch_result(batch, [next_token(list(r.fill_ids[:s]))
                                               for r, s in zip(batch.reqs, batch.seq_lens.tolist())])
            steps += 1
        snapshot = sorted((tuple(_path(n)), n.value.tolist(), None if n.host_value is None else n.host_value.tolist())
                          for n in tree._all_nodes())
        np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.array(
            [repr(snapshot), repr(alloc.backup_state().free_pages.tolist()), steps, tree.stats.backed_up_tokens,
             tree.stats.loaded_tokens], dtype=object), allow_pickle=True)
        # Neither rank tears its group down while the other may still use it: a gloo pair torn down from one
        # side aborted the other process ("terminate called without an active exception") once in many runs.
        dist.barrier()
        # Past here both ranks have saved their decisions. Gloo's teardown still aborts a rank now and then on a
        # loaded machine (once in 22 runs of the suite, two at a time): the marker tells the test that such
        # an abort came after the work it checks.
        open(os.path.join(out_dir, f"rank{rank}.done"), "w").close()
    finally:
        dist.destroy_process_group()


def _path(node):
    out = []
    while node.parent is not None:
        out = node.token_ids() + out
        node = node.parent
    return out


def test_tensor_parallel_ranks_take_identical_decisions(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [mp.get_context("spawn").Process(target=_rank_main, args=(rank, 2, port, str(tmp_path)))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for rank, p in enumerate(procs):
        assert p.exitcode == 0 or (tmp_path / f"rank{rank}.done").exists(), f"rank {rank} exited with {p.exitcode}"
    ranks = [np.load(tmp_path / f"rank{r}.npy", allow_pickle=True) for r in range(2)]
    assert ranks[0][3] > 0  # backups happened, completing at different polls on each rank
    assert [list(r) for r in ranks[0:1]] == [list(r) for r in ranks[1:2]]


@pytest.mark.parametrize("b_len", [30, 22])
def test_the_device_tokens_evicted_to_load_a_host_hit_back_are_counted(b_len):
    # Device 40, host 80. A (20 tokens) is cached and backed up; B evicts A from the device (20); A again finds 19
    # tokens on the host only, and B (the only device leaf) is evicted to load them back: with B of 30 tokens the
    # device is 9 slots short, with 22 exactly 1.
    alloc, rows = TokenAllocator(40), ReqToTokenPool(4, 64)
    tree = HiRadixCache(rows, alloc, HostSlotPool(80))
    sched = Scheduler(rows, alloc, tree, SchedulerConfig(schedule_policy="fcfs", chunked_prefill_size=None))
    a, b = list(range(1, 21)), list(range(101, 101 + b_len))
    for rid, prompt in (("a", a), ("b", b), ("a2", a)):
        req = Req(rid, prompt, 1)
        sched.add_request(req)
        batch = sched.step()
        sched.process_batch_result(batch, [7])
        sched.check_invariants()
    assert (req.host_hit_len, req.storage_hit_len, tree.stats.loaded_tokens) == (19, 0, 19)
    assert sched.stats.evicted_tokens == 20 + b_len and tree.evictable_size() == 20 and alloc.available_size() == 20


def test_a_prompt_another_server_stored_is_read_from_storage_and_loaded_back(tmp_path):
    from kvmem.storage import open_store

    def serve_on_a_fresh_server(prompt):
        alloc, rows = TokenAllocator(64), ReqToTokenPool(2, 64)
        tree = HiRadixCache(rows, alloc, HostSlotPool(128), storage=open_store(f"file:{tmp_path}"),
                            prefetch_policy="wait_complete")
        sched = Scheduler(rows, alloc, tree)
        req = Req("a", prompt, 1, namespace="tenant")
        sched.add_request(req)
        while not sched.is_idle():
            sched.process_batch_result(sched.step(), [7])
        tree.close()
        return req

    prompt = list(range(1, 37))
    first = serve_on_a_fresh_server(prompt)
    assert (first.host_hit_len, first.storage_hit_len, first.prefetch) == (0, 0, None)
    second = serve_on_a_fresh_server(prompt)  # its 35 matched tokens come from the store through the host
    assert (second.host_hit_len, second.storage_hit_len, second.prefetch) == (35, 35, None)


def test_a_load_back_evicts_only_the_device_tokens_it_is_short_of():
    # Device 60, host 120. A (20) is cached and backed up; B (30) and C (18) follow, and C's admission evicts A
    # from the device (LRU). A again finds 19 tokens on the host with 12 slots free: 7 short, so the oldest
    # device leaf, B, goes (30), and C stays.
    alloc, rows = TokenAllocator(60), ReqToTokenPool(4, 64)
    tree = HiRadixCache(rows, alloc, HostSlotPool(120))
    sched = Scheduler(rows, alloc, tree, SchedulerConfig(schedule_policy="fcfs", chunked_prefill_size=None))
    a, b, c = list(range(1, 21)), list(range(101, 131)), list(range(201, 219))
    for rid, prompt in (("a", a), ("b", b), ("c", c), ("a2", a)):
        req = Req(rid, prompt, 1)
        sched.add_request(req)
        sched.process_batch_result(sched.step(), [7])
        sched.check_invariants()
    assert (req.host_hit_len, tree.stats.loaded_tokens) == (19, 19)
    assert sched.stats.evicted_tokens == 20 + 30
    assert tree.match_prefix(c).indices.numel() == 18 and tree.match_prefix(b).indices.numel() == 0
