"""Triton kernels for KV-cache metadata, each with a torch fallback that gives identical results."""

from kernels.kv_indices import create_kv_indices, create_kv_indptr, kv_last_page_len
from kernels.paged_alloc import alloc_decode_slots, alloc_extend_slots, num_new_pages
from kernels.req_to_token import write_req_to_token

__all__ = [
    "alloc_decode_slots",
    "alloc_extend_slots",
    "create_kv_indices",
    "create_kv_indptr",
    "kv_last_page_len",
    "num_new_pages",
    "write_req_to_token",
]
