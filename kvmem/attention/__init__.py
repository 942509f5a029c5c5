"""Paged attention over the KV pool: FlashInfer's metadata, a thin FlashInfer wrapper, a torch reference.

FlashInfer's paged layout (https://docs.flashinfer.ai/tutorials/kv_layout.html) is a CSR over pages:

    qo_indptr        [bs + 1] int32  request i's queries are q[qo_indptr[i]:qo_indptr[i+1]]
    kv_indptr        [bs + 1] int32  request i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices       [kv_indptr[-1]] int32 page ids into the paged K/V buffers
    kv_last_page_len [bs] int32      tokens in the last page: 1..page_size (0 for a request with no pages)

so request i has kv_len = (num_pages - 1) * page_size + kv_last_page_len[i] tokens. The paged buffers are
[num_pages, page_size, H, D] ("NHD") or [num_pages, H, page_size, D] ("HND"); with page_size 1 a page is
a slot and kv_indices lists slots. In an extend, query t of a request with qo_len q and kv_len k sits at
position k - q + t and attends causally to kv positions <= k - q + t (the mask is aligned bottom-right).

Cascade attention (`build_cascade_metadata`, kvmem.attention.cascade) splits each request's KV into levels
over the same layout, shared prefixes from the radix tree first, and merges the per-level results with the
log-sum-exp merge (`merge_state`, kvmem.attention.merge; base-2 lse, as FlashInfer).
"""

from kvmem.attention.cache_attention import MultiHeadCacheAttention, openppl_cache_pool
from kvmem.attention.cascade import CascadeMetadata, build_cascade_metadata
from kvmem.attention.flashinfer import KV_LAYOUTS, FlashInferAttention
from kvmem.attention.merge import merge_state, merge_states
from kvmem.attention.metadata import PagedKVMetadata, build_decode_metadata, build_extend_metadata
from kvmem.attention.pool_pages import KVPages, kv_pages
from kvmem.attention.reference import reference_cascade_attention, reference_paged_attention

__all__ = [
    "KV_LAYOUTS",
    "CascadeMetadata",
    "FlashInferAttention",
    "KVPages",
    "MultiHeadCacheAttention",
    "PagedKVMetadata",
    "build_cascade_metadata",
    "build_decode_metadata",
    "build_extend_metadata",
    "merge_state",
    "merge_states",
    "reference_cascade_attention",
    "kv_pages",
    "openppl_cache_pool",
    "reference_paged_attention",
]
