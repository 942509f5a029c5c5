"""The storage tier's small parts at their edges: a page value with an empty payload, the LRU's count of what it
holds as pages leave, the simulated store a spec names with its capacity, page keys, hit counts and the largest
segment."""

import pytest

from kvmem.page_hash import page_digests, storage_key
from kvmem.storage import FileStore, SimStore, open_store, parse_store_spec
from kvmem.storage.lru import PageLRU
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES, encode_page, fingerprint, is_intact
from kvmem.tiers import HostSlotPool


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


@pytest.mark.parametrize("key", ["AB" * 32, "ab" * 31 + " a", "0x" + "ab" * 31])
def test_a_page_key_is_64_lowercase_hex_digits_and_nothing_bytes_fromhex_would_also_take(key, tmp_path):
    store = FileStore(tmp_path)
    with pytest.raises(ValueError, match="^keys must hold page keys"):
        store.batch_exists([key])
    with pytest.raises(ValueError, match="^keys must hold page keys"):
        store.batch_exists(["ab" * 32, key])


def test_a_stores_hits_add_up_over_its_reads(tmp_path):
    pool = HostSlotPool(64, 4)
    slots = pool.allocator.alloc(8)
    keys = [storage_key(d) for d in page_digests(list(range(8)), 4)]
    store = FileStore(tmp_path)
    assert store.batch_set(keys, pool, slots) == 2
    assert store.batch_get(keys, pool, slots) == 2 and store.batch_get(keys[:1], pool, slots[:4]) == 1
    assert store.stats.hits == 3


def test_a_segment_may_be_as_large_as_a_location_can_address_and_no_larger(tmp_path):
    assert FileStore(tmp_path, segment_bytes=1 << 39).segment_bytes == 1 << 39
    with pytest.raises(ValueError, match="^segment_bytes must be"):
        FileStore(tmp_path, segment_bytes=(1 << 39) + 1)
