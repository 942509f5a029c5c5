"""The device a pool lives on, checked where it is chosen: a pool on a device this machine cannot reach
would take its bookkeeping and then fail at the first tensor it builds."""

from __future__ import annotations

from kvmem._torch import torch


def check_device(device) -> torch.device:
    """`device` (a str like "cpu" / "cuda:1", or a torch.device) as a torch.device whose memory this process
    can use; ValueError naming it otherwise (unknown, 'meta', or absent on this machine)."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a str or torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device torch knows ({str(e).splitlines()[0]})") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no memory: a pool needs a real device")
    backend = getattr(torch, dev.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(f"device {device!r}: no {dev.type} device is available to this process")
    if dev.index is not None and dev.index >= backend.device_count():
        raise ValueError(f"device {device!r}: only {backend.device_count()} {dev.type} device(s) here")
    return dev
