"""The storage tier's small parts at their edges: a page value with an empty payload, the LRU's count of what it
holds as pages leave, and the simulated store a spec names with its capacity."""

import pytest

from kvmem.storage import SimStore, open_store, parse_store_spec
from kvmem.storage.lru import PageLRU
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES, encode_page, fingerprint, is_intact


def test_a_value_with_an_empty_payload_is_a_whole_page_and_a_byte_less_is_not():
    value = encode_page(b"d" * 32, fingerprint("f"), 1, b"")
    assert len(value) == HEADER_BYTES + CHECKSUM_BYTES and is_intact(value)
    assert not is_intact(value[:-1]) and not is_intact(value + b"\0")


def test_the_lru_counts_what_it_holds_down_as_pages_leave_and_up_as_they_come_back():
    lru = PageLRU(lambda value: value)
    lru.add("a", 3)
    lru.add("b", 5)
    assert lru.remove("a") == 3 and lru.used == 5
    assert lru.remove("a") is None and lru.used == 5
    lru.add("b", 2)  # replaced: counts its new size only
    assert lru.used == 2 and lru.remove("b") == 2 and lru.used == 0 and len(lru) == 0


@pytest.mark.parametrize("spec, capacity", [("sim", None), ("sim:1", 1), ("sim:4096", 4096)])
def test_a_sim_spec_opens_a_simulated_store_of_the_capacity_it_names(spec, capacity):
    store = open_store(spec)
    assert isinstance(store, SimStore) and store.capacity_tokens == capacity
    assert parse_store_spec(spec) == ("sim", spec[4:])
