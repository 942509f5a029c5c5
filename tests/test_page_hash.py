"""The page hash is a fixed, documented function: chained SHA-256 over (namespace, parent digest, token ids)."""

import hashlib
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.page_hash import (
    chain_page_digests,
    event_hash,
    event_hashes,
    namespace_prefix,
    page_digests,
    page_hash,
    page_hashes,
    storage_key,
)


def reference_digest(parent, tokens, namespace=None):
    """The definition in kvmem/page_hash.py's docstring, written out byte by byte."""
    data = b"kvmem-page-hash-v2\x00"
    if namespace is None:
        data += b"\x00"
    else:
        ns = namespace.encode()
        data += b"\x01" + len(ns).to_bytes(8, "little") + ns
    data += b"\x00" if parent is None else b"\x01" + parent
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return hashlib.sha256(data).digest()


def test_page_hash_follows_its_documented_definition():
    assert page_hash(None, [1, 2, 3]) == reference_digest(None, [1, 2, 3])
    parent = bytes(range(32))
    assert page_hash(parent, [-5], "tenant-a") == reference_digest(parent, [-5], "tenant-a")


def test_page_hash_is_pinned_to_a_known_value():
    # A change of definition would orphan every stored page and confuse routers: it must be deliberate.
    first = page_hash(None, [1, 2, 3])
    assert storage_key(first) == reference_digest(None, [1, 2, 3]).hex()
    assert event_hash(first) == 0x70B4_4B9E_7ADA_9E69
    assert event_hash(page_hash(first, [4, 5, 6], "tenant")) == 0xD9B4_7F5F_8EEF_45A1


@settings(deadline=None)  # as the other property tests: a busy machine is not a failure
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=40), st.integers(1, 8),
       st.one_of(st.none(), st.text(max_size=5)))
def test_page_digests_chain_page_by_page_over_whole_digests(tokens, page_size, namespace):
    digests = page_digests(tokens, page_size, namespace=namespace)
    assert len(digests) == len(tokens) // page_size
    parent = None
    for i, d in enumerate(digests):
        assert d == reference_digest(parent, tokens[i * page_size:(i + 1) * page_size], namespace)
        parent = d
    assert page_hashes(tokens, page_size, namespace=namespace) == [event_hash(d) for d in digests]
    assert all(0 <= h < 2**64 for h in page_hashes(tokens, page_size, namespace=namespace))


def test_hashes_name_the_whole_prefix_and_the_namespace():
    a = page_hashes([1, 2, 3, 4], 2)
    b = page_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]                               # same page, different prefix
    assert page_hashes([1, 2, 3, 4], 2, namespace="x") != a
    assert page_hashes([1, 2, 3, 4], 2, namespace="") != a   # "" is a namespace, None is none
    assert page_hashes([1, 2, 3, 4, 5], 2) == a      # a partial tail page has no hash


def test_page_digests_continue_a_chain_from_a_parent():
    whole = page_digests(list(range(12)), 4)
    assert page_digests(list(range(4, 12)), 4, parent=whole[0]) == whole[1:]


def test_chain_page_digests_reads_the_radix_trees_key_bytes():
    ids = array("q", [7, -1, 2**40, 3])
    key = ids.tobytes()
    assert chain_page_digests(namespace_prefix(None), None, key, 16) == b"".join(page_digests(ids, 2))
    parent = page_hash(None, [5])
    chained = chain_page_digests(namespace_prefix("n"), parent, memoryview(key), 8)
    assert chained == b"".join(page_digests(ids, 1, parent=parent, namespace="n"))
    assert event_hashes(chained) == page_hashes(ids, 1, parent=parent, namespace="n")


def test_token_ids_may_be_numpy():
    assert page_hashes(np.arange(6), 3) == page_hashes(list(range(6)), 3)


@pytest.mark.parametrize("call, error, match", [
    (lambda: page_hash(None, []), ValueError, "empty"),
    (lambda: page_hash(b"short", [1]), ValueError, "parent"),
    (lambda: page_hash(7, [1]), ValueError, "parent"),
    (lambda: page_hash(None, [1.5]), TypeError, "token_ids"),
    (lambda: page_hash(None, [2**63]), ValueError, "int64"),
    (lambda: page_hash(None, [1], namespace=3), TypeError, "namespace"),
    (lambda: page_hashes([1], 0), ValueError, "page_size"),
    (lambda: page_hashes("abc", 1), TypeError, "token_ids"),
])
def test_bad_arguments_raise_naming_them(call, error, match):
    with pytest.raises(error, match=match):
        call()
