"""The device-side page store: every pool that shares page ids, changed together.

The target's paged KV cache and, with a DFlash draft, the draft's context pools are indexed by
the same page ids but laid out differently. A page copy (prefix caching's copy on write) or a
move between tiers applies to all of them in one call, so no caller repeats a page operation
per pool. Only the device tier exists so far: a plan that moves pages to or from another tier
is refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from aither_jax.compile.buckets import bucket
from aither_jax.compile.shapes import ShapeRegistry
from aither_jax.device.steps import copy_pages
from aither_jax.kv.blocks import Tier
from models.kv_cache import PagedKVCache


@dataclasses.dataclass(frozen=True)
class PageMove:
    """A page's bytes going from one tier to another (its id in each tier's pool)."""

    src_tier: Tier
    src_page: int
    dst_tier: Tier
    dst_page: int


class PageStore:
    """Owns the device pools that share page ids: `cache` (the target's) and the draft's, kept
    by its proposer (`DFlashProposer.copy_pages`)."""

    def __init__(self, cache: PagedKVCache, *, drafter=None, shapes: ShapeRegistry, num_usable_pages: int):
        self.cache = cache
        self.drafter = drafter
        self.shapes = shapes
        self.num_usable_pages = num_usable_pages
        self.tiers = (Tier.DEVICE,)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copies (source page, destination page) pairs in every pool, in one padded call each."""
        if not copies:
            return
        n = bucket(len(copies), 4, max(4, self.num_usable_pages + 1))
        self.shapes.note("copy", warmed=False, pages=n)
        src = np.zeros(n, np.int32)  # padding copies the null page onto itself
        dst = np.zeros(n, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.cache = copy_pages(self.cache, src, dst)
        if self.drafter is not None:
            self.drafter.copy_pages(src, dst)

    def move(self, moves: list[PageMove]) -> None:
        """Moves pages between tiers; refuses a tier this store does not hold (with the device
        tier alone, every move), and a move within one tier (that is a copy)."""
        for m in moves:
            if m.src_tier == m.dst_tier:
                raise ValueError(f"page move {m}: source and destination are both {m.src_tier.name.lower()}")
            missing = [t.name.lower() for t in (m.src_tier, m.dst_tier) if t not in self.tiers]
            if missing:
                raise ValueError(f"page move {m}: this store holds no {' or '.join(missing)} tier")

    def lower_copy(self, num_pages: int):
        """The copy call of `num_pages` pages lowered on padding inputs (for precompiling)."""
        zeros = np.zeros(num_pages, np.int32)
        return copy_pages.lower(self.cache, zeros, zeros)
