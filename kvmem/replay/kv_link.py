"""The KV link of a disaggregated replay: what moving a prompt's KV from a prefill replica to a decode replica costs.

Each GPU of a prefill replica sends over its own RDMA NIC (a DGX H100 has one 400 Gb/s ConnectX-7 per GPU), so a
replica of `tp` GPUs sends at tp x the NIC's rate; one transfer at a time per replica, in the order its prefills end.

Layer by layer: the step that finishes a prompt computes its layers in order, and each layer's KV can leave as soon
as that layer is done (SGLang and Mooncake send per layer or per chunk while the prefill runs). With the step
taking T over L layers and the transfer x = bytes / L / bandwidth per layer, the link (free from `ready`) finishes at

    max(max(step_start + T / L, ready) + L * x, step_end + x)

then the bytes land `latency` later: a link faster than the prefill leaves only its last layer's transfer and the
latency exposed after the prefill ends, a slower one its whole transfer minus the first layer's compute. The KV of a
prompt's earlier chunks is counted as leaving in the last chunk's step too (conservative: a real sender may have
sent it already).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem._checks import check_int, check_number

# NVIDIA ConnectX-7 (the NIC of DGX H100 / HGX H100 systems, one per GPU): a single port of NDR InfiniBand or
# Ethernet at 400 Gb/s ("NVIDIA ConnectX-7 Adapter Cards User Manual", Introduction). Its datasheet gives no end-to-end
# latency; an RDMA write across one switch completes in a few microseconds, and 10 us leaves room for the transfer
# engine posting the write and polling its completion.
DEFAULT_KV_LINK_GBPS = 400.0
DEFAULT_KV_LINK_LATENCY_US = 10.0


@dataclass(frozen=True)
class KVLink:
    """A prefill replica's link to the decode side: `gbps` gigabits per second per GPU (NICs are rated in bits),
    `nics` GPUs sending together, `latency_us` from the last byte sent to it landing, and `num_layers` the model's
    layers (the overlap's granularity)."""

    gbps: float = DEFAULT_KV_LINK_GBPS
    latency_us: float = DEFAULT_KV_LINK_LATENCY_US
    num_layers: int = 32
    nics: int = 1

    def __post_init__(self) -> None:
        check_number("kv_link_gbps", self.gbps, 0, allow_minimum=False)
        check_number("kv_link_latency_us", self.latency_us, 0)
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("nics", self.nics, minimum=1)

    @property
    def bytes_per_s(self) -> float:
        return self.nics * self.gbps * 1e9 / 8

    def send(self, nbytes: int, step_start: float, step_end: float, ready: float) -> tuple[float, float]:
        """(when the link is free again, when the last byte has landed) for `nbytes` of KV computed by the prefill
        step from `step_start` to `step_end`, the link free (and the decode side's pages given) from `ready`. A
        transfer of no bytes still tells the decode side that the KV is complete: one latency after the step."""
        latency = self.latency_us * 1e-6
        if nbytes <= 0:
            return ready, max(step_end, ready) + latency
        layers = self.num_layers
        per_layer = nbytes / self.bytes_per_s / layers
        busy_until = max(max(step_start + (step_end - step_start) / layers, ready) + layers * per_layer,
                         step_end + per_layer)
        return busy_until, busy_until + latency
