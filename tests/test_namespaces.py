"""Namespaces: requests of different tenants (or LoRAs, or models) never share KV, in any tier, so a tenant
cannot learn from a hit (or from its timing) that another one sent a prompt."""

import pytest

from kvmem import HiRadixCache, RadixCache, Req, ReqToTokenPool, Scheduler, TokenAllocator
from kvmem.page_hash import page_digests
from kvmem.tiers import HostSlotPool

PROMPT = list(range(100, 164))


def make_scheduler(tiered):
    alloc, rows = TokenAllocator(512), ReqToTokenPool(8, 256)
    tree = HiRadixCache(rows, alloc, HostSlotPool(2048)) if tiered else RadixCache(rows, alloc)
    return Scheduler(rows, alloc, tree)


def serve(sched, rid, prompt, namespace):
    req = Req(rid, prompt, 2, namespace=namespace)
    sched.add_request(req)
    hit = None
    while not sched.is_idle():
        batch = sched.step()
        if hit is None and req in batch.reqs:
            hit = req.prefix_indices.numel()
        sched.process_batch_result(batch, [7] * batch.batch_size())
        sched.check_invariants()
    return hit


@pytest.mark.parametrize("tiered", [False, True])
def test_a_prompt_cached_for_one_tenant_is_a_miss_for_another(tiered):
    sched = make_scheduler(tiered)
    assert serve(sched, "a1", PROMPT, "tenant-a") == 0
    assert serve(sched, "a2", PROMPT + [1], "tenant-a") == len(PROMPT)   # the same tenant hits
    assert serve(sched, "b1", PROMPT + [1], "tenant-b") == 0             # another tenant does not
    assert serve(sched, "n1", PROMPT + [1], None) == 0                   # nor the default namespace
    assert sched.tree_cache.prefix_len(PROMPT, "tenant-c") == 0


def test_a_host_copy_is_a_miss_for_another_tenant():
    sched = make_scheduler(tiered=True)
    tree = sched.tree_cache
    serve(sched, "a1", PROMPT, "tenant-a")
    tree.evict(tree.evictable_size())                   # now only the host holds tenant-a's prompt
    assert tree.match_prefix(PROMPT, "tenant-a").host_hit_length > 0
    m = tree.match_prefix(PROMPT, "tenant-b")
    assert (m.indices.numel(), m.host_hit_length) == (0, 0)


def test_page_names_differ_across_namespaces_for_equal_tokens():
    names = {ns: page_digests(PROMPT, 16, namespace=ns) for ns in (None, "", "tenant-a", "tenant-b")}
    flat = [d for digests in names.values() for d in digests]
    assert len(set(flat)) == len(flat)  # no page name is shared: a store can never hand one tenant's page to another


def test_a_namespace_must_be_a_string():
    with pytest.raises(TypeError, match="namespace"):
        Req("a", PROMPT, 1, namespace=7)
    with pytest.raises(TypeError, match="namespace"):
        RadixCache(ReqToTokenPool(1, 8), TokenAllocator(8)).match_prefix([1, 2], namespace=b"x")
