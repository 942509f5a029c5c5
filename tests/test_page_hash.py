"""The page hash is a fixed, documented function: chained SHA-256 over (namespace, parent, token ids)."""

import hashlib
from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmem.page_hash import chain_page_hashes, namespace_prefix, page_hash, page_hashes


def reference_page_hash(parent, tokens, namespace=None):
    """The definition in kvmem/page_hash.py's docstring, written out byte by byte."""
    data = b"kvmem-page-hash-v1\x00"
    if namespace is None:
        data += b"\x00"
    else:
        ns = namespace.encode()
        data += b"\x01" + len(ns).to_bytes(8, "little") + ns
    data += b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def test_page_hash_follows_its_documented_definition():
    assert page_hash(None, [1, 2, 3]) == reference_page_hash(None, [1, 2, 3])
    assert page_hash(2**64 - 1, [-5], "tenant-a") == reference_page_hash(2**64 - 1, [-5], "tenant-a")


def test_page_hash_is_pinned_to_a_known_value():
    # A change of definition would orphan every stored page and confuse routers: it must be deliberate.
    first = page_hash(None, [1, 2, 3])
    assert first == 0xBE94_C209_D679_DEEF
    assert page_hash(first, [4, 5, 6], "tenant") == 0x899B_3D4D_2C73_208D


@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=40), st.integers(1, 8),
       st.one_of(st.none(), st.text(max_size=5)))
def test_page_hashes_chain_page_by_page(tokens, page_size, namespace):
    hashes = page_hashes(tokens, page_size, namespace=namespace)
    assert len(hashes) == len(tokens) // page_size
    parent = None
    for i, h in enumerate(hashes):
        assert h == reference_page_hash(parent, tokens[i * page_size:(i + 1) * page_size], namespace)
        assert 0 <= h < 2**64
        parent = h


def test_hashes_name_the_whole_prefix_and_the_namespace():
    a = page_hashes([1, 2, 3, 4], 2)
    b = page_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]                               # same page, different prefix
    assert page_hashes([1, 2, 3, 4], 2, namespace="x") != a
    assert page_hashes([1, 2, 3, 4], 2, namespace="") != a   # "" is a namespace, None is none
    assert page_hashes([1, 2, 3, 4, 5], 2) == a      # a partial tail page has no hash


def test_page_hashes_continue_a_chain_from_a_parent():
    whole = page_hashes(list(range(12)), 4)
    assert page_hashes(list(range(4, 12)), 4, parent_hash=whole[0]) == whole[1:]


def test_chain_page_hashes_reads_the_radix_trees_key_bytes():
    ids = array("q", [7, -1, 2**40, 3])
    key = ids.tobytes()
    assert chain_page_hashes(namespace_prefix(None), None, key, 16) == page_hashes(ids, 2)
    assert chain_page_hashes(namespace_prefix("n"), 5, memoryview(key), 8) == page_hashes(ids, 1, parent_hash=5,
                                                                                           namespace="n")


def test_token_ids_may_be_numpy():
    assert page_hashes(np.arange(6), 3) == page_hashes(list(range(6)), 3)


@pytest.mark.parametrize("call, error, match", [
    (lambda: page_hash(None, []), ValueError, "empty"),
    (lambda: page_hash(-1, [1]), ValueError, "parent_hash"),
    (lambda: page_hash(2**64, [1]), ValueError, "parent_hash"),
    (lambda: page_hash(None, [1.5]), TypeError, "token_ids"),
    (lambda: page_hash(None, [2**63]), ValueError, "int64"),
    (lambda: page_hash(None, [1], namespace=3), TypeError, "namespace"),
    (lambda: page_hashes([1], 0), ValueError, "page_size"),
    (lambda: page_hashes("abc", 1), TypeError, "token_ids"),
])
def test_bad_arguments_raise_naming_them(call, error, match):
    with pytest.raises(error, match=match):
        call()
