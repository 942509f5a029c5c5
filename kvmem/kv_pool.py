"""Level 2 token_to_kv pools: the per-layer K/V tensors that `out_cache_loc` slots index.

Slots 0 .. size + page_size - 1 exist: slot 0 (page 0) is the padding slot that padded batch rows write
to and read from, and the allocators hand out 1..size. `size` must be a multiple of `page_size` (as the
paged allocator requires), so the pool holds exactly num_pages = size // page_size + 1 whole pages and
slot s lives in page s // page_size at offset s % page_size. Buffers start zeroed, so the padding slot
and never-written slots read back as 0, never NaN.

Storage (`kv_cache_dtype`; `dtype` is always the model dtype, the dtype of what is written and read):
- "auto": stored in the model dtype (float16, bfloat16 or float32).
- "fp8_e4m3" / "fp8_e5m2": one byte per element, saturated to the format's finite range (torch's CPU
  cast saturates e4m3 but turns large e5m2 values into inf; the clamp makes both formats agree). Stored as
  uint8 and viewed back as float8 by the getters: advanced indexing on float8 tensors is missing on some
  backends and torch versions (pytorch#133605, pytorch#180855, torch-xpu-ops#461), byte copies work on all.
- "int8" / "int4": symmetric per-group quantization in the style of OpenPPL's MultiHeadCacheAttention.
  The last dim splits into groups of `quant_group` elements (default: the whole head), each with
  scale = absmax / 127 (int8) or / 7 (int4) and q = round(x / scale), so |q x scale - x| <= scale / 2;
  the getters then round q x scale to the model dtype, which adds that dtype's rounding (up to half an
  ulp of the value: at bfloat16, |dequant - x| reached 1.87 x scale / 2 for int8). Non-finite values
  saturate as in the fp8 stores, without spoiling their group: +-inf read back as the group's largest
  magnitude, NaN as 0 (see `quantize_symmetric`).
  int4 packs two values per uint8, element 2i in the low nibble and 2i+1 in the high one, two's
  complement so that zero bytes decode to 0. Scales are float32, one per (slot, head, group) in
  `k_scale_buffer[l]` / `v_scale_buffer[l]`: a bfloat16 scale would carry up to 2^-9 relative error
  into q x scale, which at q = 127 is a quarter of a step and breaks the scale / 2 bound, and float32
  costs only 4 bytes per group (3% of an int8 head of 128).

Layouts (MHA): "NHD" stores `k_buffer[l]` as [num_slots, head_num, head_dim] and "HND" as
[num_pages, head_num, page_size, head_dim]; either way `get_paged_kv_buffer` is a view of the storage in
FlashInfer's paged layout, never a copy. Quantized buffers keep the same layout with their stored last
dim (head_dim // 2 for int4, the group count for scales).
"""

from __future__ import annotations

from kvmem import sizing
from kvmem._checks import check_host_bytes, check_int
from kvmem._device import check_device
from kvmem._torch import torch

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_INT_QMAX = {"int8": 127, "int4": 7}
LAYOUTS = ("NHD", "HND")
# Smallest scale kept: an all-zero group then quantizes to q = 0 without dividing by zero.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_symmetric(x: torch.Tensor, qmax: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (q [..., D] int8 in [-qmax, qmax], scale [..., D // group] float32).

    Non-finite inputs saturate, as the fp8 stores do, without spoiling their group: the scale comes from the
    group's finite values, +-inf become +-qmax (the group's largest magnitude) and NaN becomes 0, the one value
    integer codes cannot hold. A group with no finite nonzero value takes the scale that reads +-qmax back
    as the model dtype's largest finite value.
    """
    xg = x.float().unflatten(-1, (-1, group))
    absmax = torch.where(torch.isfinite(xg), xg.abs(), 0.0).amax(-1, keepdim=True)
    # CUDA divides by a scalar as a multiply by its reciprocal and the CPU divides exactly; multiplying
    # on both makes the scales, and so the codes, bit-identical across devices.
    scale = (absmax * (1.0 / qmax)).clamp_min_(_MIN_SCALE)
    # A hair under max / qmax, so that qmax x scale cannot round past the dtype's largest finite value.
    saturated = torch.finfo(x.dtype).max / qmax * (1 - 2**-20)
    scale = torch.where(absmax > 0, scale, saturated)
    q = torch.nan_to_num(xg / scale, nan=0.0, posinf=qmax, neginf=-qmax)
    q = torch.round(q).clamp_(-qmax, qmax).to(torch.int8)
    return q.flatten(-2), scale.squeeze(-1)


def dequantize_symmetric(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] int8 and scale [..., D // group] float32 -> [..., D] in `dtype`."""
    return (q.float().unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] int8 in [-8, 7], D even -> [..., D // 2] uint8, two's complement nibbles."""
    nibbles = q.view(torch.uint8) & 0xF
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., D // 2] uint8 -> [..., D] int8 in [-8, 7]; inverse of pack_int4."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int8)
    return (nibbles ^ 8) - 8


class _KVPool:
    """What MHA and MLA pools share: geometry, argument checks, the fp8 byte store, accounting."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int,
                 device: str | torch.device, kv_cache_dtype: str, allowed_kv_cache_dtypes: tuple[str, ...]) -> None:
        check_int("size", size, minimum=1)
        check_int("page_size", page_size, minimum=1)
        check_int("layer_num", layer_num, minimum=1)
        if size % page_size:
            raise ValueError(f"size {size} must be a multiple of page_size {page_size}")
        if dtype not in MODEL_DTYPES:
            raise TypeError(f"dtype must be one of {MODEL_DTYPES} (the model dtype), got {dtype!r}")
        if kv_cache_dtype not in allowed_kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype must be one of {allowed_kv_cache_dtypes}, got {kv_cache_dtype!r}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.layer_num = layer_num
        self.kv_cache_dtype = kv_cache_dtype
        self.num_pages = size // page_size + 1
        self.num_slots = self.num_pages * page_size
        self.device = torch.empty(0, device=check_device(device)).device  # "cuda" -> "cuda:0", for comparisons
        self._fp8 = _FP8_DTYPES.get(kv_cache_dtype)
        if self._fp8 is not None:
            self.store_dtype = torch.uint8
        elif kv_cache_dtype == "int8":
            self.store_dtype = torch.int8
        elif kv_cache_dtype == "int4":
            self.store_dtype = torch.uint8
        else:
            self.store_dtype = dtype

    def _check_host_memory(self) -> None:
        if self.device.type == "cpu":
            check_host_bytes(f"a KV pool of {self.size} tokens", self.num_slots * self.bytes_per_token)

    def mem_usage_bytes(self) -> int:
        """Bytes held by all buffers of all layers, scales included."""
        return sum(t.numel() * t.element_size() for t in self._all_buffers())

    def _all_buffers(self) -> list[torch.Tensor]:
        raise NotImplementedError

    # ---- stored rows, for copies between tiers --------------------------------------------------------
    def row_formats(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(row shape, dtype) of each stored buffer of a layer (K, V, then K and V scales; or MLA's latent):
        what one slot occupies, exactly as stored (fp8 as uint8 codes, int4 packed, scales float32)."""
        return [(tuple(b.shape[self._slot_dims:]), b.dtype) for b in self._token_major_parts(0)]

    def slot_rows(self, layer_id: int, loc: torch.Tensor) -> list[torch.Tensor]:
        """Each stored buffer's rows of slots `loc` [n] in layer `layer_id`, as stored (codes and scales, no
        dequantization): [n, *row shape] copies on the pool's device, in `row_formats()` order."""
        self._check_layer(layer_id)
        index = self._slot_index(self._check_loc(loc))
        return [part[index] for part in self._token_major_parts(layer_id)]

    def set_slot_rows(self, layer_id: int, loc: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """Writes stored rows (as `slot_rows` returns them) into slots `loc` of layer `layer_id`, bit for bit."""
        self._check_layer(layer_id)
        loc = self._check_loc(loc)
        parts = self._token_major_parts(layer_id)
        if len(rows) != len(parts):
            raise ValueError(f"rows must hold {len(parts)} tensors (one per stored buffer), got {len(rows)}")
        for (shape, dtype), r in zip(self.row_formats(), rows):
            if not isinstance(r, torch.Tensor) or r.dtype != dtype or tuple(r.shape) != (len(loc), *shape):
                raise ValueError(f"rows must be [{len(loc)}, {', '.join(map(str, shape))}] {dtype} tensors, got "
                                 f"{tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}")
        index = self._slot_index(loc)
        for part, r in zip(parts, rows):
            part.index_put_(index, r.to(self.device))

    _slot_dims = 1  # leading dims of a token-major buffer that address a slot

    def _token_major_parts(self, layer_id: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def _slot_index(self, loc: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (loc,)

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= check_int("layer_id", layer_id) < self.layer_num:
            raise IndexError(f"layer_id {layer_id} out of range [0, {self.layer_num})")

    def _check_loc(self, loc: torch.Tensor, name: str = "loc") -> torch.Tensor:
        """Validates `loc` (the argument `name`) and returns it as int64."""
        if not isinstance(loc, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of slots, got {type(loc).__name__}")
        # uint8/bool index tensors would be read as masks, so only int32/int64 are slots.
        if loc.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 or int32, got dtype {loc.dtype}")
        if loc.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(loc.shape)}")
        if loc.device != self.device:
            raise ValueError(f"{name} is on {loc.device}, the pool on {self.device}")
        # Slot values are checked on host tensors only, as kernels/ does: on CUDA the check would read loc
        # back (a sync per call, i.e. per layer per step) and a CUDA graph cannot sync at all. On the host a
        # negative slot would otherwise wrap around silently.
        if loc.numel() and not loc.is_cuda:
            low, high = torch.stack(torch.aminmax(loc)).tolist()
            if low < 0 or high >= self.num_slots:
                bad = low if low < 0 else high
                raise IndexError(f"{name} holds slot {bad}, out of range [0, {self.num_slots})")
        return loc if loc.dtype == torch.int64 else loc.long()

    def _check_cache(self, name: str, cache: torch.Tensor, n: int, row_shape: tuple[int, ...]) -> None:
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dtype != self.dtype:
            raise TypeError(f"{name} dtype {cache.dtype} must equal the model dtype {self.dtype}")
        if tuple(cache.shape[1:]) != row_shape or cache.dim() != len(row_shape) + 1:
            raise ValueError(f"{name} shape {tuple(cache.shape)} must be [n, {', '.join(map(str, row_shape))}]")
        if cache.shape[0] != n:
            raise ValueError(f"{name} has {cache.shape[0]} rows but loc has {n} slots")
        if cache.device != self.device:
            raise ValueError(f"{name} is on {cache.device}, the pool on {self.device}")

    def _encode_fp8(self, x: torch.Tensor) -> torch.Tensor:
        limit = torch.finfo(self._fp8).max
        return x.clamp(-limit, limit).to(self._fp8).view(torch.uint8)

    def _as_stored_dtype(self, buf: torch.Tensor) -> torch.Tensor:
        """The fp8 byte store viewed as float8; every other buffer as it is."""
        return buf if self._fp8 is None else buf.view(self._fp8)


class MHAKVPool(_KVPool):
    """K and V caches for multi-head / grouped-query attention, one pair of buffers per layer.

    size: usable slots (1..size), a multiple of page_size. dtype: the model dtype (float16, bfloat16,
    float32); writes must come in it and reads return it. kv_cache_dtype: "auto" (store the model dtype),
    "fp8_e4m3", "fp8_e5m2", "int8" or "int4" (see the module docstring). quant_group: elements per
    int8/int4 scale, dividing head_dim and v_head_dim; None = one scale per head.
    layout: "NHD" -> k_buffer[l] [num_slots, head_num, head_dim]; "HND" -> [num_pages, head_num,
    page_size, head_dim], FlashInfer's HND pages.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str | torch.device = "cpu", layout: str = "NHD",
                 v_head_dim: int | None = None, kv_cache_dtype: str = "auto", quant_group: int | None = None) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, kv_cache_dtype, sizing.KV_CACHE_DTYPES)
        check_int("head_num", head_num, minimum=1)
        check_int("head_dim", head_dim, minimum=1)
        if v_head_dim is not None:
            check_int("v_head_dim", v_head_dim, minimum=1)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.layout = layout
        self.quant_group = quant_group
        self.bytes_per_token = sizing.bytes_per_token(self._sizing_config(), kv_cache_dtype, quant_group)
        self._check_host_memory()
        k_groups, v_groups = sizing.quant_groups(kv_cache_dtype, head_dim, self.v_head_dim, quant_group)
        self._k_group = head_dim // k_groups if k_groups else 0
        self._v_group = self.v_head_dim // v_groups if v_groups else 0
        packing = 2 if kv_cache_dtype == "int4" else 1
        self.k_buffer = self._alloc(head_dim // packing, self.store_dtype)
        self.v_buffer = self._alloc(self.v_head_dim // packing, self.store_dtype)
        # Per-slot scales for int8/int4, empty lists otherwise.
        self.k_scale_buffer = self._alloc(k_groups, torch.float32) if k_groups else []
        self.v_scale_buffer = self._alloc(v_groups, torch.float32) if v_groups else []

    def _sizing_config(self) -> sizing.MHAConfig:
        return sizing.MHAConfig(self.layer_num, self.head_num, self.head_dim, self.v_head_dim,
                                dtype=str(self.dtype).removeprefix("torch."))

    def _alloc(self, last_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
        if self.layout == "NHD":
            shape = (self.num_slots, self.head_num, last_dim)
        else:
            shape = (self.num_pages, self.head_num, self.page_size, last_dim)
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.layer_num)]

    def _all_buffers(self) -> list[torch.Tensor]:
        return self.k_buffer + self.v_buffer + self.k_scale_buffer + self.v_scale_buffer

    def _slot_index(self, loc: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Index into `_token_major(buf)` selecting slots `loc`."""
        if self.layout == "NHD":
            return (loc,)
        return (loc // self.page_size, loc % self.page_size)

    @property
    def _slot_dims(self) -> int:
        return 1 if self.layout == "NHD" else 2

    def _token_major_parts(self, layer_id: int) -> list[torch.Tensor]:
        bufs = [self.k_buffer, self.v_buffer] + ([self.k_scale_buffer, self.v_scale_buffer]
                                                 if self.k_scale_buffer else [])
        return [self._token_major(b[layer_id]) for b in bufs]

    def _token_major(self, buf: torch.Tensor) -> torch.Tensor:
        """A view whose leading dims address slots: NHD as is, HND as [num_pages, page_size, H, D]."""
        return buf if self.layout == "NHD" else buf.transpose(1, 2)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Writes K/V of n tokens into slots `loc` of layer `layer_id`, quantizing for fp8/int8/int4.

        loc: [n] int64 (or int32) slots in [0, num_slots). cache_k: [n, head_num, head_dim], cache_v:
        [n, head_num, v_head_dim], both in the model dtype. Raises before writing anything if an argument
        is bad (slot values are range-checked on CPU pools only; on CUDA that would sync every layer).
        loc must not repeat a slot: which row a repeated slot ends up holding is undefined, and an int8/int4
        pool may pair one row's codes with another's scale (the two writes resolve repeats independently).
        Inputs that require grad are written detached: the pool keeps no autograd graph.
        """
        self._check_layer(layer_id)
        loc = self._check_loc(loc)
        n = loc.shape[0]
        self._check_cache("cache_k", cache_k, n, (self.head_num, self.head_dim))
        self._check_cache("cache_v", cache_v, n, (self.head_num, self.v_head_dim))
        index = self._slot_index(loc)
        for cache, bufs, scales, group in ((cache_k, self.k_buffer, self.k_scale_buffer, self._k_group),
                                           (cache_v, self.v_buffer, self.v_scale_buffer, self._v_group)):
            stored, scale = self._encode(cache.detach(), group)
            self._token_major(bufs[layer_id]).index_put_(index, stored)
            if scale is not None:
                self._token_major(scales[layer_id]).index_put_(index, scale)

    def _encode(self, x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._fp8 is not None:
            return self._encode_fp8(x), None
        if self.kv_cache_dtype == "int8":
            return quantize_symmetric(x, _INT_QMAX["int8"], group)
        if self.kv_cache_dtype == "int4":
            q, scale = quantize_symmetric(x, _INT_QMAX["int4"], group)
            return pack_int4(q), scale
        return x, None

    def read_kv(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k [n, head_num, head_dim], v [n, head_num, v_head_dim]) of slots `loc`, dequantized to the model dtype.

        A gather (a copy), for tests and the reference attention; kernels read the buffers directly.
        """
        self._check_layer(layer_id)
        index = self._slot_index(self._check_loc(loc))
        return (self._read(self.k_buffer, self.k_scale_buffer, self._k_group, layer_id, index),
                self._read(self.v_buffer, self.v_scale_buffer, self._v_group, layer_id, index))

    def _read(self, bufs: list[torch.Tensor], scales: list[torch.Tensor], group: int, layer_id: int,
              index: tuple[torch.Tensor, ...]) -> torch.Tensor:
        stored = self._token_major(bufs[layer_id])[index]
        if self._fp8 is not None:
            return stored.view(self._fp8).to(self.dtype)
        if not scales:
            return stored
        q = unpack_int4(stored) if self.kv_cache_dtype == "int4" else stored
        return dequantize_symmetric(q, self._token_major(scales[layer_id])[index], group, self.dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s K storage (float8 view for fp8, int8 / packed uint8 for int8 / int4)."""
        self._check_layer(layer_id)
        return self._as_stored_dtype(self.k_buffer[layer_id])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s V storage, as get_key_buffer."""
        self._check_layer(layer_id)
        return self._as_stored_dtype(self.v_buffer[layer_id])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(get_key_buffer(layer_id), get_value_buffer(layer_id))."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_paged_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_pages, v_pages) views of the storage in FlashInfer's paged layout, no copy.

        NHD: [num_pages, page_size, head_num, D]; HND: [num_pages, head_num, page_size, D]. Slot s is
        page s // page_size, offset s % page_size. For int8/int4 these are the quantized pages; their
        scales are k_scale_buffer / v_scale_buffer.
        """
        k, v = self.get_kv_buffer(layer_id)
        if self.layout == "HND":
            return k, v
        return (k.view(self.num_pages, self.page_size, *k.shape[1:]),
                v.view(self.num_pages, self.page_size, *v.shape[1:]))


class MLAKVPool(_KVPool):
    """The latent cache of multi-head latent attention (DeepSeek-V2/V3): one row per token per layer.

    kv_buffer[l]: [num_slots, 1, kv_lora_rank + qk_rope_head_dim], the compressed KV (ckv) first and the
    rotary key part (kpe) after it. kv_cache_dtype: "auto", "fp8_e4m3" or "fp8_e5m2" (no int8/int4:
    MLA kernels take no per-group scales).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str | torch.device = "cpu", kv_cache_dtype: str = "auto") -> None:
        super().__init__(size, page_size, dtype, layer_num, device, kv_cache_dtype, ("auto", *_FP8_DTYPES))
        check_int("kv_lora_rank", kv_lora_rank, minimum=1)
        check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=1)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_dim = kv_lora_rank + qk_rope_head_dim
        config = sizing.MLAConfig(layer_num, kv_lora_rank, qk_rope_head_dim, dtype=str(dtype).removeprefix("torch."))
        self.bytes_per_token = sizing.bytes_per_token(config, kv_cache_dtype)
        self._check_host_memory()
        self.kv_buffer = [torch.zeros((self.num_slots, 1, self.kv_dim), dtype=self.store_dtype, device=self.device)
                          for _ in range(layer_num)]

    def _all_buffers(self) -> list[torch.Tensor]:
        return self.kv_buffer

    def _token_major_parts(self, layer_id: int) -> list[torch.Tensor]:
        return [self.kv_buffer[layer_id]]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Writes latent rows cache_k [n, 1, kv_lora_rank + qk_rope_head_dim] (model dtype) into slots `loc`."""
        self._check_layer(layer_id)
        loc = self._check_loc(loc)
        self._check_cache("cache_k", cache_k, loc.shape[0], (1, self.kv_dim))
        self._write(layer_id, loc, cache_k)

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k_nope: torch.Tensor,
                          cache_k_rope: torch.Tensor) -> None:
        """As set_kv_buffer with the row given in halves: cache_k_nope [n, 1, kv_lora_rank] and
        cache_k_rope [n, 1, qk_rope_head_dim], concatenated into one write."""
        self._check_layer(layer_id)
        loc = self._check_loc(loc)
        n = loc.shape[0]
        self._check_cache("cache_k_nope", cache_k_nope, n, (1, self.kv_lora_rank))
        self._check_cache("cache_k_rope", cache_k_rope, n, (1, self.qk_rope_head_dim))
        self._write(layer_id, loc, torch.cat((cache_k_nope, cache_k_rope), dim=-1))

    def _write(self, layer_id: int, loc: torch.Tensor, rows: torch.Tensor) -> None:
        rows = rows.detach()  # the pool keeps values, not an autograd graph
        stored = rows if self._fp8 is None else self._encode_fp8(rows)
        self.kv_buffer[layer_id].index_put_((loc,), stored)

    def read_kv(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k [n, 1, kv_dim], v [n, 1, kv_lora_rank]) of slots `loc` in the model dtype; v is a view of k."""
        self._check_layer(layer_id)
        rows = self._as_stored_dtype(self.kv_buffer[layer_id][self._check_loc(loc)]).to(self.dtype)
        return rows, rows[..., :self.kv_lora_rank]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s latent storage [num_slots, 1, kv_dim] (float8 view for fp8)."""
        self._check_layer(layer_id)
        return self._as_stored_dtype(self.kv_buffer[layer_id])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The ckv part [num_slots, 1, kv_lora_rank] of the latent storage, a view (MLA's V is the latent)."""
        return self.get_key_buffer(layer_id)[..., :self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(get_key_buffer(layer_id), get_value_buffer(layer_id))."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_paged_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ckv [num_pages, page_size, kv_lora_rank], kpe [num_pages, page_size, qk_rope_head_dim]).

        Strided views of the storage, no copy: the ckv_cache / kpe_cache pair that FlashInfer's
        BatchMLAPagedAttentionWrapper.run takes.
        """
        pages = self.get_key_buffer(layer_id).view(self.num_pages, self.page_size, self.kv_dim)
        return pages[..., :self.kv_lora_rank], pages[..., self.kv_lora_rank:]
