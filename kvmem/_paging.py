"""Page arithmetic, written once: page p holds slots p * page_size .. p * page_size + page_size - 1.

Each helper works alike on ints, numpy arrays and torch tensors of non-negative token counts.
"""

from __future__ import annotations

TOKEN_BYTES = 8  # a token id as radix-tree keys and page hashes hold it: int64


def pages_for(num_tokens, page_size: int):
    """Pages that `num_tokens` tokens occupy: ceil(num_tokens / page_size), written with floor division of
    the negation so that it cannot overflow near the top of int64."""
    return -(-num_tokens // page_size)


def round_up(num_tokens, page_size: int):
    """`num_tokens` rounded up to whole pages, in tokens."""
    return pages_for(num_tokens, page_size) * page_size


def num_new_pages(prefix_lens, seq_lens, page_size: int):
    """Whole new pages that growing a request from prefix_lens to seq_lens tokens takes (its partial last
    page is filled first)."""
    return pages_for(seq_lens, page_size) - pages_for(prefix_lens, page_size)
