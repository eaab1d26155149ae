"""The block table (one record per page), the eviction-policy interface and the page store."""

from __future__ import annotations

import numpy as np
import pytest

from aither_jax.compile.shapes import ShapeRegistry
from aither_jax.eviction.policy import LRUPolicy, make_policy
from aither_jax.kv.allocator import PageAllocator
from aither_jax.kv.blocks import Tier
from aither_jax.kv.prefix_cache import PrefixCache, hash_chain
from aither_jax.kv.store import PageStore
from models.config import ModelConfig
from models.kv_cache import init_cache

PAGE = 4
SALT = b"tenant"


def cached_chain(cache: PrefixCache, tokens: list[int]) -> tuple[list[bytes], list[int]]:
    names = hash_chain(SALT, tokens, PAGE)
    pages = cache.allocator.allocate(len(names))
    for i, (name, page) in enumerate(zip(names, pages, strict=True)):
        cache.insert(name, page, names[i - 1] if i else None)
    cache.allocator.free(pages)
    return names, pages


def test_a_pages_record_holds_what_the_cache_and_allocator_know_of_it():
    cache = PrefixCache(PageAllocator(9), PAGE, max_pinned_pages=4, policy=LRUPolicy())
    names, pages = cached_chain(cache, list(range(12)))
    blocks = [cache.blocks[p] for p in pages]
    assert [b.name for b in blocks] == names
    assert [b.parent for b in blocks] == [None, *names[:-1]]
    assert [b.refs for b in blocks] == [1, 1, 1] and all(b.tier is Tier.DEVICE for b in blocks)
    assert cache.match(names[:2]) == pages[:2]
    assert cache.match(names[:2]) == pages[:2]  # a request waiting for room looks up again
    assert [b.hits for b in blocks] == [0, 0, 0]  # hits count admissions, not lookups
    cache.used(pages[:2], names[:2])
    assert [b.hits for b in blocks] == [1, 1, 0]
    # A lookup touches a chain from its end to its start: parents end up most recent.
    assert blocks[0].last_access > blocks[1].last_access > blocks[2].last_access
    assert cache.pin(names[:1]) == 1 and blocks[0].pins == 1 and blocks[0].refs == 2
    partial = cache.allocator.allocate(1)[0]
    assert cache.insert_partial(names[-1], [7, 8], partial)
    assert cache.blocks[partial].partial == (7, 8) and cache.blocks[partial].parent == names[-1]
    # Evicting forgets everything the record held; the pinned page stays.
    cache.allocator.free([partial])
    assert cache.evict(10) == 3
    assert all(not b.cached and b.refs == 0 and b.hits == 0 for b in blocks[1:]) and not cache.blocks[partial].cached
    assert blocks[0].name == names[0] and blocks[0].pins == 1


class NewestFirst(LRUPolicy):
    """A policy that is not LRU: the most recently touched idle page goes first."""

    name = "newest"

    def victims(self, candidates, n):
        return sorted(candidates, key=lambda b: -b.last_access)[:n]


@pytest.mark.parametrize(("policy", "survivor"), [(LRUPolicy(), 0), (NewestFirst(), 2)])
def test_eviction_takes_the_victims_the_policy_ranks_first(policy, survivor):
    cache = PrefixCache(PageAllocator(9), PAGE, max_pinned_pages=0, policy=policy)
    names, pages = cached_chain(cache, list(range(12)))
    assert cache.evict(2) == 2
    # LRU drops the chain from its end (its first page was touched last); newest-first the start.
    assert [cache.contains(n) for n in names] == [i == survivor for i in range(3)]


def test_policies_are_found_by_name():
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        make_policy("graph")


class FakeDraft:
    """Stands in for a DFlash proposer's context pools (the same page ids, another layout)."""

    def __init__(self, num_pages: int):
        self.pool = np.arange(num_pages) * 10

    def copy_pages(self, src, dst):
        self.pool[dst] = self.pool[src]


def test_the_store_copies_a_page_in_every_pool():
    cfg = ModelConfig(
        "llama", num_layers=1, hidden_size=8, ffn_size=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=32,
        max_context=64,
    )  # fmt: skip
    cache = init_cache(cfg, num_pages=6, max_seqs=1, max_pages_per_seq=4, page_size=PAGE, kv_cache_dtype="fp32")
    k = np.asarray(cache.k[0]).copy()
    k[3] = 1.5
    cache = cache.replace(k=[k])
    draft, shapes = FakeDraft(6), ShapeRegistry()
    store = PageStore(cache, drafter=draft, shapes=shapes, num_usable_pages=5)
    store.copy([(3, 5)])
    assert np.all(np.asarray(store.cache.k[0])[5] == 1.5) and np.all(np.asarray(store.cache.k[0])[4] == 0)
    assert draft.pool[5] == 30 and draft.pool[4] == 40
    assert shapes.records() == [{"kind": "copy", "pages": 4}]  # padded to the copy bucket
