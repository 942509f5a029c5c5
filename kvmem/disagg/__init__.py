"""Prefill/decode disaggregation: a prefill side (`KVSender`) prefills prompts and writes their KV into a decode side's
pool; the decode side (`KVReceiver`) asks only for the pages beyond what its own radix cache holds, then decodes.

Transports move the pages (`CopyTransport` in one process, `MooncakeTransport` over Mooncake's transfer engine);
channels carry the small control messages (`LocalChannel` in one process, JSON lines over TCP between processes).
`python -m kvmem.disagg.serve` runs either side as a process. See docs/disagg.md.
"""

from kvmem.disagg.channel import ChannelListener, LocalChannel, PeerGone, connect
from kvmem.disagg.copy_transport import CopyTransport
from kvmem.disagg.layout import KVLayout, engine_layout
from kvmem.disagg.mooncake_transport import MooncakeTransport
from kvmem.disagg.receiver import KVReceiver
from kvmem.disagg.request_memory import preallocate
from kvmem.disagg.sender import KVSender
from kvmem.disagg.transport import KVBuffers, KVTransport, Transfer, TransferStatus

__all__ = ["ChannelListener", "CopyTransport", "KVBuffers", "KVLayout", "KVReceiver", "KVSender", "KVTransport",
           "LocalChannel", "MooncakeTransport", "PeerGone", "Transfer", "TransferStatus", "connect", "engine_layout",
           "preallocate"]
