"""KV events: vLLM's schema, both msgpack wire forms, strict decoding, and per-step batching."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.events import (
    MEDIUM_CPU_PINNED,
    MEDIUM_DISK,
    MEDIUM_GPU,
    WIRE_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventCollector,
    EventDecodeError,
    decode_batch,
    encode_batch,
)

STORED = BlockStored([1, 2**64 - 1], None, [10, 11, 12, 13], 2)


def sample_batch(rank=0):
    return EventBatch(1.5, [STORED, BlockStored([-(2**63)], 1, [7], 1, lora_id=3, medium=MEDIUM_CPU_PINNED,
                                                lora_name="ad"),
                            BlockRemoved([1], MEDIUM_DISK), AllBlocksCleared()], rank)


# ---- the schema ------------------------------------------------------------------------------------
def test_events_default_to_the_gpu_medium_and_hold_tuples():
    assert STORED.medium == MEDIUM_GPU and BlockRemoved([3]).medium == MEDIUM_GPU
    assert STORED.block_hashes == (1, 2**64 - 1) and STORED.token_ids == (10, 11, 12, 13)


def test_token_ids_span_int64_and_hashes_span_signed_through_unsigned_64_bits():
    e = BlockStored([-(2**63), 2**64 - 1], 0, [-(2**63), 2**63 - 1], 1)
    assert e.token_ids == (-(2**63), 2**63 - 1) and e.block_hashes == (-(2**63), 2**64 - 1)


def test_numpy_hashes_and_tokens_become_python_ints():
    e = BlockStored(np.array([5, 6], dtype=np.uint64), np.uint64(4), np.arange(4), 2)
    assert e == BlockStored([5, 6], 4, [0, 1, 2, 3], 2)
    assert all(type(x) is int for x in e.block_hashes + e.token_ids + (e.parent_block_hash,))


@pytest.mark.parametrize("make, error, match", [
    (lambda: BlockStored([], None, [], 1), ValueError, "block_hashes is empty"),
    (lambda: BlockStored([1], None, [1, 2], 1), ValueError, "must be 1"),
    (lambda: BlockStored([1], None, [1], 0), ValueError, "block_size must be a positive int"),
    (lambda: BlockStored([1], None, [], 0), ValueError, "block_size must be a positive int"),
    (lambda: BlockStored([1], None, [2**63], 1), ValueError, "token_ids holds a token id outside int64"),
    (lambda: EventBatch(float("nan"), []), ValueError, "ts must be a number"),
    (lambda: BlockStored([1.5], None, [1], 1), TypeError, "block_hashes"),
    (lambda: BlockStored([True], None, [1], 1), TypeError, "block_hashes"),
    (lambda: BlockStored([2**64], None, [1], 1), ValueError, "64-bit"),
    (lambda: BlockStored([1], "x", [1], 1), TypeError, "parent_block_hash"),
    (lambda: BlockStored([1], None, ["a"], 1), TypeError, "token_ids"),
    (lambda: BlockStored([1], None, "a", 1), TypeError, "token_ids"),
    (lambda: BlockStored([1], None, [1], 1, medium=3), TypeError, "medium"),
    (lambda: BlockStored([1], None, [1], 1, lora_id="a"), TypeError, "lora_id"),
    (lambda: BlockStored({1, 2}, None, [1, 2], 1), TypeError, "block_hashes must be a sequence.*got set"),
    (lambda: BlockStored([1], None, {7: 0}, 1), TypeError, "token_ids must be a sequence.*got dict"),
    (lambda: BlockRemoved({1: 0}), TypeError, "block_hashes"),
    (lambda: BlockRemoved(5), TypeError, "block_hashes"),
    (lambda: BlockRemoved([]), ValueError, "empty"),
    (lambda: EventBatch("now", []), ValueError, "ts"),
    (lambda: EventBatch(1.0, ["event"]), TypeError, "events"),
    (lambda: EventBatch(1.0, [], -1), ValueError, "data_parallel_rank"),
])
def test_bad_event_fields_raise_naming_the_field(make, error, match):
    with pytest.raises(error, match=match):
        make()


# ---- the wire forms ----------------------------------------------------------------------------------
@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_every_event_round_trips_in_both_wire_forms(wire_format):
    for rank in (0, 3, None):
        batch = sample_batch(rank)
        assert decode_batch(encode_batch(batch, wire_format)) == batch


def test_the_map_form_is_vllms_named_fields_with_the_type_tag_first():
    ts, events, rank = msgpack.unpackb(encode_batch(EventBatch(2.0, [STORED, BlockRemoved([1]),
                                                                     AllBlocksCleared()], 1)))
    assert (ts, rank) == (2.0, 1)
    assert list(events[0].items()) == [("type", "BlockStored"), ("block_hashes", [1, 2**64 - 1]),
                                       ("parent_block_hash", None), ("token_ids", [10, 11, 12, 13]),
                                       ("block_size", 2), ("lora_id", None), ("medium", "GPU"), ("lora_name", None)]
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_the_array_form_is_vllms_positional_layout():
    ts, events, rank = msgpack.unpackb(encode_batch(EventBatch(2.0, [STORED, BlockRemoved([1]),
                                                                     AllBlocksCleared()]), "array"))
    assert rank is None
    assert events == [["BlockStored", [1, 2**64 - 1], None, [10, 11, 12, 13], 2, None, "GPU", None],
                      ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]]


def test_a_batch_without_a_rank_sends_nil_for_it_and_its_ts_as_a_float64():
    payload = encode_batch(EventBatch(3, []))
    assert payload == b"\x93\xcb" + np.float64(3.0).byteswap().tobytes() + b"\x90\xc0"
    assert decode_batch(msgpack.packb([3.0, []])) == EventBatch(3.0, [])  # vLLM before the rank existed


def test_decoding_accepts_older_layouts_bytes_hashes_and_unknown_fields():
    old = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2], 2, None], ["BlockRemoved", [5]],
                               {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                                "token_ids": [3], "block_size": 1, "lora_id": None, "medium": "CPU",
                                "lora_name": None, "group_idx": 0, "session_id": "s"},
                               ["BlockRemoved", [6], "GPU", 0, "LOCAL"]]])
    batch = decode_batch(old)
    assert batch.events == (BlockStored([5], None, [1, 2], 2, medium=None), BlockRemoved([5], None),
                            BlockStored([b"\x01" * 32], None, [3], 1, medium="CPU"), BlockRemoved([6]))
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "not msgpack"),
    (b"\x92\xcb", "not msgpack"),
    (msgpack.packb({"ts": 1}), "array"),
    (msgpack.packb([1.0]), "array"),
    (msgpack.packb([1.0, {}]), "array"),
    (msgpack.packb([1.0, [], 0, 9]), "array"),
    (msgpack.packb(["now", []]), "ts"),
    (msgpack.packb([1.0, [], -2]), "data_parallel_rank"),
    (msgpack.packb([1.0, [7]]), "event 0 is neither"),
    (msgpack.packb([1.0, [["Teleported", [1]]]]), "unknown type 'Teleported'"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "lacks required"),
    (msgpack.packb([1.0, [["BlockStored", [1], None]]]), "lacks required"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1]]]]), "lacks required field\\(s\\) \\['block_size'\\]"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 1]]]), "event 0 \\(BlockStored\\).*must be 1"),
    (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "block_hashes"),
    (msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]), "medium"),
    (msgpack.packb([1.0, [["BlockRemoved", [True]]]]), "block_hashes"),
    # a map where an array belongs: its keys would have been read as the hashes or tokens
    (msgpack.packb([1.0, [["BlockRemoved", {5: 1}]]]), "block_hashes must be a sequence.*got dict"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": {1: 0, 2: 0}, "parent_block_hash": None,
                           "token_ids": [1, 2], "block_size": 1}]]), "block_hashes must be a sequence.*got dict"),
    (msgpack.packb([1.0, [["BlockStored", [1, 2], None, {1: 1, 2: 2}, 1]]]), "token_ids must be a sequence.*dict"),
])
def test_malformed_payloads_raise_event_decode_error_naming_the_problem(payload, match):
    with pytest.raises(EventDecodeError, match=match):
        decode_batch(payload)


def test_decode_refuses_what_is_not_bytes():
    with pytest.raises(TypeError, match="^payload must be bytes, got str$"):
        decode_batch("text")


def test_a_collector_names_the_kind_of_what_is_not_an_event():
    with pytest.raises(TypeError, match="^event must be BlockStored, BlockRemoved or AllBlocksCleared, got dict$"):
        EventCollector()({})


@settings(deadline=None)  # as the other property tests: a busy machine is not a failure
@given(st.lists(st.one_of(
    st.builds(lambda hs, parent, bs, medium: BlockStored(hs, parent, list(range(len(hs) * bs)), bs, medium=medium),
              st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=4),
              st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.integers(1, 3),
              st.sampled_from([MEDIUM_GPU, MEDIUM_CPU_PINNED, MEDIUM_DISK, None])),
    st.builds(BlockRemoved, st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4)),
    st.just(AllBlocksCleared())), max_size=6), st.sampled_from(WIRE_FORMATS))
def test_any_batch_round_trips(events, wire_format):
    batch = EventBatch(0.25, events, 2)
    assert decode_batch(encode_batch(batch, wire_format)) == batch


def test_encode_refuses_an_unknown_wire_format_or_a_non_batch():
    with pytest.raises(ValueError, match="wire_format"):
        encode_batch(sample_batch(), "json")
    with pytest.raises(TypeError, match="EventBatch"):
        encode_batch([1.0, []])


# ---- the collector -----------------------------------------------------------------------------------
def test_collector_batches_events_per_step_in_order():
    sink = EventCollector(data_parallel_rank=2, clock=iter([1.0, 2.0]).__next__)
    assert sink.take_batch() is None
    sink(STORED)
    sink(BlockRemoved([1]))
    assert len(sink) == 2
    first = sink.take_batch()
    assert first == EventBatch(1.0, [STORED, BlockRemoved([1])], 2) and len(sink) == 0
    sink(AllBlocksCleared())
    assert sink.take_batch() == EventBatch(2.0, [AllBlocksCleared()], 2)


def test_collector_refuses_what_is_not_an_event():
    sink = EventCollector()
    with pytest.raises(TypeError, match="event"):
        sink("stored")
    assert len(sink) == 0
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EventCollector(data_parallel_rank=-1)
    with pytest.raises(TypeError, match="clock"):
        EventCollector(clock=5)


def test_a_clock_that_fails_loses_no_event_the_next_take_batch_sends_them():
    ticks = iter([RuntimeError("clock down"), "not a time", 4.0])

    def clock():
        tick = next(ticks)
        if isinstance(tick, Exception):
            raise tick
        return tick

    sink = EventCollector(clock=clock)
    sink(STORED)
    with pytest.raises(RuntimeError, match="clock down"):
        sink.take_batch()
    sink(AllBlocksCleared())
    with pytest.raises(ValueError, match="ts"):
        sink.take_batch()
    assert len(sink) == 2
    assert sink.take_batch() == EventBatch(4.0, [STORED, AllBlocksCleared()]) and len(sink) == 0
