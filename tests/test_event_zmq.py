"""The ZeroMQ publisher and subscriber on real sockets (127.0.0.1, free ports), every wait bounded.

A subscriber rebuilds a replica's blocks from the stream alone; it must equal the cache's own pages after
every step, also when it joins late, falls behind its high-water mark, or receives a malformed batch.
"""

import contextlib
import threading

import msgpack
import pytest
import zmq

from kvmem import RadixCache, ReqToTokenPool, TokenAllocator
from kvmem.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventCollector,
    KVEventSubscriber,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
)
from kvmem.events.publisher import END_SEQ, derive_replay_endpoint
from kvmem.page_hash import page_hashes
from kvmem.router import BlockIndex

LOCAL = "tcp://127.0.0.1:0"
TIMEOUT_MS = 5000


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@contextlib.contextmanager
def publisher(**kw):
    pub = ZmqEventPublisher(LOCAL, **kw)
    try:
        yield pub
    finally:
        pub.close()


def replay(ctx, pub, start: int, dealer: zmq.Socket | None = None) -> list[list[bytes]]:
    """A raw replay request (DEALER, as a REQ client would frame it): every reply up to the end marker.
    Also a barrier: the publisher answers only after sending everything published before the request, and
    after every request sent earlier on `dealer` (a socket of the caller's, left open; else a new one)."""
    own = dealer is None
    if own:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        assert dealer.poll(TIMEOUT_MS), "no replay reply within the timeout"
        frames = dealer.recv_multipart()
        replies.append(frames)
        if frames[2] == END_SEQ:
            if own:
                dealer.close(linger=0)
            return replies


def tree_page_hashes(cache: RadixCache) -> set[int]:
    """The hash of every page in the tree, from the tokens of its root-to-leaf paths."""
    out, stack = set(), [(cache.root_node, [])]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.token_ids()
        out.update(page_hashes(path, 1))
        stack.extend((child, path) for child in node.children.values())
    return out


def stored(*hashes):
    return BlockStored(list(hashes), None, list(range(len(hashes))), 1)


# ---- the publisher's protocol ------------------------------------------------------------------------
def test_publisher_sends_topic_sequence_and_payload_frames(ctx):
    with publisher(topic="kv") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        for _ in range(100):  # until the subscription has reached the publisher (ZeroMQ's slow joiner)
            pub.publish(EventBatch(1.0, [stored(1)]))
            if sub.poll(50):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        assert decode_batch(payload) == EventBatch(1.0, [stored(1)], 0)   # the publisher's rank stamped
        while sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
        assert pub.publish(EventBatch(2.0, [stored(2)])) == int.from_bytes(seq, "big") + 1
        assert sub.poll(TIMEOUT_MS)
        assert int.from_bytes(sub.recv_multipart()[1], "big") == int.from_bytes(seq, "big") + 1
        sub.close(linger=0)


def test_replay_socket_answers_buffered_batches_from_the_asked_sequence_then_an_end_marker(ctx):
    with publisher(buffer_steps=3, wire_format="array") as pub:
        for i in range(5):
            assert pub.publish(EventBatch(float(i), [stored(i)])) == i
        replies = replay(ctx, pub, 3)
        assert [(f[0], f[1], int.from_bytes(f[2], "big")) for f in replies[:-1]] == [(b"", b"kv-events", 3),
                                                                                     (b"", b"kv-events", 4)]
        assert decode_batch(replies[0][3]).events == (stored(3),)
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        assert len(replay(ctx, pub, 0)) == 4  # only the last three are kept
        assert pub.replays_served == 2


def test_a_malformed_replay_request_is_counted_and_ignored(ctx):
    with publisher() as pub:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"\x01"])
        pub.publish(EventBatch(0.0, [stored(1)]))
        # On the same socket, so that the publisher has read the malformed request before it answers this one
        # (requests from two sockets may be read in either order).
        assert len(replay(ctx, pub, 0, dealer)) == 2  # the publisher is still serving
        assert pub.bad_replay_requests == 1
        dealer.close(linger=0)


# ---- a subscriber rebuilding a cache -------------------------------------------------------------------
def test_subscribers_rebuild_the_cache_after_every_step_even_joining_late():
    alloc = TokenAllocator(40)
    sink = EventCollector()
    cache = RadixCache(ReqToTokenPool(2, 8), alloc, event_sink=sink)
    prompts = [[1, 2, 3, 4], [1, 2, 5], [6, 7, 8], [1, 2, 3, 9, 9], [6, 7], [4, 4, 4, 4, 4, 4]] * 3
    with publisher() as pub:
        index = BlockIndex(2)
        early = KVEventSubscriber(pub.endpoint, index, 0, replay_endpoint=pub.replay_endpoint)
        late = None
        try:
            for step, prompt in enumerate(prompts):
                if alloc.available_size() < len(prompt):
                    cache.evict(len(prompt))
                slots = alloc.alloc(len(prompt))
                n = cache.insert(prompt, slots)
                if n:
                    alloc.free(slots[:n])
                if step == 7:
                    cache.reset()
                batch = sink.take_batch()
                if batch is not None:  # a step that changed nothing sends nothing
                    seq = pub.publish(batch)
                if step == 10:  # a replica's second router comes up: replay from the start
                    late = KVEventSubscriber(pub.endpoint, index, 1, replay_endpoint=pub.replay_endpoint)
                    assert late.sync()
                assert early.catch_up(seq)
                assert index.blocks(0) == tree_page_hashes(cache), f"step {step}"
                if late is not None:
                    assert late.catch_up(seq)
                    assert index.blocks(1) == tree_page_hashes(cache), f"step {step} (late joiner)"
            assert early.lost == late.lost == 0 and late.replayed > 0
        finally:
            early.close()
            if late is not None:
                late.close()


def test_a_subscriber_past_its_high_water_mark_counts_the_drops_and_resyncs_through_replay(ctx):
    # Batches of ~200 kB against high-water marks of one message: ZeroMQ drops most of them while the
    # subscriber is not reading. The replay buffer still holds them all.
    tokens = list(range(2**20, 2**20 + 40_000))
    with publisher(hwm=1, buffer_steps=200) as pub:
        index = BlockIndex(1)
        with KVEventSubscriber(pub.endpoint, index, 0, replay_endpoint=pub.replay_endpoint, hwm=1) as sub:
            assert sub.sync()
            expected = set()
            for i in range(120):
                hashes = list(range(i * 10, i * 10 + 10))
                events = [BlockStored(hashes, None, tokens, 4000)]
                expected.update(hashes)
                if i % 3 == 2:
                    events.append(BlockRemoved(hashes[:5]))
                    expected.difference_update(hashes[:5])
                last = pub.publish(EventBatch(float(i), events))
            replay(ctx, pub, 10**9)  # everything is out on the PUB socket now
            assert sub.catch_up(last, timeout=30)
            assert sub.missed > 0 and sub.received < 120
            assert sub.lost == sub.clears == 0
            assert sub.applied == 120 and sub.replayed >= sub.missed
            assert index.blocks(0) == expected


def test_batches_gone_from_the_replay_buffer_clear_the_replica_and_leave_no_stale_block(ctx):
    with publisher(buffer_steps=2) as pub:
        for i in range(4):
            pub.publish(EventBatch(float(i), [stored(i)]))
        last = pub.publish(EventBatch(4.0, [BlockRemoved([3]), stored(9)]))
        # A barrier: every batch is sent before the subscriber connects (publish only queues it; on a loaded
        # machine the sending thread could otherwise send them live to the new subscriber).
        replay(ctx, pub, 0)
        index = BlockIndex(1)
        index.apply_event(0, stored(100))  # stale: the replica dropped it while nobody listened
        with KVEventSubscriber(pub.endpoint, index, 0, replay_endpoint=pub.replay_endpoint) as sub:
            assert sub.catch_up(last)
            assert (sub.lost, sub.clears) == (3, 1)
            assert index.blocks(0) == {9}  # a subset of the replica's {0, 1, 2, 9}: nothing stale


# ---- bad input -----------------------------------------------------------------------------------------
def test_a_malformed_batch_clears_the_replica_and_the_stream_goes_on(ctx):
    raw = ctx.socket(zmq.PUB)
    raw.bind(LOCAL)
    endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT)
    index = BlockIndex(1)
    with KVEventSubscriber(endpoint, index, 0, replay_endpoint="tcp://127.0.0.1:9", replay_timeout=0.1) as sub:
        first = encode_batch(EventBatch(0.0, [stored(1, 2)]))
        for _ in range(100):  # until the subscription is live; the repeats are skipped as duplicates
            raw.send_multipart([b"kv-events", (0).to_bytes(8, "big"), first])
            if sub.poll(0.05):
                break
        assert index.blocks(0) == {1, 2}
        raw.send_multipart([b"kv-events", b"\x00"])                                   # bad frames
        raw.send_multipart([b"kv-events-other", (7).to_bytes(8, "big"), b"x"])         # another topic
        raw.send_multipart([b"kv-events", (1).to_bytes(8, "big"), msgpack.packb([0.0, [["Bogus"]]])])
        raw.send_multipart([b"kv-events", (2).to_bytes(8, "big"), encode_batch(EventBatch(0.0, [stored(3)]))])
        for _ in range(100):
            if sub.next_seq == 3:
                break
            sub.poll(0.05)
        assert (sub.next_seq, sub.malformed, sub.clears, sub.lost) == (3, 2, 1, 1)
        assert index.blocks(0) == {3}
    raw.close(linger=0)


def live_subscriber(ctx, index, **kw):
    """A raw PUB socket and a subscriber of it whose first batch (seq 0, block 1) has arrived."""
    raw = ctx.socket(zmq.PUB)
    raw.bind(LOCAL)
    sub = KVEventSubscriber(raw.getsockopt_string(zmq.LAST_ENDPOINT), index, 0, replay_timeout=0.1, **kw)
    for _ in range(100):  # until the subscription is live; the repeats are skipped as duplicates
        raw.send_multipart([b"kv-events", (0).to_bytes(8, "big"), encode_batch(EventBatch(0.0, [stored(1)]))])
        if sub.poll(0.05):
            return raw, sub
    raise AssertionError("the subscription never went live")


def test_a_restarted_engine_is_followed_from_zero_and_its_old_blocks_cleared(ctx):
    index = BlockIndex(1)
    raw, sub = live_subscriber(ctx, index, replay_endpoint="tcp://127.0.0.1:9")
    with sub:
        for seq, block in ((1, 2), (2, 3), (0, 100), (1, 101)):  # the engine restarts after seq 2
            raw.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, [stored(block)]))])
        for _ in range(100):
            if sub.restarts and sub.next_seq == 2:
                break
            sub.poll(0.05)
        # The restarted engine's cache is empty: nothing of the old stream may stay in the index.
        assert index.blocks(0) == {100, 101}
        assert (sub.restarts, sub.clears, sub.lost, sub.next_seq) == (1, 1, 0, 2)
    raw.close(linger=0)


def test_a_live_frame_numbered_at_the_top_of_the_sequence_range_is_malformed_and_the_stream_goes_on(ctx):
    # 2**64-1 is the replay's end marker (-1 signed): no batch can carry it. Applied, it left next_seq at 2**64,
    # which no replay request can name: every later sync() raised OverflowError.
    index = BlockIndex(1)
    raw, sub = live_subscriber(ctx, index, replay_endpoint="tcp://127.0.0.1:9")
    with sub:
        for seq, block in ((2**64 - 1, 50), (1, 2)):
            raw.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, [stored(block)]))])
        for _ in range(100):
            if sub.next_seq == 2:
                break
            sub.poll(0.05)
        assert index.blocks(0) == {1, 2}
        assert (sub.malformed, sub.lost, sub.clears, sub.next_seq) == (1, 0, 0, 2)
        assert sub.sync() is False  # nothing answers on port 9; it must not raise
        with pytest.raises(ValueError, match="seq"):
            sub.catch_up(2**64 - 1)
    raw.close(linger=0)


def test_an_older_engines_replay_without_the_topic_frame_fills_a_gap(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.bind(LOCAL)
    payloads = [encode_batch(EventBatch(0.0, [stored(b)])) for b in (1, 2, 3)]

    def answer():  # as older vLLM releases reply: (b"", seq, payload), then (b"", END_SEQ, b"")
        if router.poll(TIMEOUT_MS):
            client, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), 3):
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), payloads[seq]])
            router.send_multipart([client, b"", END_SEQ, b""])

    index = BlockIndex(1)
    raw, sub = live_subscriber(ctx, index, replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT))
    with sub:
        thread = threading.Thread(target=answer)
        thread.start()
        raw.send_multipart([b"kv-events", (3).to_bytes(8, "big"), encode_batch(EventBatch(0.0, [stored(4)]))])
        assert sub.catch_up(3, timeout=5)
        thread.join(timeout=TIMEOUT_MS / 1000)
        assert index.blocks(0) == {1, 2, 3, 4} and (sub.replayed, sub.malformed, sub.lost) == (2, 0, 0)
    raw.close(linger=0)
    router.close(linger=0)


def test_a_sync_ahead_of_the_live_stream_counts_what_the_live_stream_skipped_and_its_duplicates(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.bind(LOCAL)
    payloads = [encode_batch(EventBatch(0.0, [stored(b)])) for b in (1, 2, 3, 4)]

    def answer():  # a frame without the empty delimiter first (not a replay frame), then batches 1..3, the end
        if router.poll(TIMEOUT_MS):
            client, _, start = router.recv_multipart()
            router.send_multipart([client, b"junk", b"kv-events", (1).to_bytes(8, "big"),
                                   encode_batch(EventBatch(0.0, [stored(666)]))])
            for seq in range(int.from_bytes(start, "big"), 4):
                router.send_multipart([client, b"", b"kv-events", seq.to_bytes(8, "big"), payloads[seq]])
            router.send_multipart([client, b"", b"", END_SEQ, b""])

    index = BlockIndex(1)
    raw, sub = live_subscriber(ctx, index, replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT))
    with sub:
        thread = threading.Thread(target=answer)
        thread.start()
        sub.replay_timeout = TIMEOUT_MS / 1000
        assert sub.sync()  # batches 1..3 from the replay: ahead of the live stream
        thread.join(timeout=TIMEOUT_MS / 1000)
        received = sub.received
        raw.send_multipart([b"kv-events", (3).to_bytes(8, "big"), payloads[3]])  # the live stream skipped 1, 2
        for _ in range(100):
            if sub.received > received:
                break
            sub.poll(0.05)
        assert index.blocks(0) == {1, 2, 3, 4}
        assert (sub.missed, sub.duplicates, sub.applied, sub.replayed, sub.malformed) == (2, 1, 4, 3, 1)
    raw.close(linger=0)
    router.close(linger=0)


def test_a_live_batch_numbered_as_the_last_live_one_is_a_restarted_engines(ctx):
    index = BlockIndex(1)
    raw, sub = live_subscriber(ctx, index, replay_endpoint="tcp://127.0.0.1:9")
    with sub:
        received, restarts = sub.received, sub.restarts
        for seq, block in ((1, 2), (1, 101)):  # the restarted engine's 0 was not seen here
            raw.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, [stored(block)]))])
        for _ in range(100):
            if sub.received == received + 2:
                break
            sub.poll(0.05)
        assert index.blocks(0) == {101} and sub.restarts == restarts + 1 and sub.next_seq == 2
    raw.close(linger=0)


def test_a_replay_that_never_answers_returns_false_within_its_timeout():
    with KVEventSubscriber("tcp://127.0.0.1:9", BlockIndex(1), 0, replay_timeout=0.05) as sub:
        assert sub.sync() is False
        assert sub.catch_up(0, timeout=0.2) is False


def test_publish_after_close_raises_and_close_is_idempotent():
    pub = ZmqEventPublisher(LOCAL)
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(EventBatch(0.0, [AllBlocksCleared()]))


def test_publish_refuses_what_is_not_a_batch():
    with publisher() as pub:
        with pytest.raises(TypeError, match="EventBatch"):
            pub.publish([AllBlocksCleared()])
        assert pub.publish(EventBatch(0.0, [])) == 0  # the refused call took no sequence number


@pytest.mark.parametrize("kwargs, error, match", [
    ({"endpoint": "http://127.0.0.1:5557"}, ValueError, "endpoint"),
    ({"endpoint": "tcp://127.0.0.1"}, ValueError, "port"),
    ({"endpoint": "tcp://:5557"}, ValueError, "host"),
    ({"endpoint": 5557}, TypeError, "endpoint"),
    ({"endpoint": LOCAL, "topic": b"kv"}, TypeError, "topic"),
    ({"endpoint": LOCAL, "buffer_steps": 0}, ValueError, "buffer_steps"),
    ({"endpoint": LOCAL, "wire_format": "json"}, ValueError, "wire_format"),
    ({"endpoint": LOCAL, "replay_endpoint": "udp://x"}, ValueError, "replay_endpoint"),
])
def test_bad_publisher_arguments_raise_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZmqEventPublisher(**kwargs)


def test_a_port_in_use_is_a_clear_error():
    with publisher() as pub:
        with pytest.raises(ValueError, match="endpoint 'tcp://127.0.0.1:.*cannot be bound"):
            ZmqEventPublisher(pub.endpoint, replay_endpoint=LOCAL)


def test_bad_subscriber_arguments_raise_naming_them():
    with pytest.raises(TypeError, match="index"):
        KVEventSubscriber("tcp://127.0.0.1:5557", object(), 0)
    with pytest.raises(ValueError, match="replica"):
        KVEventSubscriber("tcp://127.0.0.1:5557", BlockIndex(1), -1)
    with pytest.raises(ValueError, match=r"replica must be .*at most 1.*got 2"):  # now, not at the first batch
        KVEventSubscriber("tcp://127.0.0.1:5557", BlockIndex(2), 2)
    with pytest.raises(ValueError, match="replay_timeout"):
        KVEventSubscriber("tcp://127.0.0.1:5557", BlockIndex(1), 0, replay_timeout=0)


def test_the_replay_endpoint_is_derived_as_the_next_port():
    assert derive_replay_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert derive_replay_endpoint("tcp://*:0") == "tcp://*:0"
    assert derive_replay_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv-replay"


def test_a_closed_subscriber_refuses_to_poll_or_sync():
    sub = KVEventSubscriber("tcp://127.0.0.1:9", BlockIndex(1), 0)
    sub.close()
    sub.close()
    with pytest.raises(RuntimeError, match="closed"):
        sub.poll()
    with pytest.raises(RuntimeError, match="closed"):
        sub.sync()


def test_each_malformed_replay_reply_is_counted_and_the_replay_still_ends_at_its_marker(ctx):
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve():  # two replies of the wrong shape, then the end marker
        if router.poll(30_000):
            peer = router.recv_multipart()[0]
            for frames in ([b"", b"bad"], [b"", b"\x00" * 3, b"x"], [b"", END_SEQ, b""]):
                router.send_multipart([peer, *frames])

    server = threading.Thread(target=serve)
    server.start()
    try:
        with KVEventSubscriber("tcp://127.0.0.1:9", BlockIndex(1), 0, replay_endpoint=f"tcp://127.0.0.1:{port}",
                               replay_timeout=30) as sub:
            assert sub.sync() is True
            assert (sub.malformed, sub.applied, sub.next_seq) == (2, 0, 0)
    finally:
        server.join(timeout=60)
        router.close(linger=0)


def test_a_publisher_closes_the_context_it_made_and_leaves_a_given_one_open(ctx):
    with publisher() as own:
        made = own._ctx
    assert made.closed
    with publisher(context=ctx) as pub:
        assert pub._ctx is ctx
    assert not ctx.closed


def test_a_subscriber_refuses_a_negative_poll_timeout_and_an_index_without_apply_by_name():
    with KVEventSubscriber("tcp://127.0.0.1:9", BlockIndex(1), 0) as sub:
        with pytest.raises(ValueError, match="^timeout must be a finite number >= 0, got -0.001$"):
            sub.poll(timeout=-0.001)
    with pytest.raises(TypeError, match=r"^index must have apply\(replica, batch\) and clear\(replica\), got dict$"):
        KVEventSubscriber("tcp://127.0.0.1:9", {}, 0)
    with pytest.raises(TypeError, match="^topic must be a str, got bytes$"):
        KVEventSubscriber("tcp://127.0.0.1:9", BlockIndex(1), 0, topic=b"kv")
