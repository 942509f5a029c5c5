"""How a KV page is stored: a header, the page's bytes in the pool's storage format, and a checksum.

    offset  size  field
    0       4     magic b"KVMP"
    4       2     format version (1), little-endian
    6       2     reserved (0)
    8       4     page size (tokens), little-endian
    12      8     payload length (bytes), little-endian
    20      32    the page's digest (`kvmem.page_hash`): the prefix this page ends
    52      32    the pool format fingerprint: SHA-256 of the model id, dtypes, layouts and row shapes
    84      n     payload: the page's stored rows (codes and scales as the device stores them)
    84 + n  4     CRC-32 (zlib's) of everything before it, little-endian

A value is loaded only if every field matches what the reader expects: its magic and version, its page size,
the digest of the page the reader is looking for (so a value filed under the wrong key is never taken for
the right page), the fingerprint of the reader's pool (another model, dtype or layout is a miss, not a wrong
load), its payload length (what the reader's pool holds per page), and its checksum (a corrupt or truncated value
is a miss). `decode_page` returns None for any of these; `is_foreign` tells an intact value written for another
reader under its own key (a miss the store leaves for its owner) from every other failure: a damaged value, or an
intact one filed under another page's key or of the wrong length, which the store counts as corrupt and drops, so
that the next write of the right page stores it again.

The checksum guards against corruption (bit rot, a torn or truncated write), not forgery: whoever can write a
value can compute any checksum of it, so a store is trusted as much as its writers. CRC-32 catches every burst
of up to 32 flipped bits and misses random damage with probability 2**-32, and runs several times faster
than a cryptographic hash (BLAKE2b), a small share of a page's read.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

MAGIC = b"KVMP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHIQ32s32s")
HEADER_BYTES = _HEADER.size
CHECKSUM_BYTES = 4
_CHECKSUM = struct.Struct("<I")


def fingerprint(description: str) -> bytes:
    """A 32-byte fingerprint of a pool's storage format, from its canonical description."""
    return hashlib.sha256(description.encode("utf-8")).digest()


def encode_page(digest: bytes, format_fingerprint: bytes, page_size: int, payload) -> bytes:
    """The stored value of one page (see the module docstring)."""
    payload = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, page_size, len(payload), digest, format_fingerprint)
    return b"".join((header, payload, _CHECKSUM.pack(zlib.crc32(payload, zlib.crc32(header)))))


def is_intact(value) -> bool:
    """Whether `value` is a whole page as some writer encoded it: its magic, version, length and checksum."""
    view = memoryview(value).cast("B")
    if len(view) < HEADER_BYTES + CHECKSUM_BYTES:
        return False
    magic, version, _, _, length, _, _ = _HEADER.unpack(view[:HEADER_BYTES])
    end = HEADER_BYTES + length
    return (magic, version) == (MAGIC, FORMAT_VERSION) and len(view) == end + CHECKSUM_BYTES and \
        _CHECKSUM.unpack(view[end:])[0] == zlib.crc32(view[:end])


def value_extent(header) -> tuple[bytes, int] | None:
    """(the digest it claims, its whole length in bytes) of the value whose first HEADER_BYTES are `header`; None
    unless its magic and version are right. What a reader walking values packed end to end needs; it proves
    nothing about the value (`decode_page` does)."""
    view = memoryview(header).cast("B")
    if len(view) < HEADER_BYTES:
        return None
    magic, version, _, _, length, digest, _ = _HEADER.unpack(view[:HEADER_BYTES])
    if (magic, version) != (MAGIC, FORMAT_VERSION):
        return None
    return digest, HEADER_BYTES + length + CHECKSUM_BYTES


def is_foreign(value, digest: bytes, format_fingerprint: bytes, page_size: int) -> bool:
    """Whether `value` is an intact page filed under its own `digest` but written for another pool format or page
    size: another reader's page, not a damaged one."""
    if not is_intact(value):
        return False
    _, _, _, size, _, stored_digest, stored_fingerprint = _HEADER.unpack(memoryview(value).cast("B")[:HEADER_BYTES])
    return stored_digest == digest and (stored_fingerprint, size) != (format_fingerprint, page_size)


def decode_page(value, digest: bytes, format_fingerprint: bytes, page_size: int,
                payload_bytes: int | None = None) -> memoryview | None:
    """The payload of `value` if it is an intact page with the expected digest, fingerprint and page size (and
    `payload_bytes` long, unless None); None otherwise (the caller counts it as a miss)."""
    if value is None:
        return None
    view = memoryview(value).cast("B")
    if len(view) < HEADER_BYTES + CHECKSUM_BYTES:
        return None
    magic, version, _, size, length, stored_digest, stored_fingerprint = _HEADER.unpack(view[:HEADER_BYTES])
    if (magic, version, size, stored_digest, stored_fingerprint) != (MAGIC, FORMAT_VERSION, page_size, digest,
                                                                      format_fingerprint):
        return None
    if payload_bytes is not None and length != payload_bytes:
        return None
    end = HEADER_BYTES + length
    if len(view) != end + CHECKSUM_BYTES:
        return None
    if _CHECKSUM.unpack(view[end:])[0] != zlib.crc32(view[:end]):
        return None
    return view[HEADER_BYTES:end]
