"""Host-side ownership of KV pages: a free list, with each page's reference count in its block
record (kv/blocks.py)."""

from __future__ import annotations

from aither_jax.kv.blocks import BlockTable
from models.kv_cache import NULL_PAGE


class OutOfPagesError(RuntimeError):
    """Not enough free pages for a request."""


class PageAllocator:
    """Hands out page ids 1..num_pages-1 (page 0 is the null page) and takes them back.

    Pages carry reference counts so a page can be shared (prefix caching); it returns to the
    free list when its last reference is released, and its block record is cleared.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2, got {num_pages}")
        self.num_pages = num_pages
        self.blocks = BlockTable(num_pages)
        self._free = [p for p in range(num_pages - 1, 0, -1) if p != NULL_PAGE]  # pop() yields low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, {len(self._free)} free of {self.num_pages - 1}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.blocks[p].refs = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds a reference to pages already in use."""
        for p in pages:
            if self.blocks[p].refs <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.blocks[p].refs += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each page; pages with none left become free."""
        for p in pages:
            block = self.blocks[p]
            if p == NULL_PAGE or block.refs <= 0:
                raise ValueError(f"page {p} is not allocated")
            block.refs -= 1
            if block.refs == 0:
                block.forget()
                self._free.append(p)

    def resize(self, num_pages: int) -> None:
        """Grows the pool to `num_pages` pages (the new ids are handed out after the free ones
        below them) or shrinks it; a shrink needs every page from `num_pages` up free.

        Raises:
            ValueError: `num_pages` < 2, or a page that would go is in use.
        """
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2, got {num_pages}")
        if num_pages < self.num_pages:
            held = [p for p in range(num_pages, self.num_pages) if self.blocks[p].refs > 0]
            if held:
                raise ValueError(f"cannot shrink the pool to {num_pages} pages: page {held[-1]} is in use")
            self._free = [p for p in self._free if p < num_pages]
        else:
            self._free[:0] = range(num_pages - 1, self.num_pages - 1, -1)  # pop() takes them last
        self.blocks.resize(num_pages)
        self.num_pages = num_pages

    def ref_count(self, page: int) -> int:
        return self.blocks[page].refs
