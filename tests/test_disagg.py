"""kvmem.disagg in one process: a prefill engine and a decode engine joined by the copy transport and a local channel.

Greedy tokens equal one engine's; the decode side asks only for the pages beyond its own cache's match; both sides'
memory invariants hold after every step (`free + evictable + protected + held == total`, counting what requests hold
outside their schedulers), and no fault (abort, a decode side that dies, a write that stalls or fails, a prefill that
finishes after the decode side gave up, a peer that breaks the protocol) leaves a page held on either side.
"""

import random

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

from kvmem import MHAKVPool, MLAKVPool, PagedTokenAllocator, Req, ReqToTokenPool, TokenAllocator  # noqa: E402
from kvmem._paging import pages_for  # noqa: E402
from kvmem.batch import ReqStatus  # noqa: E402
from kvmem.disagg import CopyTransport, KVBuffers, KVLayout, KVReceiver, KVSender, LocalChannel, TransferStatus  # noqa: E402
from kvmem.disagg.channel import PeerGone  # noqa: E402
from kvmem.disagg.messages import Hello, KVFailed, KVRequest, Welcome, decode_message, encode_message  # noqa: E402
from kvmem.disagg.transport import Finished, Transfer, page_runs  # noqa: E402
from kvmem.engine import Engine, build_model  # noqa: E402
from kvmem.radix_cache import RadixCache  # noqa: E402
from kvmem.scheduler import Scheduler  # noqa: E402

MAX_NEW = 6
_MODELS = {}


def model_of(preset, **overrides):
    key = (preset, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(preset, **overrides)
    return _MODELS[key]


def prompts_sharing_a_prefix(n=6, shared=40, seed=0, vocab=256, tail=(1, 40)):
    rng = random.Random(seed)
    head = [rng.randrange(vocab) for _ in range(shared)]
    return [head[:rng.randrange(shared // 2, shared + 1)] + [rng.randrange(vocab) for _ in range(rng.randrange(*tail))]
            for _ in range(n)]


class Pair:
    """A prefill engine and a decode engine in this process; `manual` stops the decode side's listening from running
    the prefill side's steps, so that a test interleaves them itself."""

    def __init__(self, preset="llama-tiny", page_size=16, prefill_capacity=1024, decode_capacity=1024,
                 transport=None, model=None, prefill_options=None, decode_options=None, **receiver_options):
        model = model or model_of(preset)
        self.transport = transport or CopyTransport()
        self.prefill = Engine(model, capacity_tokens=prefill_capacity, page_size=page_size, **(prefill_options or {}))
        self.decode = Engine(model, capacity_tokens=decode_capacity, page_size=page_size, **(decode_options or {}))
        self.sender = KVSender(self.prefill, self.transport)
        self.auto = True
        decode_end, prefill_end = LocalChannel.pair(peer_step=lambda: self.auto and self.sender.step())
        self.sender.accept(prefill_end)
        self.channel = decode_end
        self.receiver = KVReceiver(self.decode, self.transport, decode_end, **receiver_options)

    def check(self):
        self.sender.check_invariants()
        self.receiver.check_invariants()

    def run(self):
        """Steps the decode side (and through it the prefill side) until both are idle, checking after every step."""
        outputs = self.receiver.run_until_idle(self.check)
        while not self.sender.is_idle():
            self.sender.step()
            self.check()
        return outputs

    def assert_nothing_held(self):
        """Every page is free or cached (evictable): no request holds memory on either side."""
        self.check()
        for engine in (self.prefill, self.decode):
            assert engine.is_idle()
            tree = engine.tree_cache
            assert tree.protected_size() == 0
            assert engine.token_allocator.available_size() + tree.evictable_size() == engine.token_allocator.size
            assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
        assert self.sender.held_tokens() == self.receiver.held_tokens() == 0


# ---- tokens and the decode side's cache -------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek-v2-tiny"])
def test_disaggregated_greedy_tokens_equal_one_engines_and_the_decode_cache_hits(preset, page_size):
    prompts = prompts_sharing_a_prefix()
    expected = Engine(model_of(preset), capacity_tokens=1024, page_size=page_size).generate(prompts, MAX_NEW)
    pair = Pair(preset, page_size)
    first = pair.receiver.generate(prompts[:1], MAX_NEW)  # its prompt's pages enter the decode side's tree
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts[1:]]
    outputs = pair.run()
    assert first + [outputs[r] for r in rids] == expected
    stats = pair.receiver.stats
    assert stats.cached_tokens > 0 and pair.decode.stats.cached_tokens == stats.cached_tokens
    # Exactly the pages beyond each request's match were asked for and sent.
    assert stats.received_pages == pair.sender.stats.sent_pages
    assert stats.received_bytes == stats.received_pages * KVLayout.of(pair.decode.pool).bytes_per_page
    pair.assert_nothing_held()


def test_the_decode_side_asks_only_for_pages_beyond_its_match_at_page_512():
    model = model_of("llama-tiny", max_position_embeddings=2048)
    rng = random.Random(1)
    head = [rng.randrange(256) for _ in range(1100)]
    prompts = [head + [7], head[:1030] + [8, 9]]
    expected = Engine(model, capacity_tokens=4096, page_size=512).generate(prompts, 4)
    pair = Pair(page_size=512, prefill_capacity=2048, decode_capacity=4096, model=model)
    assert pair.receiver.generate(prompts[:1], 4) == expected[:1]
    assert pair.receiver.stats.received_pages == 3  # 1101 tokens: two whole pages and a partial one
    assert pair.receiver.generate(prompts[1:], 4) == expected[1:]
    # The second prompt's first 1024 tokens were the decode side's: it asked for its third page only.
    assert pair.receiver.stats.cached_tokens == 1024 and pair.receiver.stats.received_pages == 4
    pair.assert_nothing_held()


def test_a_prompt_the_decode_side_holds_whole_asks_for_no_page():
    pair = Pair(page_size=16)
    prompt = prompts_sharing_a_prefix(n=1, shared=32, tail=(16, 17))[0][:32]
    first = pair.receiver.generate([prompt], MAX_NEW)
    pages = pair.receiver.stats.received_pages
    assert pair.receiver.generate([prompt], MAX_NEW) == first
    assert pair.receiver.stats.received_pages == pages and pair.receiver.stats.cached_tokens == 32
    pair.assert_nothing_held()


def test_a_small_decode_pool_queues_requests_evicts_and_retracts_and_tokens_stay_equal():
    prompts = prompts_sharing_a_prefix(n=8, seed=3)
    expected = Engine(model_of("llama-tiny"), capacity_tokens=1024, page_size=16).generate(prompts, MAX_NEW)
    assert sum(pages_for(len(p) + MAX_NEW, 16) for p in prompts) * 16 > 160  # they cannot all hold memory at once
    pair = Pair(page_size=16, decode_capacity=160)
    assert pair.receiver.generate(prompts, MAX_NEW) == expected
    # A request retracted on the decode side resumes by a prefill there, before new requests take its memory.
    assert pair.decode.stats.retractions > 0 and pair.decode.stats.prefill_batches > 0
    pair.assert_nothing_held()


# ---- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, field", [
    (dict(page_size=1), "page_size"),
    (dict(preset="qwen2-tiny"), "model"),
    (dict(preset="deepseek-v2-tiny"), "model"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
])
def test_a_layout_mismatch_is_refused_before_anything_is_allocated(change, field):
    transport = CopyTransport()
    prefill = Engine(model_of("llama-tiny"), capacity_tokens=256, page_size=16)
    sender = KVSender(prefill, transport)
    preset = change.get("preset", "llama-tiny")
    decode = Engine(model_of(preset), capacity_tokens=256, page_size=change.get("page_size", 16),
                    kv_cache_dtype=change.get("kv_cache_dtype", "auto"))
    with pytest.raises(ValueError, match=f"KV layouts differ: {field} ") as info:
        KVReceiver(decode, transport, sender.connect_local())
    assert "\n" not in str(info.value)
    assert sender.channels() == [] and sender.is_idle()
    for engine in (prefill, decode):
        assert engine.token_allocator.available_size() == engine.token_allocator.size
        assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    with pytest.raises(RuntimeError, match="not registered"):  # the refused side's registration has ended
        transport.check_peer(KVBuffers("copy:1", (), (), 1))


def test_a_request_larger_than_the_decode_pool_is_a_clear_error_and_queues_nothing():
    pair = Pair(page_size=16, decode_capacity=64)
    with pytest.raises(ValueError, match="exceed the KV pool's capacity of 64 tokens"):
        pair.receiver.add_request(list(range(60)), 8)
    with pytest.raises(ValueError, match=r"prompts\[1\].*capacity of 64"):
        pair.receiver.generate([[1, 2, 3], list(range(70))], 4)
    assert pair.receiver.is_idle()
    pair.assert_nothing_held()


def test_a_prefill_side_that_does_not_answer_the_handshake_is_a_bounded_error():
    decode = Engine(model_of("llama-tiny"), capacity_tokens=256, page_size=16)
    silent, _ = LocalChannel.pair()
    with pytest.raises(RuntimeError, match="no answer within"):
        KVReceiver(decode, CopyTransport(), silent, handshake_timeout_s=0.01)


def test_the_sender_answers_a_bad_kv_request_with_kv_failed_and_serves_on():
    prefill = Engine(model_of("llama-tiny"), capacity_tokens=256, page_size=16)
    transport = CopyTransport()
    sender = KVSender(prefill, transport)
    decode_pool = MHAKVPool(256, 16, torch.float32, 2, 16, 2)
    buffers = transport.register(decode_pool)
    decode_end, prefill_end = LocalChannel.pair(peer_step=sender.step)
    sender.accept(prefill_end)
    hello = Hello(sender.layout.to_dict(), buffers.to_dict())
    assert isinstance(decode_end.request(hello, 1.0), Welcome)
    bad = [KVRequest(1, [1, 2, 3], 8, []),                 # start beyond the prompt, not a page boundary
           KVRequest(2, list(range(20)), 0, [1]),          # 20 tokens need two pages
           KVRequest(3, list(range(20)), 0, [3, 3]),       # a page twice
           KVRequest(4, list(range(20)), 0, [1, 999]),     # a page the decode pool does not have
           KVRequest(5, [1, 999], 0, [2])]                 # a token outside the vocabulary
    for msg in bad:
        decode_end.send(msg)
    answers = []
    while len(answers) < len(bad):
        answers += decode_end.recv()
    assert [type(a) for a in answers] == [KVFailed] * 5 and [a.rid for a in answers] == [1, 2, 3, 4, 5]
    assert all(a.reason.startswith("bad KV request") for a in answers)
    decode_end.send(KVRequest(6, list(range(20)), 0, [1, 2]))
    answers = []
    while not answers:
        answers = decode_end.recv()
    assert answers[0].rid == 6 and answers[0].__class__.__name__ == "KVDone"
    assert sender.is_idle() and sender.held_tokens() == 0
    sender.check_invariants()


# ---- faults: nothing leaks ------------------------------------------------------------------------------------
class StalledTransport(CopyTransport):
    """Writes wait until the test lets them end (`finish(copy=...)`): a write that times out, seen from decode."""

    def __init__(self):
        super().__init__()
        self.stalled = []

    def _write(self, src, dst, layers, src_starts, dst_starts, lengths):
        transfer = _Held(lambda: super(StalledTransport, self)._write(src, dst, layers, src_starts, dst_starts,
                                                                      lengths))
        self.stalled.append(transfer)
        return transfer

    def finish(self, copy: bool):
        for transfer in self.stalled:
            transfer.end = transfer.copy() if copy else Finished("the link went down")
        self.stalled.clear()


class _Held(Transfer):
    def __init__(self, copy):
        self.copy, self.end = copy, None

    def poll(self):
        if self.end is None:
            return TransferStatus.PENDING
        self.error = self.end.error
        return self.end.poll()


def test_abort_while_queued_or_receiving_frees_every_page():
    pair = Pair(page_size=16)
    pair.auto = False
    prompts = prompts_sharing_a_prefix(n=3)
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts]
    pair.receiver.step()  # all three get memory and ask for their KV
    assert pair.receiver.held_tokens() > 0
    pair.receiver.abort(rids[0])
    pair.auto = True
    outputs = pair.run()
    assert pair.receiver.failed == {rids[0]: "aborted"} and set(outputs) == set(rids[1:])
    pair.assert_nothing_held()
    with pytest.raises(ValueError, match="not waiting"):
        pair.receiver.abort(rids[1])
    queued = pair.receiver.add_request(prompts[0], MAX_NEW)
    pair.receiver.abort(queued)
    assert pair.receiver.failed[queued] == "aborted" and pair.receiver.is_idle()


def test_a_prefill_that_finishes_after_the_decode_side_gave_up_frees_both_sides():
    pair = Pair(page_size=16, kv_timeout_s=1e-9)
    pair.auto = False
    rid = pair.receiver.add_request(prompts_sharing_a_prefix(n=1)[0], MAX_NEW)
    pair.receiver.step()  # memory given, KV asked for
    pair.receiver.step()  # no KV yet: past its deadline it is cancelled, its pages still held
    assert pair.receiver.held_tokens() > 0 and pair.sender.is_idle()
    pair.auto = True      # now the prefill side reads the request and the cancel, prefills, and writes nothing
    pair.run()
    assert pair.receiver.failed[rid].startswith("no KV within")
    assert pair.sender.stats.requests == 1 and pair.sender.stats.sent_pages == 0
    pair.assert_nothing_held()


def test_a_write_that_stalls_past_the_deadline_keeps_the_pages_until_it_ends():
    transport = StalledTransport()
    pair = Pair(page_size=16, transport=transport, kv_timeout_s=1e-9)
    rid = pair.receiver.add_request(list(range(45)), MAX_NEW)  # its last page is partial: the prefill side holds it
    while not transport.stalled:
        pair.receiver.step()
        pair.check()
    pair.receiver.step()
    # Cancelled, but the write may still land: the decode side's pages stay held, as do the prefill side's.
    assert pair.receiver.held_tokens() > 0 and pair.sender.held_tokens() > 0 and not pair.receiver.is_idle()
    transport.finish(copy=True)  # it lands late, into pages nobody else was given
    pair.run()
    assert pair.receiver.failed[rid].startswith("no KV within")
    pair.assert_nothing_held()


def test_a_write_that_fails_fails_its_request_and_frees_both_sides():
    transport = StalledTransport()
    pair = Pair(page_size=16, transport=transport)
    prompts = prompts_sharing_a_prefix(n=2)
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts]
    while len(transport.stalled) < 2:
        pair.receiver.step()
    transport.finish(copy=False)
    pair.run()
    assert pair.receiver.failed == {r: "the prefill side failed: the link went down" for r in rids}
    assert pair.sender.stats.failed == 2
    pair.assert_nothing_held()


def test_a_prefill_side_that_never_answers_a_cancel_is_dropped_and_both_sides_free_their_pages():
    transport = StalledTransport()
    pair = Pair(page_size=16, transport=transport, kv_timeout_s=1e-9, cancel_timeout_s=1e-9)
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts_sharing_a_prefix(n=2)]
    while not pair.receiver.is_idle():
        pair.receiver.step()
        pair.check()
    assert set(pair.receiver.failed) == set(rids) and pair.receiver.held_tokens() == 0
    with pytest.raises(RuntimeError, match="prefill side is gone"):
        pair.receiver.add_request([1, 2, 3], 2)
    transport.finish(copy=False)  # the writes end; the sender sees its peer gone and answers no one
    while not pair.sender.is_idle():
        pair.sender.step()
    assert pair.sender.channels() == []
    pair.assert_nothing_held()


def test_a_decode_side_that_dies_leaves_no_page_held_on_the_prefill_side():
    pair = Pair(page_size=16)
    pair.auto = False
    for p in prompts_sharing_a_prefix(n=4):
        pair.receiver.add_request(p, MAX_NEW)
    pair.receiver.step()  # four requests ask for their KV
    pair.channel.close()  # the decode process dies: its channel closes and its pool is gone
    pair.transport.unregister(pair.receiver.buffers)
    pair.sender.step()    # reads the requests, prefills, then finds its peer gone
    while not pair.sender.is_idle():
        pair.sender.step()
        pair.sender.check_invariants()
    assert pair.sender.channels() == [] and pair.sender.held_tokens() == 0
    prefill = pair.prefill
    assert prefill.tree_cache.protected_size() == 0
    free = prefill.token_allocator.available_size()
    assert free + prefill.tree_cache.evictable_size() == prefill.token_allocator.size


def test_a_decode_side_that_goes_while_its_write_is_in_flight_frees_the_prefill_side():
    transport = StalledTransport()
    pair = Pair(page_size=16, transport=transport)
    pair.receiver.add_request(prompts_sharing_a_prefix(n=1)[0], MAX_NEW)
    while not transport.stalled:
        pair.receiver.step()
    pair.channel.close()
    transport.finish(copy=False)  # the dead peer's pool refuses the write
    while not pair.sender.is_idle():
        pair.sender.step()
        pair.sender.check_invariants()
    assert pair.sender.held_tokens() == 0 and pair.sender.channels() == []


def test_a_prefill_side_that_breaks_the_protocol_is_dropped_and_frees_the_decode_side():
    pair = Pair(page_size=16)
    pair.auto = False
    rid = pair.receiver.add_request([1, 2, 3, 4], MAX_NEW)
    pair.receiver.step()
    pair.sender.channels()[0].send(Welcome({}))  # an answer that is no answer
    pair.receiver.step()
    assert pair.receiver.failed[rid].startswith("the prefill side is gone: the prefill side broke the protocol")
    assert pair.receiver.held_tokens() == 0
    pair.receiver.check_invariants()


def test_close_cancels_what_waits_and_waits_for_the_prefill_side_to_let_go():
    pair = Pair(page_size=16)
    pair.auto = False
    pair.receiver.add_request([5, 6, 7], MAX_NEW)
    pair.receiver.add_request(list(range(40)), MAX_NEW)
    pair.receiver.step()
    pair.auto = True
    pair.receiver.close()
    assert pair.receiver.held_tokens() == 0 and set(pair.receiver.failed.values()) == {"closed"}
    while not pair.sender.is_idle():
        pair.sender.step()
    pair.assert_nothing_held()


# ---- the parts -------------------------------------------------------------------------------------------------
def test_page_runs_cut_where_either_side_stops_counting_up():
    src, dst, lengths = page_runs(np.array([3, 4, 5, 9, 10, 11]), np.array([1, 2, 7, 8, 9, 4]))
    assert src.tolist() == [3, 5, 9, 11] and dst.tolist() == [1, 7, 8, 4] and lengths.tolist() == [2, 1, 2, 1]


@pytest.mark.parametrize("make", [
    lambda: MHAKVPool(64, 4, torch.bfloat16, 2, 8, 3),
    lambda: MHAKVPool(64, 4, torch.float16, 2, 8, 2, layout="HND"),
    lambda: MHAKVPool(64, 4, torch.float32, 2, 8, 2, kv_cache_dtype="int4", quant_group=4),
    lambda: MLAKVPool(64, 4, torch.bfloat16, 16, 8, 2, kv_cache_dtype="fp8_e4m3"),
])
def test_the_copy_transport_moves_pages_bit_for_bit_in_every_layout(make):
    src, dst = make(), make()
    for buf in (b for layer in range(src.layer_num) for b in _buffers(src, layer)):
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8))
    transport = CopyTransport()
    a, b = transport.register(src), transport.register(dst)
    assert transport.write(a, [2, 3, 9], b, [5, 6, 1], layers=[0]).wait(1.0) is TransferStatus.DONE
    assert not any(_page(d, 5, src.page_size, dst).any() for d in _buffers(dst, 1))  # layer 0 only, so far
    assert transport.write(a, [2, 3, 9], b, [5, 6, 1], layers=range(1, src.layer_num)).poll() is TransferStatus.DONE
    ps = src.page_size
    for layer in range(src.layer_num):
        for s, d in zip(_buffers(src, layer), _buffers(dst, layer)):
            for sp, dp in ((2, 5), (3, 6), (9, 1)):
                assert torch.equal(_page(s, sp, ps, src), _page(d, dp, ps, dst))
            assert not _page(d, 2, ps, dst).view(torch.uint8).any()  # nothing else was written


def _buffers(pool, layer):
    from kvmem.disagg.layout import layer_buffers
    return layer_buffers(pool, layer)


def _page(buf, page, ps, pool):
    return buf.view(torch.uint8).reshape(pool.num_pages, -1)[page]


def test_a_write_checks_its_pages_before_anything_moves():
    pool = MHAKVPool(64, 4, torch.float32, 1, 4, 1)
    transport = CopyTransport()
    a, b = transport.register(pool), transport.register(MHAKVPool(64, 4, torch.float32, 1, 4, 1))
    for src, dst, match in (([1, 2], [3], "src_pages has 2 pages"), ([0], [1], "src_pages holds page 0"),
                            ([1], [17], "dst_pages holds page 17"), ([1, 2], [3, 3], "more than once"),
                            ([[1]], [1], "1-D")):
        with pytest.raises(ValueError, match=match):
            transport.write(a, src, b, dst)
    for layers in ([1], [0, 0], "0"):
        with pytest.raises(ValueError, match="layers must be distinct layer ids in"):
            transport.write(a, [1], b, [1], layers=layers)
    other = transport.register(MHAKVPool(64, 4, torch.float32, 2, 4, 1))
    with pytest.raises(ValueError, match="store pages differently"):
        transport.write(a, [1], other, [1])
    transport.unregister(b)
    gone = transport.write(a, [1], b, [1])
    assert gone.poll() is TransferStatus.FAILED and "is gone" in gone.error


def test_layouts_round_trip_and_name_their_first_difference():
    layout = KVLayout.of(MHAKVPool(64, 16, torch.bfloat16, 8, 128, 4), "llama")
    assert KVLayout.from_dict(layout.to_dict()) == layout and layout.mismatch(layout) is None
    other = KVLayout.of(MHAKVPool(64, 16, torch.bfloat16, 4, 128, 4), "llama")
    assert other.mismatch(layout) == "head_shape (4, 128, 128) here, (8, 128, 128) at the peer"
    assert layout.bytes_per_page == 2 * 16 * 8 * 128 * 2 * 4
    with pytest.raises(ValueError, match="needs the fields"):
        KVLayout.from_dict({"model": "x"})
    with pytest.raises(TypeError, match="MHAKVPool or MLAKVPool"):
        KVLayout.of(object())


def test_messages_round_trip_as_json_lines_and_garbage_is_refused():
    msg = KVRequest(3, [1, 2], 0, [4])
    assert decode_message(encode_message(msg)) == msg
    for line in (b"{", b'{"type": "Nope"}', b'{"type": "Cancel"}', b"[]"):
        with pytest.raises(ValueError, match="not a message"):
            decode_message(line)


def test_a_closed_local_channel_reads_as_peer_gone_after_what_was_sent():
    a, b = LocalChannel.pair()
    a.send(KVFailed(1, "x"))
    a.close()
    assert b.recv() == [KVFailed(1, "x")]
    with pytest.raises(PeerGone):
        b.recv()
    with pytest.raises(PeerGone):
        b.send(KVFailed(2, "y"))


# ---- the scheduler's seams -------------------------------------------------------------------------------------
def scheduler_world(page_size=1):
    pool = ReqToTokenPool(4, 64)
    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    return Scheduler(pool, alloc, RadixCache(pool, alloc, page_size=page_size))


def test_hand_off_refuses_a_request_that_is_not_decoding_here():
    sched = scheduler_world(page_size=4)
    req = Req("a", [1, 2, 3, 4, 5, 6], max_new_tokens=3)
    with pytest.raises(ValueError, match="not decoding here"):
        sched.hand_off(req)
    sched.add_request(req)
    batch = sched.step()
    with pytest.raises(RuntimeError, match="pending batch"):
        sched.hand_off(req)
    sched.process_batch_result(batch, [9])
    sched.hand_off(req)
    assert sched.is_idle() and sched.held_by_requests() == 0
    sched.check_invariants(held_outside=[req])  # its partial last page (4 slots) is held outside the loop now
    with pytest.raises(AssertionError, match="memory leak"):
        sched.check_invariants()
    sched.tree_cache.release_req(req, cache=True)
    sched.check_invariants()


def test_add_prefilled_request_refuses_a_request_without_its_kv_and_changes_nothing():
    sched = scheduler_world()
    req = Req("a", [1, 2, 3, 4], max_new_tokens=3)
    with pytest.raises(ValueError, match="must hold memory"):
        sched.add_prefilled_request(req)
    from kvmem.disagg import preallocate
    assert preallocate(req, sched.req_to_token_pool, sched.token_allocator, sched.tree_cache) == 0
    with pytest.raises(ValueError, match="one output token"):
        sched.add_prefilled_request(req)
    req.output_ids.append(5)
    req.cache_protected_len = 2  # a prefix the tree does not hold
    with pytest.raises(ValueError, match="is not the path of its first 2 tokens"):
        sched.add_prefilled_request(req)
    req.cache_protected_len = 0
    assert sched.add_prefilled_request(req) is False and sched.running == [req]
    sched.check_invariants()
    assert req.status is ReqStatus.RUNNING and sched.tree_cache.total_size() == 4  # its prompt entered the tree


# ---- the Mooncake transfer's bookkeeping, over a stand-in for its engine ----------------------------------------
class FakeTransferEngine:
    """transfer_submit_write / transfer_check_status as Mooncake's binding answers them: a batch id (0 when the
    write cannot start), then 0 while in flight and 1 or -1 once it ended."""

    def __init__(self, refuse_after=None):
        self.status, self.submitted, self.refuse_after = {}, [], refuse_after

    def transfer_submit_write(self, peer, src, dst, length):
        if self.refuse_after is not None and len(self.submitted) >= self.refuse_after:
            return 0
        self.submitted.append((src, dst, length))
        self.status[len(self.submitted)] = 0
        return len(self.submitted)

    def transfer_check_status(self, batch):
        return self.status[batch]

    def end(self, code=1):
        for batch, status in self.status.items():
            if status == 0:
                self.status[batch] = code

    def in_flight(self):
        return sum(1 for s in self.status.values() if s == 0)


def mooncake_transfer(engine, parts=10, max_in_flight=4, timeout_s=60.0):
    from kvmem.disagg.mooncake_transport import _MooncakeTransfer
    transfer = _MooncakeTransfer(engine, "127.0.0.1:9", [(i, i, 1) for i in range(parts)], max_in_flight, timeout_s)
    transfer.poll()
    return transfer


def test_a_mooncake_write_keeps_at_most_max_in_flight_parts_moving_and_ends_when_all_have():
    engine = FakeTransferEngine()
    transfer = mooncake_transfer(engine)
    assert len(engine.submitted) == 4
    for submitted in (8, 10):
        engine.end()
        assert transfer.poll() is TransferStatus.PENDING  # the next parts start as earlier ones end
        assert len(engine.submitted) == submitted and engine.in_flight() <= 4
    engine.end()
    assert transfer.poll() is TransferStatus.DONE and transfer.error == ""
    assert [part[0] for part in engine.submitted] == list(range(10))


def test_a_mooncake_write_with_a_failed_part_fails_only_once_nothing_it_started_moves():
    engine = FakeTransferEngine()
    transfer = mooncake_transfer(engine)
    engine.status[2] = -1
    assert transfer.poll() is TransferStatus.PENDING  # parts 1, 3 and 4 still move: their pages are still in use
    assert len(engine.submitted) == 4  # nothing more starts after a failure
    engine.end()
    assert transfer.poll() is TransferStatus.FAILED and "failed" in transfer.error


def test_a_mooncake_write_that_cannot_start_fails_with_the_peer_named():
    transfer = mooncake_transfer(FakeTransferEngine(refuse_after=0))
    assert transfer.poll() is TransferStatus.FAILED and "127.0.0.1:9 is not listening" in transfer.error


def test_a_mooncake_write_still_moving_after_its_timeout_is_given_up():
    engine = FakeTransferEngine()
    transfer = mooncake_transfer(engine, timeout_s=1e-9)
    assert transfer.poll() is TransferStatus.FAILED and "did not end within" in transfer.error


def test_a_prefill_pool_full_of_requests_being_sent_waits_for_their_writes_instead_of_failing():
    # Four pages: a 40-token prompt being sent holds three of them, so the next one cannot be admitted until it
    # has been sent.
    transport = StalledTransport()
    pair = Pair(page_size=16, transport=transport, prefill_capacity=64)
    pair.auto = False
    for first_token in (0, 100):
        pair.receiver.add_request(list(range(first_token, first_token + 40)), MAX_NEW)
    pair.receiver.step()
    assert pair.sender.step()  # the first is prefilled and its write stalls
    assert len(transport.stalled) == 1
    assert not pair.sender.step()  # the second cannot be admitted: nothing runs, nothing fails
    pair.check()
    transport.finish(copy=True)
    pair.auto = True
    while not pair.receiver.is_idle():
        pair.receiver.step()
        transport.finish(copy=True)
        pair.check()
    assert not pair.receiver.failed and pair.sender.stats.requests == 2
    pair.assert_nothing_held()


def test_only_a_handed_off_request_can_be_released_and_only_once():
    engine = Engine(model_of("llama-tiny"), capacity_tokens=64, page_size=16)
    rid = engine.add_request(list(range(20)), 2)
    engine.step()
    (req,) = [r for r in engine.scheduler.running if r.rid == rid]
    assert engine.hand_off(req).output_ids == req.output_ids and engine.is_idle()
    engine.release_handed_off(req)
    with pytest.raises(ValueError, match="was not handed off"):
        engine.release_handed_off(req)
    assert req.status is ReqStatus.FINISHED and engine.tree_cache.total_size() == 16
    engine.scheduler.check_invariants()
