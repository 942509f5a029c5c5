#!/usr/bin/env python3
"""KV event throughput and size: how many events/s `ZmqEventPublisher` sustains with a local subscriber
draining it, and how many bytes an event takes on the wire, at page sizes 16 and 1.

The events are real: a RadixCache with an `EventCollector` replays a synthetic multi-turn chat workload
(token ids folded into a 128,256-token vocabulary, Llama 3's, so that they take the bytes real ids take),
one scheduler step per request, in a cache small enough to evict. Each step's batch holds the BlockStored
of the request's new pages and, when it evicted, one BlockRemoved.

A second workload, "one_page", sends batches of a single one-page BlockStored: the per-message overhead.

Per workload, page size and wire form ("map", what vLLM sends now; "array", older vLLM's positional form):
  events, blocks, batches          what the workload produced
  bytes_per_event, bytes_per_block payload bytes (msgpack, whole batches) over events / over blocks named
  one_page_event_bytes             a BlockStored of a single page of that size, alone
  encode_events_per_s              encode_batch alone, no sockets
  decode_events_per_s              decode_batch alone (what a subscriber spends)
  publish_events_per_s             events / seconds from the first publish() to the moment the publisher's
                                   thread has sent them all on its PUB socket (tcp on 127.0.0.1), with a
                                   subscriber in another process receiving them
  delivered_events_per_s           events / seconds from the first publish() to the subscriber holding the
                                   last batch; `dropped` counts batches it never received
And what reporting costs the cache (`cache_hook` rows): median microseconds of RadixCache.insert of 512 new
tokens after a cached 512-token prefix, and of evict(512) of such a leaf, with and without an event sink
(hashing the pages, building the events).

    python scripts/bench_events.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import subprocess
import sys
import time

VOCAB = 128_256


def workload_batches(page_size: int, num_requests: int):
    import numpy as np

    from kvmem import PagedTokenAllocator, RadixCache, ReqToTokenPool, TokenAllocator
    from kvmem.events import EventCollector
    from kvmem.replay.synthetic import multi_turn_chat

    trace = multi_turn_chat(num_requests, seed=0)
    capacity = 65_536
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    sink = EventCollector(data_parallel_rank=0)
    cache = RadixCache(ReqToTokenPool(1, 8), alloc, page_size=page_size, event_sink=sink)
    batches = []
    for request in trace:
        ids = np.asarray(request.input_ids, dtype=np.int64) % VOCAB
        key = ids[:len(ids) - len(ids) % page_size]
        if len(key) == 0:
            continue
        if alloc.available_size() < len(key):
            cache.evict(len(key) - alloc.available_size())
        slots = alloc.alloc(len(key))
        n = cache.insert(key, slots)
        if n:
            alloc.free(slots[:n])
        batch = sink.take_batch()
        if batch is not None:
            batches.append(batch)
    return batches


def cache_hook_rows(reps: int) -> list[dict]:
    import statistics
    from array import array

    from kvmem import PagedTokenAllocator, RadixCache, ReqToTokenPool, TokenAllocator
    from kvmem.events import EventCollector

    rows = []
    for page_size in (16, 1):
        row = {"page_size": page_size, "new_tokens": 512}
        for label, sink in (("no_sink", None), ("sink", EventCollector())):
            alloc = TokenAllocator(4096) if page_size == 1 else PagedTokenAllocator(4096, page_size)
            cache = RadixCache(ReqToTokenPool(1, 8), alloc, page_size=page_size, event_sink=sink)
            prefix = array("q", range(512))
            cache.insert(prefix, alloc.alloc(512))
            inserts, evicts = [], []
            for i in range(reps):
                key = prefix + array("q", range(10_000 + i * 512, 10_000 + (i + 1) * 512))
                slots = alloc.alloc(1024)
                alloc.free(slots[:512])
                t0 = time.perf_counter_ns()
                cache.insert(key, slots)
                t1 = time.perf_counter_ns()
                cache.evict(512)
                t2 = time.perf_counter_ns()
                inserts.append((t1 - t0) / 1e3)
                evicts.append((t2 - t1) / 1e3)
                if sink is not None:
                    sink.take_batch()
            row[f"insert_{label}_us"] = round(statistics.median(inserts), 2)
            row[f"evict_{label}_us"] = round(statistics.median(evicts), 2)
        rows.append(row)
    return rows


def one_page_batches(page_size: int, count: int):
    """`count` batches of one event each: a BlockStored of one page chained to the one before."""
    from kvmem.events import BlockStored, EventBatch
    from kvmem.page_hash import page_hash

    batches, parent = [], None
    for i in range(count):
        tokens = [(7919 * (i * page_size + j)) % VOCAB for j in range(page_size)]
        h = page_hash(parent, tokens)
        batches.append(EventBatch(time.time(), [BlockStored([h], parent, tokens, page_size)], 0))
        parent = h
    return batches


def rate(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else float("inf")


def size_row(batches, page_size: int, wire_format: str) -> dict:
    from kvmem.events import BlockStored, EventBatch, decode_batch, encode_batch

    events = sum(len(b.events) for b in batches)
    blocks = sum(len(e.block_hashes) for b in batches for e in b.events if hasattr(e, "block_hashes"))
    t0 = time.perf_counter()
    payloads = [encode_batch(b, wire_format) for b in batches]
    t1 = time.perf_counter()
    for p in payloads:
        decode_batch(p)
    t2 = time.perf_counter()
    page = BlockStored([2**64 - 12345], 2**63 + 6789, [(7919 * i) % VOCAB for i in range(page_size)], page_size)
    empty = len(encode_batch(EventBatch(1.0, [], 0), wire_format))
    return {"page_size": page_size, "wire_format": wire_format, "batches": len(batches), "events": events,
            "blocks": blocks, "bytes_per_event": round(sum(map(len, payloads)) / events, 1),
            "bytes_per_block": round(sum(map(len, payloads)) / blocks, 1),
            "one_page_event_bytes": len(encode_batch(EventBatch(1.0, [page], 0), wire_format)) - empty,
            "encode_events_per_s": rate(events, t1 - t0), "decode_events_per_s": rate(events, t2 - t1)}


def throughput(batches, wire_format: str, repeat: int) -> dict:
    """Publishes `batches` `repeat` times to a subscriber process that counts what it receives."""
    import zmq

    from kvmem.events import EventBatch, ZmqEventPublisher

    total = len(batches) * repeat
    with ZmqEventPublisher("tcp://127.0.0.1:0", wire_format=wire_format, buffer_steps=16) as pub:
        drainer = subprocess.Popen([sys.executable, __file__, "--drain", pub.endpoint, "--expect", str(total)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            warmups = 0
            for _ in range(400):  # until the drainer's subscription is live (ZeroMQ's slow joiner)
                pub.publish(EventBatch(0.0, []))
                warmups += 1
                if select.select([drainer.stdout], [], [], 0.05)[0]:
                    break
            assert drainer.stdout.readline().strip() == "ready", "the drainer never received a batch"
            drainer.stdin.write(f"{warmups}\n")
            drainer.stdin.flush()
            t0 = time.monotonic()
            for _ in range(repeat):
                for batch in batches:
                    pub.publish(batch)
            t_published = time.monotonic()
            ctx = zmq.Context()
            dealer = ctx.socket(zmq.DEALER)  # a replay request is answered only once all is sent
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (10**12).to_bytes(8, "big")])
            assert dealer.poll(60_000), "the publisher did not answer"
            t_sent = time.monotonic()
            dealer.close(linger=0)
            ctx.term()
            result = json.loads(drainer.communicate(timeout=120)[0])
        finally:
            if drainer.poll() is None:
                drainer.kill()
    events = sum(len(b.events) for b in batches) * repeat
    return {"batches_published": total, "publish_call_us": round((t_published - t0) / total * 1e6, 2),
            "publish_events_per_s": rate(events, t_sent - t0),
            "delivered_events_per_s": rate(events * result["received"] / total, result["last_t"] - t0),
            "dropped": total - result["received"]}


def drain(endpoint: str, expect: int) -> None:
    """The subscriber process: receive until `expect` timed batches (numbered after the warm-ups) arrived,
    or 5 s pass without one; print what arrived and when the last did."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    sub.recv_multipart()
    print("ready", flush=True)
    first_timed = int(sys.stdin.readline())
    received, last_t = 0, time.monotonic()
    while received < expect and sub.poll(5000):
        _, seq, _ = sub.recv_multipart()
        if int.from_bytes(seq, "big") >= first_timed:
            received += 1
            last_t = time.monotonic()
    print(json.dumps({"received": received, "last_t": last_t}))
    sub.close(linger=0)
    ctx.term()


def output_file(text: str) -> str:
    """kvmem._checks.output_file_arg, imported only when --out is given: the --drain subprocess parses this command
    line too, and starts without importing kvmem (and torch)."""
    from kvmem._checks import output_file_arg

    return output_file_arg(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small workload; throughput of the map form only")
    ap.add_argument("--out", type=output_file, help="also write the JSON report here")
    ap.add_argument("--drain", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drain and args.expect is None:
        ap.error("argument --drain: needs --expect")
    if args.drain:
        drain(args.drain, args.expect)
        return
    num_requests, repeat = (100, 1) if args.quick else (2000, 3)
    rows = []
    for page_size in (16, 1):
        workloads = {"cache": workload_batches(page_size, num_requests),
                     "one_page": one_page_batches(page_size, num_requests * repeat)}
        for workload, batches in workloads.items():
            for wire_format in ("map", "array"):
                print(f"[bench_events] {workload}, page_size {page_size}, {wire_format}", file=sys.stderr, flush=True)
                row = {"workload": workload, **size_row(batches, page_size, wire_format)}
                if wire_format == "map" or not args.quick:  # --quick spares half the subscriber processes
                    row.update(throughput(batches, wire_format, repeat if workload == "cache" else 1))
                rows.append(row)
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "workloads": {"cache": f"synthetic-chat, {num_requests} requests, one batch per request, published "
                                     f"{repeat}x",
                            "one_page": "batches of one BlockStored of one page each (per-message overhead)"},
              "rows": rows, "cache_hook": cache_hook_rows(50 if args.quick else 400)}
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
