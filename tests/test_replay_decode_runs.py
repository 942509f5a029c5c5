"""Decode runs (kvmem.replay.decode_runs): a run of pure decode steps taken at once leaves the scheduler, the tree
and the requests as the steps one by one would."""

import random
from time import perf_counter

import numpy as np
import pytest

from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req
from kvmem.eviction import ONLINE_POLICIES
from kvmem.radix_cache import RadixCache
from kvmem.replay.decode_runs import ReplayScheduler
from kvmem.req_to_token import ReqToTokenPool
from kvmem.scheduler import SchedulerConfig
from kvmem.timing import PhaseTimer
from tests.test_scheduler import shared_prefix_specs


def make_scheduler(capacity, page_size=1, max_context_len=4096, rows=64, **cfg):
    pool = ReqToTokenPool(rows, max_context_len)
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    tree = RadixCache(pool, alloc, page_size=page_size)
    return ReplayScheduler(pool, alloc, tree, SchedulerConfig(**cfg))


POLICY_FIELDS = ("last_access", "hit_count")  # what the eviction policies order a node by, besides its shape


def tree_shape(tree, *fields):
    """What the cache holds, node by node: (path tokens, lock, then each of the node's `fields`, an array's as a
    list: "value" gives its slots), and the sizes."""
    out, stack = [], [(tree.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            key = path + tuple(child.token_ids())
            values = (getattr(child, f) for f in fields)
            out.append((key, child.lock_ref, *(v.tolist() if hasattr(v, "tolist") else v for v in values)))
            stack.append((child, key))
    return sorted(out), tree.evictable_size(), tree.protected_size()


def running_rows(sched, rows):
    """Each running request's req_to_token row as the next step would read it, by (rid, outputs so far)."""
    table = sched.req_to_token_pool.req_to_token
    for r in sched.running:
        rows[r.rid, len(r.output_ids)] = table[r.req_pool_idx, :r.kv_len].tolist()


def same_rows(stepped, ran):
    """A decode run samples the rows after its last step only; stepping one by one, after every step."""
    return ran and {k: stepped.get(k) for k in ran} == ran


def drive(sched, reqs, outputs, use_runs, rows=None, check=True):
    """Steps `sched` to idle with the outputs known in advance; with use_runs, pure decode stretches go through
    run_decode. Returns the (tokens used, evictable) sample after every step and the finish order; fills
    `rows` (see running_rows) after each step or run, and checks the invariants then unless not `check` (which
    reads every running request)."""
    for r in reqs:
        sched.add_request(r)
    samples, finished = [], []
    alloc = sched.token_allocator
    while not sched.is_idle():
        steps = sched.pure_decode_steps() if use_runs else 0
        if steps:
            run = sched.run_decode(steps, outputs)
            samples += list(zip(run.tokens_used.tolist(), run.evictable_tokens.tolist()))
            finished += [r.rid for r in run.finished]
        else:
            batch = sched.step()
            done = sched.process_batch_result(batch, [outputs[r.rid][len(r.output_ids)] for r in batch.reqs])
            samples.append((alloc.size - alloc.available_size(), sched.tree_cache.evictable_size()))
            finished += [r.rid for r in done]
        if rows is not None:
            running_rows(sched, rows)
        if check:
            sched.check_invariants()
    return samples, finished


@pytest.mark.parametrize("page_size", [1, 2, 16])
@pytest.mark.parametrize("seed", range(3))
def test_run_decode_leaves_every_step_as_stepping_one_by_one_would(page_size, seed):
    rng, specs = shared_prefix_specs(seed, 30, system_len=200, max_suffix=150, max_output=150)
    outputs = {i: [rng.randrange(10, 30000) for _ in range(n)] for i, (_, n) in enumerate(specs)}
    results, rows = [], ({}, {})
    for use_runs in (False, True):
        # Small enough to evict in decode and, with no room reserved for outputs, to retract.
        sched = make_scheduler(1200, page_size, schedule_policy="fcfs", max_running_requests=8,
                               init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        sched.timer = timer = PhaseTimer()
        reqs = [Req(i, p, n) for i, (p, n) in enumerate(specs)]
        t0 = perf_counter()
        samples, finished = drive(sched, reqs, outputs, use_runs, rows[use_runs])
        elapsed = perf_counter() - t0
        assert 0 < timer.seconds["evict"] <= elapsed and None not in timer.calls
        # A run takes the very slots its steps would: the tree's (its "value") and the running requests' rows.
        results.append((samples, finished, [r.output_ids for r in reqs], tree_shape(sched.tree_cache, "value"),
                        sched.stats, sched.new_token_ratio, sched.token_allocator.available_size(),
                        timer.calls["evict"]))  # an eviction (and its timing) only where a step is short
    assert results[0] == results[1] and same_rows(*rows)
    assert results[1][4].evicted_tokens > 0 and results[1][4].retractions > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_run_writes_its_results_into_the_requests_when_it_ends(page_size):
    # A run advances the batch in arrays and writes each request's tokens and KV length back at its end. Driven
    # with nothing read between the steps and runs, the requests, the tree and the stats end as stepping one by one
    # leaves them.
    rng, specs = shared_prefix_specs(7, 30, system_len=200, max_suffix=150, max_output=150)
    outputs = {i: [rng.randrange(10, 30000) for _ in range(n)] for i, (_, n) in enumerate(specs)}
    results = []
    for use_runs in (False, True):
        sched = make_scheduler(1200, page_size, schedule_policy="lpm", max_running_requests=8,
                               init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        reqs = [Req(i, p, n) for i, (p, n) in enumerate(specs)]
        samples, finished = drive(sched, reqs, outputs, use_runs, check=False)
        sched.check_invariants()
        results.append((samples, finished, [(r.output_ids, r.kv_len) for r in reqs], sched.stats,
                        tree_shape(sched.tree_cache, "value")))
    assert results[0] == results[1] and results[1][3].retractions > 0

    sched = make_scheduler(4096, page_size, max_running_requests=2)
    a, b = Req("a", list(range(1, 20)), 5), Req("b", list(range(30, 40)), 9)
    for r in (a, b):
        sched.add_request(r)
    sched.process_batch_result(sched.step(), [7, 8])
    assert sched.running_kv_tokens() == 29
    run = sched.run_decode(3, {"a": [7, 1, 2, 3, 4], "b": [8] + list(range(50, 58))})
    assert run.steps == 3 and (b.kv_len, b.output_ids) == (13, [8, 50, 51, 52])  # written back as it ended
    assert sched.running_kv_tokens() == 35
    run = sched.run_decode(1, {})  # a's and b's lists were read at their first run
    assert [r.rid for r in run.finished] == ["a"] and a.output_ids == [7, 1, 2, 3, 4] and a.kv_len == 23
    assert sched.running == [b] and b.output_ids == [8, 50, 51, 52, 53] and b.kv_len == 14
    sched.check_invariants()


def test_running_kv_tokens_read_while_a_decode_batch_is_pending_leaves_the_runs_right():
    # Read between a decode step and its results, the batch's arrays were rebuilt from requests the results then
    # changed: a later run took positions for the wrong requests and finished b with 4 of its 10 tokens.
    sched = make_scheduler(4096, 4)
    outputs = {"a": [7] * 3, "b": [8] * 10}
    for rid in outputs:
        sched.add_request(Req(rid, list(range(10, 30)), len(outputs[rid])))
    for _ in range(3):  # a prefill and two decode steps: a finishes in the last
        batch = sched.step()
        assert sched.running_kv_tokens() == sum(r.kv_len for r in sched.running)
        sched.process_batch_result(batch, [outputs[r.rid][len(r.output_ids)] for r in batch.reqs])
    sched.check_invariants()
    assert [r.rid for r in sched.running] == ["b"] and sched.running_kv_tokens() == 22
    run = sched.run_decode(sched.pure_decode_steps(), outputs)
    assert [r.rid for r in run.finished] == ["b"] and run.finished[0].output_ids == [8] * 10


def test_pure_decode_steps_stop_at_the_first_finish_and_at_a_possible_admission():
    sched = make_scheduler(4096, 1, max_running_requests=2)
    a, b, c = Req("a", [1, 2, 3], 5), Req("b", [4, 5, 6], 9), Req("c", [7, 8], 3)
    for r in (a, b):
        sched.add_request(r)
    sched.process_batch_result(sched.step(), [9, 9])
    assert sched.pure_decode_steps() == 4  # a has 4 tokens to go: the run ends with its finish
    sched.add_request(c)
    assert sched.pure_decode_steps() == 4  # c waits, but two are running: it cannot be admitted
    run = sched.run_decode(4, {"a": [9] * 5, "b": [9] * 9})
    assert run.steps == 4 and [r.rid for r in run.finished] == ["a"] and sched.running == [b]
    assert sched.pure_decode_steps() == 0  # now c can be admitted


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
@pytest.mark.parametrize("schedule_policy,page_size", [("lpm", 1), ("lpm", 4), ("fcfs", 1), ("fcfs", 4)])
def test_decode_runs_while_the_queue_head_does_not_fit_leave_every_step_as_stepping_one_by_one_would(
        policy, schedule_policy, page_size):
    rng, specs = shared_prefix_specs(5, 40, system_len=120, max_suffix=200, max_output=120)
    outputs = {i: [rng.randrange(10, 30000) for _ in range(n)] for i, (_, n) in enumerate(specs)}
    results, blocked, rows = [], [], ({}, {})
    for use_runs in (False, True):
        pool = ReqToTokenPool(64, 4096)
        alloc = TokenAllocator(1600) if page_size == 1 else PagedTokenAllocator(1600, page_size)
        sched = ReplayScheduler(pool, alloc, RadixCache(pool, alloc, page_size=page_size, eviction_policy=policy),
                          SchedulerConfig(schedule_policy=schedule_policy, max_running_requests=32))
        reqs = [Req(i, p, n) for i, (p, n) in enumerate(specs)]
        for r in reqs:
            sched.add_request(r)
        samples = []
        while not sched.is_idle():
            steps = sched.pure_decode_steps() if use_runs else 0
            if steps:
                waits = bool(sched.waiting) and len(sched.running) < sched.max_running
                run = sched.run_decode(steps, outputs)
                if waits:
                    blocked.append(run.steps)
                samples += list(zip(run.tokens_used.tolist(), run.evictable_tokens.tolist()))
            else:
                batch = sched.step()
                sched.process_batch_result(batch, [outputs[r.rid][len(r.output_ids)] for r in batch.reqs])
                samples.append((alloc.size - alloc.available_size(), sched.tree_cache.evictable_size()))
            running_rows(sched, rows[use_runs])
            sched.check_invariants()
        results.append((samples, [r.output_ids for r in reqs],
                        tree_shape(sched.tree_cache, *POLICY_FIELDS, "value"), sched.stats, sched.new_token_ratio))
    assert results[0] == results[1] and same_rows(*rows)
    # Requests waited for room while fewer than max_running ran, and runs of several steps took those waits.
    assert max(blocked) > 1 and results[1][3].evicted_tokens > 0


def test_a_decode_run_stops_before_the_step_whose_admission_the_queue_head_fits():
    # The room kept for a's outputs shrinks fast (the ratio decays by 0.2 a step), so b fits at a's third step.
    sched = make_scheduler(64, 1, max_running_requests=4, init_new_token_ratio=1.0, min_new_token_ratio=0.0,
                           new_token_ratio_decay=0.2)
    a, b = Req("a", list(range(1, 41)), 12), Req("b", list(range(100, 117)), 1)
    sched.add_request(a)
    sched.process_batch_result(sched.step(), [9])
    sched.add_request(b)
    # b's charge against the room: 18 against 13 (24 free, 11 kept for a's outputs), 17 against 15 (23 free,
    # int(10 x 0.8) kept), then 17 against 17 (22 free, int(9 x 0.6) kept: a's outputs so far count)
    assert sched.pure_decode_steps() == 11  # up to a's finish, if b went on waiting
    run = sched.run_decode(11, {"a": [9] * 12})
    assert run.steps == 2 and list(sched.waiting) == [b] and a.kv_len == 42 and len(a.output_ids) == 3
    assert sched.pure_decode_steps() == 0
    batch = sched.step()
    assert batch.forward_mode is ForwardMode.EXTEND and batch.reqs == [b]


def test_a_decode_run_ranks_the_queue_again_after_an_eviction_takes_the_head_of_the_queues_prefix():
    pa, pb = list(range(1000, 1030)), list(range(2000, 2010))
    outputs = {"pa": [7], "pb": [8], "pc": [9], "r": list(range(3000, 3100)), "a": [5], "b": [6]}
    results = []
    for use_runs in (False, True):
        pool, alloc = ReqToTokenPool(8, 512), TokenAllocator(250)
        # fifo: the oldest leaves go first, however often the failed admissions touch them
        sched = ReplayScheduler(pool, alloc, RadixCache(pool, alloc, eviction_policy="fifo"),
                          SchedulerConfig(max_running_requests=4, init_new_token_ratio=0.0, min_new_token_ratio=0.0))
        steps_taken = []

        def drive():
            while not sched.is_idle():
                steps = sched.pure_decode_steps() if use_runs else 0
                if steps:
                    head = sched.waiting[0].rid
                    steps_taken.append((head, sched.run_decode(steps, outputs).steps, sched.waiting[0].rid))
                else:
                    batch = sched.step()
                    sched.process_batch_result(batch, [outputs[q.rid][len(q.output_ids)] for q in batch.reqs])
                    steps_taken.append([q.rid for q in batch.reqs])
                sched.check_invariants()

        for req in (Req("pa", pa, 1), Req("pb", pb, 1), Req("pc", list(range(7000, 7060)), 1)):
            sched.add_request(req)  # cached in this order: pa's prefix is the oldest, then pb's
            drive()
        r = Req("r", list(range(4000, 4100)), 100)
        sched.add_request(r)
        sched.process_batch_result(sched.step(), [outputs["r"][0]])
        a, b = Req("a", pa + list(range(5000, 5160)), 1), Req("b", pb + list(range(6000, 6180)), 1)
        sched.add_request(a)  # neither fits while r runs; a, with the longer cached prefix, ranks first
        sched.add_request(b)
        steps_taken.clear()
        drive()
        results.append((tree_shape(sched.tree_cache, *POLICY_FIELDS), sched.stats, [q.output_ids for q in (r, a, b)]))
    # One run took r to its finish, evicting pa's prefix and then pb's: b went ahead of a during the run.
    assert steps_taken == [("a", 99, "b"), ["b"], ["a"]]
    assert results[0] == results[1]


def test_run_decode_refuses_more_steps_than_are_pure_and_short_outputs():
    sched = make_scheduler(4096, 1)
    sched.add_request(Req("a", [1, 2, 3], 5))
    sched.process_batch_result(sched.step(), [9])
    with pytest.raises(ValueError, match="exceeds pure_decode_steps"):
        sched.run_decode(5, {"a": [9] * 5})
    with pytest.raises(ValueError, match="its output has 3"):
        sched.run_decode(2, {"a": [9] * 3})
    assert sched.running[0].output_ids == [9] and sched.running[0].kv_len == 3


def test_a_refused_run_decode_leaves_the_queue_and_the_requests_as_they_were():
    sched = make_scheduler(64, 1, max_running_requests=4)
    a = Req("a", list(range(1, 31)), 20)
    sched.add_request(a)
    sched.process_batch_result(sched.step(), [9])
    # Neither fits; ranking would put y, which starts with 20 of a's cached prompt tokens, before x.
    x, y = Req("x", list(range(100, 140)), 5), Req("y", list(range(1, 21)) + list(range(200, 239)), 5)
    sched.add_request(x)
    sched.add_request(y)
    with pytest.raises(ValueError) as raised:
        sched.run_decode(25, {"a": [9] * 20})
    assert str(raised.value) == ("num_steps 25 exceeds pure_decode_steps(): at most 19, the fewest output tokens "
                                 "a running request lacks")
    with pytest.raises(TypeError) as raised:
        sched.run_decode(2, {"a": np.full(20, 9)})  # would leave numpy ints among a's output ids
    assert str(raised.value) == "outputs['a'] must be a list of ints (as process_batch_result stores them), " \
                                "got ndarray"
    assert list(sched.waiting) == [x, y] and a.output_ids == [9] and a.kv_len == 30
    assert sched.pure_decode_steps() == 19 and list(sched.waiting) == [y, x]  # the preview ranks, as documented
    empty = make_scheduler(48, 1)
    with pytest.raises(ValueError, match=r"pure_decode_steps\(\): 0 with no request running"):
        empty.run_decode(1, {})


@pytest.mark.parametrize("schedule_policy", ["lpm", "fcfs"])
def test_a_decode_runs_admission_attempts_are_timed_as_a_steps_are(schedule_policy):
    """A step times its ranking (lpm only) as "rank" and its match as "match"; so do a run's failed attempts,
    and the ranking pure_decode_steps() does to find the head of the queue."""
    sched = make_scheduler(64, 1, max_running_requests=4, schedule_policy=schedule_policy)
    sched.timer = timer = PhaseTimer()
    a = Req("a", list(range(1, 31)), 20)
    sched.add_request(a)
    sched.process_batch_result(sched.step(), [9])
    sched.add_request(Req("x", list(range(100, 140)), 5))
    before = dict(timer.calls)
    assert sched.pure_decode_steps() == 19
    run = sched.run_decode(19, {"a": [9] * 20})
    assert run.steps == 19 and [r.rid for r in run.finished] == ["a"]
    ranked = 2 if schedule_policy == "lpm" else 0  # the preview's and the run's first step's (then it keeps it)
    assert timer.calls.get("rank", 0) - before.get("rank", 0) == ranked
    assert timer.calls["match"] - before["match"] == 19  # x's failed admission at every step



@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_runs_through_a_pool_without_a_host_view_write_what_the_host_path_writes(page_size):
    rng = random.Random(7)
    specs = [([rng.randrange(10, 30000) for _ in range(rng.randint(4, 40))], rng.randint(5, 60)) for _ in range(12)]
    outputs = {i: [rng.randrange(10, 30000) for _ in range(n)] for i, (_, n) in enumerate(specs)}
    results = []
    for host in (True, False):
        sched = make_scheduler(600, page_size, schedule_policy="fcfs", max_running_requests=6,
                               init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        if not host:
            sched.req_to_token_pool.host_view = None
        reqs = [Req(i, p, n) for i, (p, n) in enumerate(specs)]
        rows = {}
        for r in reqs:
            sched.add_request(r)
        while not sched.is_idle():
            steps = sched.pure_decode_steps()
            if steps:
                sched.run_decode(steps, outputs)
            else:
                batch = sched.step()
                sched.process_batch_result(batch, [outputs[r.rid][len(r.output_ids)] for r in batch.reqs])
            running_rows(sched, rows)
            sched.check_invariants()
        results.append((rows, [r.output_ids for r in reqs], sched.stats, tree_shape(sched.tree_cache)))
    assert results[0] == results[1] and results[0][2].decode_batches > 0



def test_run_decode_refusals_say_what_was_wrong_in_full_and_it_times_itself():
    sched = make_scheduler(4096, 1)
    sched.timer = timer = PhaseTimer()
    sched.add_request(Req("a", [1, 2, 3], 5))
    batch = sched.step()
    with pytest.raises(RuntimeError) as raised:
        sched.run_decode(1, {"a": [9] * 5})
    assert str(raised.value) == "run_decode() called before process_batch_result() for the previous batch"
    sched.process_batch_result(batch, [9])
    for bad, message in ((0, "num_steps must be a positive int, got 0"),
                         ("2", "num_steps must be a positive int, got '2'")):
        with pytest.raises(ValueError) as raised:
            sched.run_decode(bad, {"a": [9] * 5})
        assert str(raised.value) == message
    t0 = perf_counter()
    run = sched.run_decode(4, {"a": [9] * 5})
    assert run.steps == 4 and [r.rid for r in run.finished] == ["a"]
    assert run.tokens_used.dtype == run.evictable_tokens.dtype == np.int64
    assert timer.calls["decode_run"] == 1 and 0 < timer.seconds["decode_run"] <= perf_counter() - t0



def test_run_decode_refuses_outputs_that_are_not_int_tokens_and_changes_nothing():
    for bad, error in (([5, 6.5, 7, 8], "must hold int token ids"), ([5, True, 7, 8], "got a bool")):
        sched = make_scheduler(128)
        sched.add_request(Req("a", [1, 2, 3], 4))
        sched.process_batch_result(sched.step(), [5])
        req, free = sched.running[0], sched.token_allocator.available_size()
        with pytest.raises(TypeError, match=error):
            sched.run_decode(3, {"a": bad})
        assert (req.output_ids, req.kv_len, sched.token_allocator.available_size()) == ([5], 3, free)
        with pytest.raises(KeyError, match="outputs has no entry for running request 'a'"):
            sched.run_decode(3, {})
        sched.check_invariants()
        assert sched.run_decode(3, {"a": [5, 6, 7, 8]}).steps == 3


def test_a_handed_off_request_leaves_the_run_arrays_and_a_prefilled_one_joins_them():
    sched = make_scheduler(64, page_size=4, rows=8)
    a, b = Req("a", list(range(1, 7)), max_new_tokens=6), Req("b", list(range(20, 27)), max_new_tokens=6)
    for req in (a, b):
        sched.add_request(req)
    batch = sched.step()
    sched.process_batch_result(batch, [9] * len(batch.reqs))
    assert sched.running_kv_tokens() == 13  # the arrays are built for both
    sched.hand_off(a)
    assert sched.running_kv_tokens() == 7
    outside = [a]  # its partial last page (4 slots): its whole first page is the tree's
    sched.check_invariants(held_outside=outside)
    from kvmem.disagg import preallocate
    c = Req("c", list(range(40, 45)), max_new_tokens=3)
    preallocate(c, sched.req_to_token_pool, sched.token_allocator, sched.tree_cache)
    c.output_ids.append(5)
    assert sched.add_prefilled_request(c) is False
    assert sched.running_kv_tokens() == 12
    sched.check_invariants(held_outside=outside)
    steps = sched.pure_decode_steps()
    assert steps > 0
    run = sched.run_decode(steps, {"b": [9, 1, 2, 3, 4, 5], "c": [5, 6, 7]})
    assert run.finished and sched.running_kv_tokens() == sum(r.kv_len for r in sched.running)
    sched.check_invariants(held_outside=outside)
