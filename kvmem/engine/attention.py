"""The engine's attention over kvmem's pools: planned once per batch from `ScheduleBatch.attention_metadata()`,
run once per layer after the layer's new K/V (or MLA latent) is written at `out_cache_loc`.

- `TorchAttention`: `reference_paged_attention` (any device; the CPU path).
- `FlashInferBackend`: FlashInfer's batch prefill / decode for MHA, and its BatchMLAPagedAttentionWrapper for
  MLA at the dims its kernels are built for (kv_lora_rank 512, qk_rope_head_dim 64, unquantized; other MLA
  pools use the torch reference on the GPU). CUDA only; flashinfer is imported when one is built, never on the CPU.

MLA runs in the absorbed form: the query's no-position part is projected into the latent space (q_nope @ W_UK)
so attention is multi-query attention over the cached latent rows, keys [ckv, kpe] and values ckv; the caller
projects the latent output back with W_UV.
"""

from __future__ import annotations

from kvmem._torch import torch
from kvmem.attention.metadata import PagedKVMetadata
from kvmem.attention.pool_pages import kv_pages
from kvmem.attention.reference import reference_paged_attention
from kvmem.kv_pool import MHAKVPool, MLAKVPool

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
# The (kv_lora_rank, qk_rope_head_dim) FlashInfer's MLA kernels are compiled for (DeepSeek-V2/V3's).
FLASHINFER_MLA_DIMS = (512, 64)


class TorchAttention:
    """Paged attention with `reference_paged_attention`, reading the pool through `kv_pages`."""

    def __init__(self) -> None:
        self._md: PagedKVMetadata | None = None

    def plan(self, metadata: PagedKVMetadata, seq_lens: torch.Tensor, decode: bool) -> None:
        """Keeps the batch's metadata for the layers' runs (the reference needs no planning)."""
        self._md = metadata

    def mha(self, pool: MHAKVPool, layer_id: int, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """q [num_tokens, Hq, D] -> [num_tokens, Hq, v_head_dim], causal over each request's cached tokens."""
        md = self._md
        pages = kv_pages(pool, layer_id, md.kv_indices)
        return reference_paged_attention(q, pages.k_pages, pages.v_pages, md.qo_indptr, md.kv_indptr, pages.kv_indices,
                                         md.kv_last_page_len, layout=pages.layout, sm_scale=sm_scale)

    def mla(self, pool: MLAKVPool, layer_id: int, q_latent: torch.Tensor, q_pe: torch.Tensor,
            sm_scale: float) -> torch.Tensor:
        """q_latent [num_tokens, H, kv_lora_rank], q_pe [num_tokens, H, qk_rope_head_dim] -> latent output
        [num_tokens, H, kv_lora_rank]."""
        md = self._md
        pages = kv_pages(pool, layer_id, md.kv_indices)
        return reference_paged_attention(torch.cat((q_latent, q_pe), dim=-1), pages.k_pages, pages.v_pages,
                                         md.qo_indptr, md.kv_indptr, pages.kv_indices, md.kv_last_page_len,
                                         sm_scale=sm_scale)


class FlashInferBackend:
    """FlashInfer over the pool (CUDA). fp8 pools are read in place (FlashInfer takes float8 K/V); int8/int4
    pools through a dequantized copy of the batch's pages (`kv_pages`), planned once per batch on the
    renumbered page ids."""

    def __init__(self, pool: MHAKVPool | MLAKVPool, num_qo_heads: int, device: torch.device) -> None:
        from kvmem.attention.flashinfer import FlashInferAttention, _import_flashinfer

        flashinfer = _import_flashinfer()
        self.pool = pool
        self.num_qo_heads = num_qo_heads
        self._dequantize = pool.kv_cache_dtype in ("int8", "int4")
        self._mla = self._mha = None
        self._fallback = TorchAttention()
        if isinstance(pool, MLAKVPool):
            # fp8 latents go through the reference too: the MLA kernels are planned for one q/kv dtype here.
            if (pool.kv_lora_rank, pool.qk_rope_head_dim) == FLASHINFER_MLA_DIMS and pool.kv_cache_dtype == "auto":
                workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
                self._mla = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
        else:
            layout = "NHD" if self._dequantize else pool.layout
            self._mha = FlashInferAttention(num_qo_heads, pool.head_num, pool.head_dim, kv_layout=layout, device=device)
        self._kv_indices: torch.Tensor | None = None
        self._sm_scale: float | None = None
        self._plan_args = None
        self._planned_for = None

    def plan(self, metadata: PagedKVMetadata, seq_lens: torch.Tensor, decode: bool) -> None:
        """Records the batch; the FlashInfer plan itself waits for the first layer, which brings sm_scale and
        the query dtype."""
        self._fallback.plan(metadata, seq_lens, decode)
        if self._dequantize:
            # kv_pages numbers the batch's distinct pages in sorted order, the same for every layer: plan on that.
            renumbered = torch.unique(metadata.kv_indices.long(), return_inverse=True)[1].to(torch.int32)
            metadata = PagedKVMetadata(metadata.qo_indptr, metadata.kv_indptr, renumbered,
                                       metadata.kv_last_page_len, metadata.page_size)
        self._plan_args = (metadata, seq_lens.to(metadata.kv_indptr.device, torch.int32), decode)
        self._planned_for = None

    def _kv_dtype(self) -> torch.dtype:
        pool = self.pool
        return pool.dtype if self._dequantize or pool.kv_cache_dtype == "auto" else pool.get_key_buffer(0).dtype

    def _ensure_planned(self, q_dtype: torch.dtype, sm_scale: float) -> None:
        if self._planned_for == (q_dtype, sm_scale):
            return
        md, seq_lens, decode = self._plan_args
        if self._mha is not None:
            if decode:
                self._mha.plan_decode(md, q_dtype, self._kv_dtype(), sm_scale=sm_scale)
            else:
                self._mha.plan_extend(md, q_dtype, self._kv_dtype(), causal=True, sm_scale=sm_scale)
        else:
            pool = self.pool
            self._mla.plan(md.qo_indptr, md.kv_indptr, md.kv_indices, seq_lens, self.num_qo_heads,
                           pool.kv_lora_rank, pool.qk_rope_head_dim, md.page_size, True, sm_scale, q_dtype,
                           self._kv_dtype())
        self._planned_for = (q_dtype, sm_scale)

    def mha(self, pool: MHAKVPool, layer_id: int, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """As TorchAttention.mha, with FlashInfer's kernels."""
        self._ensure_planned(q.dtype, sm_scale)
        if self._dequantize:
            pages = kv_pages(pool, layer_id, self._fallback._md.kv_indices)
            return self._mha.run(q, (pages.k_pages, pages.v_pages))
        return self._mha.run(q, pool.get_paged_kv_buffer(layer_id))

    def mla(self, pool: MLAKVPool, layer_id: int, q_latent: torch.Tensor, q_pe: torch.Tensor,
            sm_scale: float) -> torch.Tensor:
        """As TorchAttention.mla; FlashInfer's MLA kernel at its dims, the torch reference otherwise."""
        if self._mla is None:
            return self._fallback.mla(pool, layer_id, q_latent, q_pe, sm_scale)
        self._ensure_planned(q_latent.dtype, sm_scale)
        ckv, kpe = pool.get_paged_kv_buffer(layer_id)
        return self._mla.run(q_latent, q_pe, ckv, kpe)


def make_attention_backend(name: str, pool: MHAKVPool | MLAKVPool, num_qo_heads: int,
                           device: torch.device) -> TorchAttention | FlashInferBackend:
    """"auto": FlashInfer for a float16/bfloat16 model on CUDA when flashinfer imports, else the torch reference;
    "torch" / "flashinfer" force one ("flashinfer" raises RuntimeError without CUDA or the package)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    # FlashInfer's kernels take float16 / bfloat16 queries: "auto" keeps float32 models on the reference.
    if name == "torch" or (name == "auto" and (device.type != "cuda" or pool.dtype == torch.float32)):
        return TorchAttention()
    if name == "auto":
        try:
            return FlashInferBackend(pool, num_qo_heads, device)
        except RuntimeError:  # no flashinfer package: the reference still serves, slowly
            return TorchAttention()
    return FlashInferBackend(pool, num_qo_heads, device)
