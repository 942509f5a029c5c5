"""Triton kernels for KV-cache metadata, each with a torch fallback that gives identical results."""

from .kv_indices import create_kv_indices, create_kv_indptr, kv_last_page_len
from .req_to_token import write_req_to_token

__all__ = [
    "create_kv_indices",
    "create_kv_indptr",
    "kv_last_page_len",
    "write_req_to_token",
]
