"""PageAllocator: page 0 is never handed out; reference counts; clear errors."""

from __future__ import annotations

import pytest

from aither_jax.kv.allocator import OutOfPagesError, PageAllocator


def test_allocate_free_roundtrip_never_gives_null_page():
    alloc = PageAllocator(9)
    pages = alloc.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    assert alloc.num_free == 0 and not alloc.can_allocate(1)
    with pytest.raises(OutOfPagesError, match="need 1 KV pages, 0 free of 8"):
        alloc.allocate(1)
    alloc.free(pages[:3])
    assert alloc.num_free == 3 and alloc.num_used == 5
    assert sorted(alloc.allocate(3)) == sorted(pages[:3])


def test_shared_pages_free_on_last_reference():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.share(pages)
    alloc.free(pages)
    assert alloc.num_free == 1 and alloc.ref_count(pages[0]) == 1
    alloc.free(pages)
    assert alloc.num_free == 3


@pytest.mark.parametrize("action", ["double_free", "free_null", "share_free"])
def test_misuse_raises(action):
    alloc = PageAllocator(4)
    (page,) = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError, match="not allocated"):
        if action == "double_free":
            alloc.free([page])
        elif action == "free_null":
            alloc.free([0])
        else:
            alloc.share([page])


def test_too_small_pool_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        PageAllocator(1)


def test_resize_grows_behind_the_free_pages_and_shrinks_only_free_ones():
    alloc = PageAllocator(6)
    held = alloc.allocate(2)  # pages 1, 2
    alloc.resize(9)
    assert alloc.num_pages == len(alloc.blocks) == 9 and alloc.num_free == 6
    assert alloc.allocate(3) == [3, 4, 5]  # the old free pages first, then the new ones
    assert alloc.allocate(3) == [6, 7, 8]
    alloc.free([6, 7, 8])
    with pytest.raises(ValueError, match="page 5 is in use"):
        alloc.resize(4)  # pages 4 and 5 still held
    alloc.free([3, 4, 5])
    alloc.resize(4)
    assert alloc.num_pages == len(alloc.blocks) == 4 and alloc.num_free == 1
    assert alloc.allocate(1) == [3] and not alloc.can_allocate(1)
    assert [alloc.ref_count(p) for p in held] == [1, 1]
    with pytest.raises(ValueError, match="at least 2"):
        alloc.resize(1)
