"""KV cache events: what enters and leaves each tier of a cache, in vLLM's schema, over ZeroMQ.

- `kvmem.events.schema`: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `EventBatch`, and their msgpack
  wire forms (`encode_batch`, `decode_batch`).
- `kvmem.events.collector`: `EventCollector`, the `event_sink` a cache reports to, batched per step.
- `kvmem.events.publisher`: `ZmqEventPublisher` (PUB + ROUTER replay, vLLM's protocol).
- `kvmem.events.subscriber`: `KVEventSubscriber`, one replica's stream into a block index.

The schema and the collector need nothing beyond kvmem; encoding needs msgpack and the sockets need pyzmq
(the `events` extra), so the publisher and subscriber load when first used.
"""

from kvmem.events.collector import EventCollector
from kvmem.events.schema import (
    MEDIA,
    MEDIUM_CPU_PINNED,
    MEDIUM_DISK,
    MEDIUM_GPU,
    WIRE_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    KVCacheEvent,
    decode_batch,
    encode_batch,
)

_LAZY = {"ZmqEventPublisher": "kvmem.events.publisher", "KVEventSubscriber": "kvmem.events.subscriber"}

__all__ = [
    "MEDIA",
    "MEDIUM_CPU_PINNED",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "WIRE_FORMATS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventCollector",
    "EventDecodeError",
    "KVCacheEvent",
    "KVEventSubscriber",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvmem.events' has no attribute {name!r}")
