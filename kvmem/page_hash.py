"""The page hash: one 64-bit name per cached page, shared by the KV events and the storage tier.

A page's hash chains its parent's, so a hash names the whole prefix up to and including that page: two
pages have equal hashes only if their token prefixes (and namespaces) are equal. Definition (fixed; a
change would orphan every stored page and confuse every router, so it carries a version tag):

    digest = SHA-256( b"kvmem-page-hash-v1\\x00"
                      || namespace: b"\\x00" if None, else b"\\x01" || len(utf8) as 8-byte LE || utf8
                      || parent:    b"\\x00" if None (the first page), else b"\\x01" || parent as 8-byte LE
                      || the page's token ids, each as a little-endian int64 )
    page_hash = int.from_bytes(digest[:8], "big")        # unsigned, in [0, 2**64)

64 bits is what vLLM's events carry (its default integer block hashes are a SHA-256 digest cut to 64 bits,
sent as msgpack uint64), so the hashes go on the wire unchanged. The namespace is hashed into every page,
not just the first, so a page's hash never depends on how its chain was started.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from kvmem._checks import check_int

PAGE_HASH_VERSION = b"kvmem-page-hash-v1\x00"
_LITTLE_ENDIAN = sys.byteorder == "little"
_NO_PARENT = b"\x00"


def namespace_prefix(namespace: str | None) -> bytes:
    """The bytes every page hash of `namespace` starts with (the version tag and the namespace)."""
    if namespace is None:
        return PAGE_HASH_VERSION + b"\x00"
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
    encoded = namespace.encode("utf-8")
    return PAGE_HASH_VERSION + b"\x01" + len(encoded).to_bytes(8, "little") + encoded


def page_hash(parent_hash: int | None, token_ids, namespace: str | None = None) -> int:
    """The hash of one page: `token_ids` (a non-empty sequence of int64 token ids) after the page whose
    hash is `parent_hash` (None for a first page), in `namespace` (None: the default namespace)."""
    parent = _check_parent(parent_hash)
    ids = _token_array(token_ids)
    if not ids:
        raise ValueError("token_ids is empty: a page holds at least one token")
    return _chain(namespace_prefix(namespace), parent, memoryview(_little_endian(ids)).cast("B"), len(ids) * 8)[0]


def page_hashes(token_ids, page_size: int, *, parent_hash: int | None = None,
                namespace: str | None = None) -> list[int]:
    """The chained hashes of the whole pages of `token_ids` (`page_size` tokens each; a partial tail
    page has no hash), the first page following `parent_hash`."""
    page_size = check_int("page_size", page_size, minimum=1)
    parent = _check_parent(parent_hash)
    ids = _token_array(token_ids)
    whole = len(ids) - len(ids) % page_size
    if whole == 0:
        return []
    view = memoryview(_little_endian(ids[:whole] if whole < len(ids) else ids)).cast("B")
    return _chain(namespace_prefix(namespace), parent, view, page_size * 8)


def chain_page_hashes(prefix: bytes, parent_hash: int | None, key: bytes | memoryview, page_bytes: int) -> list[int]:
    """Unchecked: the chained hashes of the whole pages of `key` (native int64 token ids, as the radix
    tree stores them), after `parent_hash`, under `prefix` (from `namespace_prefix`)."""
    if not _LITTLE_ENDIAN:
        key = memoryview(_little_endian(array("q", bytes(key)))).cast("B")
    return _chain(prefix, parent_hash, key, page_bytes)


def _chain(prefix: bytes, parent: int | None, view, page_bytes: int) -> list[int]:
    # One sha256 call over one concatenation per page: Python's per-call overhead, not the hashing,
    # is most of the cost at small pages.
    out = []
    sha256, from_bytes = hashlib.sha256, int.from_bytes
    parent_bytes = _NO_PARENT if parent is None else b"\x01" + parent.to_bytes(8, "little")
    key = bytes(view)
    for start in range(0, len(key), page_bytes):
        parent = from_bytes(sha256(prefix + parent_bytes + key[start:start + page_bytes]).digest()[:8], "big")
        parent_bytes = b"\x01" + parent.to_bytes(8, "little")
        out.append(parent)
    return out


def _check_parent(parent_hash) -> int | None:
    if parent_hash is None:
        return None
    return check_int("parent_hash", parent_hash, minimum=0, maximum=2**64 - 1)


def _token_array(token_ids) -> array:
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids
    try:
        return array("q", token_ids)
    except TypeError as e:
        raise TypeError(f"token_ids must be a sequence of int token ids, got {type(token_ids).__name__} "
                        f"({e})") from None
    except OverflowError:
        raise ValueError("token_ids holds a token id outside int64") from None


def _little_endian(ids: array) -> array:
    if _LITTLE_ENDIAN:
        return ids
    swapped = array("q", ids)
    swapped.byteswap()
    return swapped
