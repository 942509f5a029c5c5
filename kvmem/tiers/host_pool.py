"""The host tier's memory: KV in host DRAM, in the device pool's exact storage format, with its own slots.

A `HostKVPool` mirrors a device `MHAKVPool` / `MLAKVPool` buffer for buffer (K and V, their int8/int4 scales,
or MLA's latent), stored as the device stores them (fp8 codes as uint8, int4 packed, scales float32), so a
round trip device -> host -> device is bit-exact whatever the dtype. Its slots come from its own allocator
(slot 0, page 0, reserved as on the device).

Layouts: "layer_first" keeps one [num_slots, *row] tensor per layer and buffer (a per-layer load reads one
tensor); "page_first" keeps one [num_slots, num_layers, *row] tensor per buffer, so all layers of a slot are
contiguous (what a storage tier writes as one page).

Copies: on CUDA the pool pins its memory and runs each copy on a side stream, recording an event that the
returned `Transfer` waits on; on the CPU a copy runs at once. `HostSlotPool` is the same tier without bytes,
for simulations that only account for slots (the replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvmem._checks import check_host_bytes, check_int, check_number
from kvmem._index import as_index_array
from kvmem._torch import torch
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.kv_pool import MHAKVPool, MLAKVPool

HOST_LAYOUTS = ("layer_first", "page_first")


@dataclass
class Transfer:
    """One copy between tiers. `done()` polls; `wait()` blocks until the copy has finished (a no-op for a copy
    that already has). `error` is the exception that failed the copy, else None: a failed copy leaves both
    tiers' bookkeeping to its caller to undo. `finish` runs once, at completion, on the host."""

    event: torch.cuda.Event | None = None
    error: BaseException | None = None
    finish: object = field(default=None, repr=False)

    def done(self) -> bool:
        if self.event is not None and not self.event.query():
            return False
        self._run_finish()
        return True

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self._run_finish()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _run_finish(self) -> None:
        finish, self.finish = self.finish, None
        if finish is not None and self.error is None:
            try:
                finish()
            except Exception as e:  # the copy's last step failed: report it as the copy's failure
                self.error = e


class HostKVPool:
    """Host buffers for the KV of `device_pool`, and the copies between them.

    Args:
        device_pool: the MHAKVPool or MLAKVPool this tier backs up.
        size: host slots (tokens), a multiple of the page size; default `ratio` x the device pool's size. Must
            exceed the device pool's size: with write-through every cached device page also has a host copy,
            so a host tier no larger than the device adds nothing (SGLang requires the same).
        ratio: host size as a multiple of the device pool's, when `size` is None.
        layout: "layer_first" or "page_first" (see the module docstring).
        pin_memory: pin the host buffers (page-locked, for asynchronous copies); default: when the device
            pool is on CUDA.
        model_id: names the model whose KV this is (e.g. a checkpoint and revision). It goes into the format
            fingerprint of pages this pool writes to a storage tier, so that a page of another model (or of
            another dtype, or of another shape) is never loaded here; give each model its own `namespace` too,
            so that models sharing a store do not compete for the same page keys.
    """

    def __init__(self, device_pool: MHAKVPool | MLAKVPool, *, size: int | None = None, ratio: float = 2.0,
                 layout: str = "layer_first", pin_memory: bool | None = None, model_id: str = "") -> None:
        if not isinstance(device_pool, (MHAKVPool, MLAKVPool)):
            raise TypeError(f"device_pool must be an MHAKVPool or MLAKVPool, got {type(device_pool).__name__}")
        ps = device_pool.page_size
        if size is None:
            size = int(device_pool.size * check_number("ratio", ratio, 0, allow_minimum=False)) // ps * ps
        else:
            size = check_int("size", size, minimum=1)
            if size % ps:
                raise ValueError(f"size {size} must be a multiple of the page size {ps}")
        if size <= device_pool.size:
            raise ValueError(f"a host pool of {size} tokens must be larger than the device pool's {device_pool.size}")
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {HOST_LAYOUTS}, got {layout!r}")
        on_cuda = device_pool.device.type == "cuda"
        pin = on_cuda if pin_memory is None else bool(pin_memory)
        if pin and not torch.cuda.is_available():
            raise ValueError("pin_memory needs CUDA: page-locked memory is for copies to a GPU")
        if not isinstance(model_id, str):
            raise TypeError(f"model_id must be a str, got {type(model_id).__name__}")
        try:  # it goes into every stored page's format fingerprint, as UTF-8
            model_id.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"model_id {model_id!r} cannot be encoded as UTF-8 ({e.reason} at {e.start})") from None
        self.device_pool = device_pool
        self._cache = None  # the HiRadixCache this pool backs (a weak reference), set by that cache
        self.model_id = model_id
        self.page_size = ps
        self.size = size
        self.layout = layout
        self.layer_num = device_pool.layer_num
        self.allocator = TokenAllocator(size) if ps == 1 else PagedTokenAllocator(size, ps)
        formats = device_pool.row_formats()
        self._formats = formats
        num_slots = size + ps
        part_row_bytes = [int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in formats]
        row_bytes = sum(part_row_bytes)
        # bytes of each stored buffer in one page's payload (every layer): what read_pages / write_pages move
        self._part_page_bytes = [b * self.layer_num * ps for b in part_row_bytes]
        check_host_bytes(f"a host KV pool of {size} tokens", num_slots * self.layer_num * row_bytes)
        if layout == "layer_first":
            self._buffers = [[torch.zeros((num_slots, *shape), dtype=dtype, pin_memory=pin)
                              for _ in range(self.layer_num)] for shape, dtype in formats]
        else:
            self._buffers = [torch.zeros((num_slots, self.layer_num, *shape), dtype=dtype, pin_memory=pin)
                             for shape, dtype in formats]
        self._stream = torch.cuda.Stream(device_pool.device) if on_cuda else None

    # ---- copies -------------------------------------------------------------------------------------
    def backup(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> Transfer:
        """Copies every layer's KV of `device_slots` [n] into `host_slots` [n] (held in `allocator`).
        Asynchronous on CUDA (wait on the returned Transfer before reading the host copy)."""
        host, device = self._check_slots(host_slots, device_slots)
        return self._copy(lambda: self._backup(host, device))

    def load(self, device_slots: torch.Tensor, host_slots: torch.Tensor, layer_id: int | None = None) -> Transfer:
        """Copies the KV of `host_slots` [n] (held in `allocator`) into `device_slots` [n]: every layer, or
        only `layer_id`, so that a model runner can load layer l + 1 while it computes layer l. Asynchronous on
        CUDA: wait on the returned Transfer before the layer's attention reads it."""
        host, device = self._check_slots(host_slots, device_slots)
        layers = range(self.layer_num) if layer_id is None else [self._check_layer(layer_id)]
        return self._copy(lambda: self._load(device, host, layers))

    def _backup(self, host: np.ndarray, device: torch.Tensor):
        # Device rows go to host staging first (pinned, asynchronous on CUDA); they are scattered into the
        # host buffers only when the copy has landed, by the Transfer's finish step.
        staged = []
        for layer in range(self.layer_num):
            for part, rows in enumerate(self.device_pool.slot_rows(layer, device)):
                staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
                staging.copy_(rows, non_blocking=rows.is_cuda)
                staged.append((part, layer, staging))
        host_index = torch.from_numpy(host)

        def scatter():
            for part, layer, staging in staged:
                self._write_host(part, layer, host_index, staging)
        return scatter

    def _load(self, device: torch.Tensor, host: np.ndarray, layers):
        host_index = torch.from_numpy(host)
        pinned = self._stream is not None
        staged = []  # kept alive until the copy has landed
        for layer in layers:
            rows = [self._read_host(part, layer, host_index) for part in range(len(self._buffers))]
            if pinned:
                rows = [r.pin_memory() for r in rows]
            staged.append(rows)
            self.device_pool.set_slot_rows(layer, device, [r.to(device.device, non_blocking=pinned) for r in rows])
        return lambda: staged.clear()

    def _copy(self, run) -> Transfer:
        """Runs `run` (which returns the host step to run once the copy has landed): at once on the CPU, on
        the side stream on CUDA. A copy that raises comes back as a failed Transfer, nothing raised."""
        if self._stream is None:
            try:
                finish = run()
            except Exception as e:  # noqa: BLE001 - a failed copy is reported, not raised: see Transfer
                return Transfer(error=e)
            transfer = Transfer(finish=finish)
            transfer.wait()
            return transfer
        event = torch.cuda.Event()
        self._stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        try:
            with torch.cuda.stream(self._stream):
                finish = run()
                event.record(self._stream)
        except Exception as e:  # noqa: BLE001
            return Transfer(error=e)
        return Transfer(event=event, finish=finish)

    def host_rows(self, host_slots: torch.Tensor, layer_id: int) -> list[torch.Tensor]:
        """The stored rows of `host_slots` in layer `layer_id` (copies), in the device pool's `row_formats()`."""
        host = torch.from_numpy(_handed_out(self.allocator, host_slots))
        return [self._read_host(part, self._check_layer(layer_id), host) for part in range(len(self._buffers))]

    def _write_host(self, part: int, layer: int, host_index: torch.Tensor, rows: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self._buffers[part][layer][host_index] = rows
        else:
            self._buffers[part][host_index, layer] = rows

    def _read_host(self, part: int, layer: int, host_index: torch.Tensor) -> torch.Tensor:
        if self.layout == "layer_first":
            return self._buffers[part][layer][host_index]
        return self._buffers[part][host_index, layer]

    # ---- checks -------------------------------------------------------------------------------------
    def _check_slots(self, host_slots, device_slots) -> tuple[np.ndarray, torch.Tensor]:
        host = _handed_out(self.allocator, host_slots)
        if not isinstance(device_slots, torch.Tensor):
            raise TypeError(f"device_slots must be a tensor of slots, got {type(device_slots).__name__}")
        if device_slots.device.type == "meta":
            raise ValueError("device_slots is on the 'meta' device, which holds no values")
        device = self.device_pool._check_loc(device_slots.to(self.device_pool.device), "device_slots")
        if len(device) != len(host):
            raise ValueError(f"device_slots has {len(device)} slots and host_slots {len(host)}: one for one")
        # A slot listed twice would be written twice by one copy: a backup would keep one of two rows, a load
        # would leave one device slot unwritten. (Device slots are checked where reading them costs no sync.)
        if len(host) > 1 and len(np.unique(host)) != len(host):
            raise ValueError("host_slots lists a slot more than once")
        if len(device) > 1 and device.device.type == "cpu" and len(torch.unique(device)) != len(device):
            raise ValueError("device_slots lists a slot more than once")
        if len(device) and device.device.type == "cpu" and int(device.min()) < self.page_size:
            raise ValueError(f"device_slots holds slot {int(device.min())}, "
                             + ("the padding slot" if self.page_size == 1 else "in the padding page 0"))
        return host, device

    def _check_layer(self, layer_id: int) -> int:
        if not 0 <= check_int("layer_id", layer_id) < self.layer_num:
            raise IndexError(f"layer_id {layer_id} out of range [0, {self.layer_num})")
        return layer_id

    # ---- pages, for the storage tier ------------------------------------------------------------------
    def storage_format(self) -> str:
        """What a stored page of this pool must match to be loaded here: the model, the stored dtypes and row
        shapes, the layers and the page size (not the host or device layout: a payload is canonical)."""
        dev = self.device_pool
        parts = ";".join(f"{'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
                         for shape, dtype in self._formats)
        dtype = str(dev.dtype).removeprefix("torch.")
        # An MLA row is one [kv_lora_rank + qk_rope_head_dim] vector: its split is not in the row's shape.
        mla = f"|kv_lora_rank={dev.kv_lora_rank}" if isinstance(dev, MLAKVPool) else ""
        return (f"kvmem-kv-page-v1|{type(dev).__name__}{mla}|model={self.model_id}|dtype={dtype}"
                f"|kv_cache_dtype={dev.kv_cache_dtype}|layers={self.layer_num}|page_size={self.page_size}|parts={parts}")

    def page_payload_bytes(self) -> int:
        """Bytes of one page's payload: every stored row of its slots, in every layer."""
        return sum(self._part_page_bytes)

    def read_pages(self, host_slots) -> list[bytes]:
        """The payloads of the whole pages in `host_slots` (page_size slots each, in order from a page start),
        one per page: each stored buffer's rows, layer by layer, token by token, whatever the host layout."""
        host = self.check_host_slots(host_slots)
        num_pages, ps = len(host) // self.page_size, self.page_size
        if num_pages == 0:
            return []
        index = torch.from_numpy(host)
        per_part = []
        for part in range(len(self._buffers)):
            if self.layout == "layer_first":
                rows = torch.stack([self._buffers[part][layer][index] for layer in range(self.layer_num)])
            else:
                rows = self._buffers[part][index].transpose(0, 1)
            # [layers, pages * ps, ...] -> [pages, layers, ps, ...]; through uint8: numpy has no bfloat16
            rows = rows.reshape(self.layer_num, num_pages, ps, -1).transpose(0, 1).contiguous()
            per_part.append(rows.view(torch.uint8).reshape(num_pages, -1).numpy())
        if len(per_part) == 1:
            return [page.tobytes() for page in per_part[0]]
        return [b"".join(part[page].tobytes() for part in per_part) for page in range(num_pages)]

    def write_pages(self, host_slots, payloads) -> None:
        """Writes payloads (as `read_pages` returns them, one per page) into the whole pages of `host_slots`."""
        host = self.check_host_slots(host_slots)
        num_pages, ps = len(host) // self.page_size, self.page_size
        data = _page_bytes(payloads, num_pages, self.page_payload_bytes())
        if num_pages == 0:
            return
        index = torch.from_numpy(host)
        offset = 0
        for part, (shape, dtype) in enumerate(self._formats):
            nbytes = self._part_page_bytes[part]
            rows = torch.from_numpy(data[:, offset:offset + nbytes].copy()).view(dtype)
            offset += nbytes
            # [pages, layers, ps, ...] -> [layers, pages * ps, ...]
            rows = rows.reshape(num_pages, self.layer_num, ps, *shape).transpose(0, 1).reshape(
                self.layer_num, num_pages * ps, *shape)
            if self.layout == "layer_first":
                for layer in range(self.layer_num):
                    self._buffers[part][layer][index] = rows[layer]
            else:
                self._buffers[part][index] = rows.transpose(0, 1)

    def check_host_slots(self, host_slots) -> np.ndarray:
        """`host_slots` as host int64 slots of whole pages this pool has handed out (page_size slots each, in order
        from a page start); raises otherwise."""
        return _check_whole_pages(_handed_out(self.allocator, host_slots), self.page_size)

    def mem_usage_bytes(self) -> int:
        """Bytes of all host buffers."""
        tensors = [t for part in self._buffers for t in (part if isinstance(part, list) else [part])]
        return sum(t.numel() * t.element_size() for t in tensors)


class HostSlotPool:
    """A host tier of `size` slots with no bytes behind them: copies complete at once and move nothing. For
    simulations (the replay) that account for where KV would be, not for the KV itself."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        size = check_int("size", size, minimum=1)
        self.page_size = check_int("page_size", page_size, minimum=1)
        if size % self.page_size:
            raise ValueError(f"size {size} must be a multiple of page_size {self.page_size}")
        self.size = size
        self.allocator = TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size)
        self._cache = None  # the HiRadixCache this pool backs (a weak reference), set by that cache

    def backup(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> Transfer:
        return Transfer()

    def load(self, device_slots: torch.Tensor, host_slots: torch.Tensor, layer_id: int | None = None) -> Transfer:
        return Transfer()

    # Pages without bytes: a storage tier stores their headers only, so that a simulation exercises a real
    # store (keys, presence, persistence across runs) without writing KV it does not have.
    def storage_format(self) -> str:
        return f"kvmem-slots-only-v1|page_size={self.page_size}"

    def page_payload_bytes(self) -> int:
        return 0

    def read_pages(self, host_slots) -> list[bytes]:
        return [b""] * (len(self.check_host_slots(host_slots)) // self.page_size)

    def write_pages(self, host_slots, payloads) -> None:
        _page_bytes(payloads, len(self.check_host_slots(host_slots)) // self.page_size, 0)

    def check_host_slots(self, host_slots) -> np.ndarray:
        return _check_whole_pages(_handed_out(self.allocator, host_slots), self.page_size)


def _handed_out(allocator, host_slots) -> np.ndarray:
    """`host_slots` as host int64 slots; raises unless `allocator` (a host pool's) has handed out every one."""
    host = as_index_array("host_slots", host_slots)
    held = allocator.allocated_mask(host)
    if np.count_nonzero(held) != len(host):
        raise ValueError(f"host_slots holds slot {host[~held][0]}, which this host pool has not handed out")
    return host


def _check_whole_pages(host: np.ndarray, page_size: int) -> np.ndarray:
    """Raises unless `host` holds whole pages: page_size slots each, in order from a multiple of page_size."""
    if len(host) % page_size:
        raise ValueError(f"host_slots has {len(host)} slots, not whole pages of {page_size}")
    if page_size > 1 and len(host):
        pages = host.reshape(-1, page_size)
        if (pages[:, 0] % page_size).any() or (pages != pages[:, :1] + np.arange(page_size)).any():
            raise ValueError(f"host_slots must hold whole pages (page_size {page_size}, each page's slots in "
                             f"order from its first), got {host[:2 * page_size].tolist()}...")
    return host


def _page_bytes(payloads, num_pages: int, page_bytes: int) -> np.ndarray:
    """`payloads` (one bytes-like per page, each `page_bytes` long) as a [num_pages, page_bytes] uint8 array."""
    if isinstance(payloads, (bytes, bytearray, memoryview, str)):
        raise TypeError(f"payloads must be a sequence of page payloads, got {type(payloads).__name__}")
    try:
        payloads = list(payloads)
        sizes = {memoryview(p).nbytes for p in payloads}
    except TypeError:
        raise TypeError("payloads must be a sequence of bytes-like page payloads") from None
    if len(payloads) != num_pages or sizes - {page_bytes}:
        raise ValueError(f"payloads must be {num_pages} pages of {page_bytes} bytes, got {len(payloads)} of "
                         f"{sorted(sizes)} bytes")
    out = np.empty((num_pages, page_bytes), dtype=np.uint8)
    for i, (row, payload) in enumerate(zip(out, payloads)):
        try:
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        except ValueError:  # a strided array or memoryview has no single buffer to read
            raise ValueError(f"payloads[{i}] must be contiguous bytes") from None
    return out
