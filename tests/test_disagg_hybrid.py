"""kvmem.disagg between hybrid engines (Gemma 3 and gpt-oss sliding-window layers, Qwen3-Next linear-attention
layers) in one process: the full layers' KV pages, the window tail's window KV and the linear layers' state move, so
greedy tokens equal one engine's and transformers' `generate`; each pool's `free + evictable + protected + held ==
total` holds on both sides after every step and every fault; engines that differ in layer kinds, window or state
shapes are refused by name before any page is taken.

Before this, the seams gave wrong tokens silently: a request pre-allocated on a hybrid decode engine got window slots
for its whole prompt and no state slot, and admitting it after copying the KV pool's pages (all the docs said to
copy) decoded from unwritten window KV and the padding state slot
(`test_the_seams_give_a_hybrid_request_a_state_slot_and_window_slots_for_its_window_tail_only`).
"""

import random

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

from test_disagg import Pair, StalledTransport  # noqa: E402

from kvmem.disagg import CopyTransport, KVBuffers, KVReceiver, KVSender, LocalChannel, preallocate  # noqa: E402
from kvmem.disagg.layout import layer_buffers, num_layers  # noqa: E402
from kvmem.disagg.messages import Hello, KVFailed, KVRequest, Welcome  # noqa: E402
from kvmem.disagg.request_memory import request_kv, window_start  # noqa: E402
from kvmem.disagg.transport import EngineBuffers  # noqa: E402
from kvmem.engine import Engine, build_model  # noqa: E402
from kvmem.hybrid import StatePool  # noqa: E402

WINDOWED = ["gemma3-tiny", "gpt-oss-tiny"]
HYBRID = WINDOWED + ["qwen3-next-tiny"]
MAX_NEW = 6
W = 8  # the tiny presets' sliding window
_MODELS, _REFERENCE = {}, {}


def model_of(preset, **overrides):
    key = (preset, repr(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(preset, **overrides)
    return _MODELS[key]


def linear(preset):
    return preset.startswith("qwen3-next")


def prompts_sharing_a_head(n=4, seed=0, vocab=256):
    """Prompts of 61..179 tokens (many windows of 8, a few of Qwen3-Next's 64-token state grid) sharing heads."""
    rng = random.Random(seed)
    head = [rng.randrange(vocab) for _ in range(150)]
    return [head[:rng.randrange(60, 150)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            for _ in range(n)]


def hf_generate(model, prompts, max_new_tokens=MAX_NEW):
    return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)[0, len(p):].tolist()
            for p in prompts]


def reference(preset):
    if preset not in _REFERENCE:
        _REFERENCE[preset] = hf_generate(model_of(preset), prompts_sharing_a_head())
    return _REFERENCE[preset]


def small_pools(preset):
    """Decode-side pools smaller than one prompt's window KV or all requests' states: the decode side holds only
    window tails, and waits for state slots."""
    return dict(state_slots=3) if linear(preset) else dict(window_tokens=48)


class HybridPair(Pair):
    """test_disagg.Pair with a hybrid model, and engine options (pool sizes) for either side."""

    def __init__(self, preset, page_size, transport=None, decode=None, prefill=None, **receiver_options):
        super().__init__(page_size=page_size, transport=transport, model=model_of(preset), prefill_options=prefill,
                         decode_options=decode, **receiver_options)

    def assert_nothing_held(self):
        """Every full slot, window slot and state slot is free or the tree's unlocked cache, on both sides."""
        self.check()
        assert self.sender.held_tokens() == self.receiver.held_tokens() == 0
        for engine in (self.prefill, self.decode):
            assert_engine_holds_nothing(engine)


def assert_engine_holds_nothing(engine):
    assert engine.is_idle()
    tree, alloc = engine.tree_cache, engine.token_allocator
    assert tree.protected_size() == 0 and alloc.available_size() + tree.evictable_size() == alloc.size
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    if tree.window is not None:
        assert tree.window_protected_size() == 0
        assert alloc.window_available_size() + tree.window_evictable_size() == alloc.window_size
    if tree.state_pool is not None:
        assert tree.state_protected_size() == 0
        assert tree.state_available_size() + tree.state_evictable_size() == tree.state_pool.size


# ---- tokens ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", HYBRID)
def test_hybrid_engines_hand_off_and_give_one_engines_and_transformers_greedy_tokens(preset, page_size):
    prompts = prompts_sharing_a_head()
    assert min(map(len, prompts)) > 7 * W
    expected = Engine(model_of(preset), capacity_tokens=1024, page_size=page_size).generate(prompts, MAX_NEW)
    assert expected == reference(preset)
    pair = HybridPair(preset, page_size, decode=small_pools(preset))
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts]
    outputs = pair.run()
    assert [outputs[r] for r in rids] == expected
    receiver, sender, layout = pair.receiver.stats, pair.sender.stats, pair.receiver.layout
    assert receiver.received_pages == sender.sent_pages > 0 and receiver.received_bytes == sender.sent_bytes
    window_and_states = receiver.received_bytes - receiver.received_pages * layout.bytes_per_page
    if linear(preset):
        assert window_and_states == len(prompts) * layout.state_bytes > 0
    else:  # each request's window tail only: W - 1 tokens in whole pages, a page more where the prompt ends mid-page
        tail_pages = -(-(W - 1 + 2 * (page_size - 1)) // page_size)
        assert 0 < window_and_states <= len(prompts) * tail_pages * layout.window_bytes_per_page
    pair.assert_nothing_held()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", HYBRID)
def test_a_conversations_next_turn_asks_only_for_what_the_decode_sides_cache_cannot_resume(preset, page_size):
    model = model_of(preset)
    rng = random.Random(5)
    first = [rng.randrange(256) for _ in range(64 if linear(preset) else 45)]  # Qwen3-Next: a state on the grid
    pair = HybridPair(preset, page_size)
    (out,) = pair.receiver.generate([first], MAX_NEW)
    turn = first + out + [rng.randrange(256) for _ in range(20)]
    assert pair.receiver.generate([turn], MAX_NEW) == hf_generate(model, [turn])
    # The decode side resumed where its cache can: Qwen3-Next at the state it kept for the first prompt, a windowed
    # model at the first turn's end (its window tail is live there; its head is full KV only).
    resumed = 64 if linear(preset) else (len(first) + MAX_NEW - 1) // page_size * page_size
    assert pair.receiver.stats.cached_tokens == pair.decode.stats.cached_tokens == resumed
    pair.assert_nothing_held()


# ---- the seams -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", HYBRID)
def test_the_seams_give_a_hybrid_request_a_state_slot_and_window_slots_for_its_window_tail_only(preset):
    model, page_size = model_of(preset), 4
    prompt = prompts_sharing_a_head(n=1, seed=2)[0]
    engines = [Engine(model, capacity_tokens=256, page_size=page_size) for _ in range(2)]
    prefill, decode = engines
    rid = prefill.add_request(prompt, 2, stop_token_ids=())
    prefill.step()
    (sent,) = [r for r in prefill.scheduler.running if r.rid == rid]
    prefill.hand_off(sent)
    req = decode.new_req(prompt, MAX_NEW)
    assert preallocate(req, decode.req_to_token_pool, decode.token_allocator, decode.tree_cache) == 0
    src, dst = (request_kv(r, e.req_to_token_pool, e.tree_cache, 0) for r, e in ((sent, prefill), (req, decode)))
    tree = decode.tree_cache
    if linear(preset):
        assert dst.state_slot and src.state_slot and not len(dst.window_pages)
    else:
        tail = -(-(len(prompt) - window_start(tree, 0, len(prompt))) // page_size)
        assert len(dst.window_pages) == len(src.window_pages) == tail < len(dst.pages)
        assert dst.window_pages.all() and src.window_pages.all() and dst.state_slot == 0
        # Only the tail's window slots are taken: the head of the prompt is full KV only.
        assert decode.token_allocator.window_size - decode.token_allocator.window_available_size() == \
            tail * page_size
    decode.scheduler.check_invariants(held_outside=[req])
    prefill.scheduler.check_invariants(held_outside=[sent])
    # What moves: each pool's pages (what a transport's write does), then the request decodes as one engine would.
    pools = [(prefill.pool.full_pool, decode.pool.full_pool, src.pages, dst.pages),
             (prefill.pool.window_pool, decode.pool.window_pool, src.window_pages, dst.window_pages),
             (prefill.pool.state_pool, decode.pool.state_pool, [src.state_slot], [dst.state_slot])]
    for a, b, src_pages, dst_pages in pools:
        if a is None:
            continue
        rows = 1 if isinstance(a, StatePool) else page_size  # a state pool's page is one slot
        for layer in range(num_layers(a)):
            for s, d in zip(layer_buffers(a, layer), layer_buffers(b, layer)):
                for sp, dp in zip(list(src_pages), list(dst_pages)):
                    d[dp * rows:(dp + 1) * rows] = s[sp * rows:(sp + 1) * rows]
    req.output_ids.append(sent.output_ids[0])
    prefill.release_handed_off(sent)
    assert decode.add_prefilled_request(req) is None
    outputs = {}
    while not decode.is_idle():
        outputs.update((o.rid, o.output_ids) for o in decode.step())
        decode.scheduler.check_invariants()
    assert outputs[req.rid] == hf_generate(model, [prompt])[0]
    for engine in engines:
        assert_engine_holds_nothing(engine)


def test_a_linear_model_refuses_to_admit_a_request_without_a_state_slot_and_changes_nothing():
    decode = Engine(model_of("qwen3-next-tiny"), capacity_tokens=256, page_size=4)
    req = decode.new_req(list(range(10, 30)), MAX_NEW)
    assert preallocate(req, decode.req_to_token_pool, decode.token_allocator, decode.tree_cache) == 0
    tree = decode.tree_cache
    tree._release_state(req.req_pool_idx)  # what the seams did before: no state slot of its own
    req.output_ids.append(5)
    with pytest.raises(ValueError, match="has no state slot"):
        decode.add_prefilled_request(req)
    assert decode.scheduler.running == [] and tree.total_size() == 0


# ---- bad input: the handshake --------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill, decode, field", [
    (("gemma3-tiny", {}), ("gemma3-tiny", dict(sliding_window=4)), "window"),
    (("gemma3-tiny", {}), ("gemma3-tiny", dict(layer_types=["full_attention", "sliding_attention",
                                                             "sliding_attention"])), "layer_kinds"),
    (("qwen3-next-tiny", {}), ("qwen3-next-tiny", dict(linear_conv_kernel_dim=3)), "state_shape"),
    (("gpt-oss-tiny", {}), ("llama-tiny", {}), "model"),
    (("llama-tiny", {}), ("qwen3-next-tiny", {}), "model"),
])
def test_hybrid_engines_that_differ_in_kinds_window_or_state_shapes_are_refused_by_name(prefill, decode, field):
    transport = CopyTransport()
    engines = [Engine(model_of(p, **o), capacity_tokens=256, page_size=4) for p, o in (prefill, decode)]
    sender = KVSender(engines[0], transport)
    with pytest.raises(ValueError, match=f"KV layouts differ: {field} ") as info:
        KVReceiver(engines[1], transport, sender.connect_local())
    assert "\n" not in str(info.value)
    assert sender.channels() == [] and sender.is_idle()
    for engine in engines:
        assert engine.token_allocator.available_size() == engine.token_allocator.size
        assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    for endpoint in range(len([p for p in sender.pools if p is not None]), 6):  # the refused side's registrations end
        with pytest.raises(RuntimeError, match="not registered"):
            transport.check_peer(KVBuffers(f"copy:{endpoint}", (), (), 1))


def test_the_sender_answers_bad_window_pages_or_state_slots_with_kv_failed():
    transport = CopyTransport()
    for preset, bad in (("gemma3-tiny", [KVRequest(1, list(range(20)), 0, [1, 2, 3, 4, 5], [1]),
                                         KVRequest(2, list(range(20)), 0, [1, 2, 3, 4, 5], [1, 1, 2]),
                                         KVRequest(3, list(range(20)), 0, [1, 2, 3, 4, 5], [1, 2, 3], 7)]),
                        ("qwen3-next-tiny", [KVRequest(1, list(range(20)), 0, [1, 2, 3, 4, 5], None, 0),
                                             KVRequest(2, list(range(20)), 0, [1, 2, 3, 4, 5], None, 99),
                                             KVRequest(3, list(range(20)), 0, [1, 2, 3, 4, 5], [1], 1)])):
        engines = [Engine(model_of(preset), capacity_tokens=256, page_size=4, max_running_requests=4)
                   for _ in range(2)]
        sender = KVSender(engines[0], transport)
        receiver_pools = EngineBuffers.register(transport, engines[1])  # the test speaks for the decode side
        decode_end, prefill_end = LocalChannel.pair(peer_step=sender.step)
        sender.accept(prefill_end)
        assert isinstance(decode_end.request(Hello(sender.layout.to_dict(), *receiver_pools.to_dicts()), 1.0),
                          Welcome)
        for msg in bad:
            decode_end.send(msg)
        answers = []
        while len(answers) < len(bad):
            answers += decode_end.recv()
        assert [type(a) for a in answers] == [KVFailed] * 3, answers
        assert all(a.reason.startswith("bad KV request") for a in answers)
        assert sender.is_idle()
        sender.check_invariants()


# ---- faults: nothing leaks in any pool -------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["gemma3-tiny", "qwen3-next-tiny"])
def test_aborts_timeouts_and_failed_writes_leave_no_window_or_state_slot_held(preset):
    prompts = prompts_sharing_a_head(n=3, seed=4)
    # An abort while the KV is asked for, then the others land.
    pair = HybridPair(preset, 4)
    pair.auto = False
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts]
    pair.receiver.step()
    pair.check()
    pair.receiver.abort(rids[0])
    pair.auto = True
    outputs = pair.run()
    assert pair.receiver.failed == {rids[0]: "aborted"} and set(outputs) == set(rids[1:])
    pair.assert_nothing_held()
    # A write that stalls past the deadline keeps every pool's pages until it ends; then one that fails.
    transport = StalledTransport()
    pair = HybridPair(preset, 4, transport=transport, kv_timeout_s=1e-9)
    rid = pair.receiver.add_request(prompts[0], MAX_NEW)
    while not transport.stalled:
        pair.receiver.step()
        pair.check()
    pair.receiver.step()
    pair.check()
    assert pair.receiver.held_tokens() > 0 and pair.sender.held_tokens() > 0
    transport.finish(copy=True)
    pair.run()
    assert pair.receiver.failed[rid].startswith("no KV within")
    pair.assert_nothing_held()
    transport = StalledTransport()
    pair = HybridPair(preset, 4, transport=transport)
    rids = [pair.receiver.add_request(p, MAX_NEW) for p in prompts[:2]]
    while pair.sender.stats.requests < 2:  # both prefilled and handed off: their writes stall
        pair.receiver.step()
    transport.finish(copy=False)
    pair.run()
    assert pair.receiver.failed == {r: "the prefill side failed: the link went down" for r in rids}
    pair.assert_nothing_held()
