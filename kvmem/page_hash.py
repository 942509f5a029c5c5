"""The page hash: one name per cached page, shared by the KV events and the storage tier.

A page's digest chains its parent's, so it names the whole prefix up to and including that page: two pages
have equal digests only if their token prefixes (and namespaces) are equal. Definition (fixed; a change
would orphan every stored page and confuse every router, so it carries a version tag):

    digest = SHA-256( b"kvmem-page-hash-v2\\x00"
                      || namespace: b"\\x00" if None, else b"\\x01" || len(utf8) as 8-byte LE || utf8
                      || parent:    b"\\x00" if None (the first page), else b"\\x01" || the parent's 32-byte digest
                      || the page's token ids, each as a little-endian int64 )

The chain runs over whole 32-byte digests, so a collision of two short names can never make a child page
stand for another prefix. Two names are cut from a digest:
- the storage key: `digest.hex()` (64 characters), which is what a store looks pages up by;
- the event hash: `int.from_bytes(digest[:8], "big")`, unsigned 64-bit, what vLLM's KV events carry (its
  integer block hashes are a SHA-256 digest cut to 64 bits, sent as msgpack uint64).
The namespace is hashed into every page, not just the first, so requests in different namespaces never share
a page name in any tier.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from kvmem._checks import check_int

PAGE_HASH_VERSION = b"kvmem-page-hash-v2\x00"
DIGEST_BYTES = 32
_LITTLE_ENDIAN = sys.byteorder == "little"
_NO_PARENT = b"\x00"


def namespace_prefix(namespace: str | None) -> bytes:
    """The bytes every page digest of `namespace` starts with (the version tag and the namespace)."""
    if namespace is None:
        return PAGE_HASH_VERSION + b"\x00"
    encoded = encode_namespace("namespace", namespace)
    return PAGE_HASH_VERSION + b"\x01" + len(encoded).to_bytes(8, "little") + encoded


def encode_namespace(name: str, namespace: str) -> bytes:
    """`namespace` (a str) as UTF-8; raises naming `name` for another type or a str UTF-8 cannot encode (a lone
    surrogate): a namespace is hashed into every page name, so one that cannot be must be refused where it
    enters, before a tree or a request holds it."""
    if not isinstance(namespace, str):
        raise TypeError(f"{name} must be a str or None, got {type(namespace).__name__}")
    try:
        return namespace.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} {namespace!r} cannot be encoded as UTF-8 ({e.reason} at {e.start})") from None


def page_digests(token_ids, page_size: int, *, parent: bytes | None = None,
                 namespace: str | None = None) -> list[bytes]:
    """The chained 32-byte digests of the whole pages of `token_ids` (`page_size` tokens each; a partial tail
    page has none), the first page following the page whose digest is `parent` (None: the first page)."""
    page_size = check_int("page_size", page_size, minimum=1)
    parent = _check_parent(parent)
    ids = _token_array(token_ids)
    whole = len(ids) - len(ids) % page_size
    if whole == 0:
        return []
    view = memoryview(_little_endian(ids[:whole] if whole < len(ids) else ids)).cast("B")
    digests = _chain(namespace_prefix(namespace), parent, view, page_size * 8)
    return [digests[i:i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)]


def page_hashes(token_ids, page_size: int, *, parent: bytes | None = None,
                namespace: str | None = None) -> list[int]:
    """The 64-bit event hashes of the whole pages of `token_ids` (see `page_digests`)."""
    return [event_hash(d) for d in page_digests(token_ids, page_size, parent=parent, namespace=namespace)]


def page_hash(parent: bytes | None, token_ids, namespace: str | None = None) -> bytes:
    """The digest of one page: `token_ids` (a non-empty sequence of int64 token ids) after the page whose
    digest is `parent` (None for a first page), in `namespace` (None: the default namespace)."""
    ids = _token_array(token_ids)
    if not ids:
        raise ValueError("token_ids is empty: a page holds at least one token")
    return page_digests(ids, len(ids), parent=parent, namespace=namespace)[0]


def event_hash(digest: bytes) -> int:
    """A page's 64-bit event hash: the first 8 bytes of its digest, big-endian, unsigned."""
    return int.from_bytes(digest[:8], "big")


def event_hashes(digests: bytes) -> list[int]:
    """The event hashes of concatenated 32-byte digests (as the radix tree keeps them per node)."""
    return [int.from_bytes(digests[i:i + 8], "big") for i in range(0, len(digests), DIGEST_BYTES)]


def storage_key(digest: bytes) -> str:
    """A page's storage key: its digest in hex."""
    return digest.hex()


def chain_page_digests(prefix: bytes, parent: bytes | None, key: bytes | memoryview, page_bytes: int) -> bytes:
    """Unchecked: the concatenated digests of the whole pages of `key` (native int64 token ids, as the radix
    tree stores them), after `parent`, under `prefix` (from `namespace_prefix`)."""
    if not _LITTLE_ENDIAN:
        key = memoryview(_little_endian(array("q", bytes(key)))).cast("B")
    return _chain(prefix, parent, key, page_bytes)


def _chain(prefix: bytes, parent: bytes | None, view, page_bytes: int) -> bytes:
    # One sha256 call over one concatenation per page: Python's per-call overhead, not the hashing, is most
    # of the cost at small pages.
    out = []
    sha256 = hashlib.sha256
    parent_bytes = _NO_PARENT if parent is None else b"\x01" + parent
    key = bytes(view)
    for start in range(0, len(key), page_bytes):
        digest = sha256(prefix + parent_bytes + key[start:start + page_bytes]).digest()
        parent_bytes = b"\x01" + digest
        out.append(digest)
    return b"".join(out)


def _check_parent(parent) -> bytes | None:
    if parent is None:
        return None
    if not isinstance(parent, (bytes, bytearray)) or len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent must be a {DIGEST_BYTES}-byte page digest or None, got {parent!r}")
    return bytes(parent)


def _token_array(token_ids) -> array:
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids
    if isinstance(token_ids, (bytes, bytearray, str)):
        raise TypeError(f"token_ids must be a sequence of int token ids, got {type(token_ids).__name__}")
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
