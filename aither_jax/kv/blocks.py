"""The block table: one record per KV page, holding everything the host knows about it.

A page (a "block" of `page_size` token positions, stored contiguously across layers) is owned
by reference counts (the sequences that hold it, the prefix cache, pins); the prefix cache
names it; the eviction policy ranks it by its access history. All of that lives in the page's
`Block`, so a policy, a metric or a tier mover reads one record instead of seven containers.
The fields after `hits` are for the eviction advisor and the context pipeline, which fill them.
"""

from __future__ import annotations

import dataclasses
import enum
import time


class Tier(enum.IntEnum):
    """Where a page's bytes are: the device pool (hot), host memory (warm), disk (cold)."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclasses.dataclass(eq=False)
class Block:
    """What the host knows about one KV page."""

    page: int  # the page id in its tier's pool
    tier: Tier = Tier.DEVICE
    refs: int = 0  # references: sequences holding it, the prefix cache's own, pins
    name: bytes | None = None  # a cached full page's chain name (prefix_cache.page_hash)
    parent: bytes | None = None  # the previous page's name (None for a chain's first page)
    partial: tuple[int, ...] | None = None  # a cached partial page's tokens (named by `parent`)
    pins: int = 0
    last_access: int = 0  # the block table's clock at the latest lookup or insert
    touched_at: float = 0.0  # time.monotonic() at the latest lookup or insert
    created_at: float = 0.0  # time.monotonic() when the prefix cache named it
    hits: int = 0  # prefix-cache lookups that found it
    # Filled by the context pipeline and the eviction advisor (0 / None until then).
    source_tag: str | None = None  # the prompt section or message role whose tokens fill it
    importance: float | None = None  # 0-1
    tenant: bytes | None = None
    token_range: tuple[int, int] | None = None  # [start, stop) positions in its first sequence
    attention_mass: float = 0.0  # a moving average of the softmax mass steps put on it
    attended_at: float = 0.0  # time.monotonic() when a step last put mass on it
    used_at: float = 0.0  # time.monotonic() when a request last held it (admitted on it or named it)
    reuse_interval: float = 0.0  # moving average of the idle seconds between its uses (0: unknown)

    @property
    def cached(self) -> bool:
        """Whether the prefix cache names this page (full or partial)."""
        return self.name is not None or self.partial is not None

    def metadata(self) -> dict:
        """What travels with the page's bytes to the host and disk tiers (JSON-friendly)."""
        token_range = None if self.token_range is None else list(self.token_range)
        return {
            "tag": self.source_tag, "importance": self.importance, "token_range": token_range, "hits": self.hits,
            "reuse_interval": self.reuse_interval,
        }  # fmt: skip

    def restore(self, meta: dict | None) -> None:
        """Takes back `metadata()` when the page returns to the device."""
        if not meta:
            return
        self.source_tag, self.importance = meta.get("tag"), meta.get("importance")
        token_range = meta.get("token_range")
        self.token_range = None if token_range is None else tuple(token_range)
        self.hits = int(meta.get("hits") or 0)
        self.reuse_interval = float(meta.get("reuse_interval") or 0.0)

    def forget(self) -> None:
        """Clears what the prefix cache and the policies knew (the page is free again)."""
        self.name = self.parent = self.partial = None
        self.pins = self.hits = 0
        self.source_tag = self.importance = self.tenant = self.token_range = None
        self.attention_mass = self.attended_at = self.created_at = self.used_at = self.reuse_interval = 0.0


class BlockTable:
    """One `Block` per page of a tier's pool (page 0 is the null page), and a logical clock that
    orders accesses."""

    def __init__(self, num_pages: int, tier: Tier = Tier.DEVICE):
        self.tier = tier
        self.blocks = [Block(p, tier) for p in range(num_pages)]
        self._clock = 0

    def __getitem__(self, page: int) -> Block:
        return self.blocks[page]

    def __len__(self) -> int:
        return len(self.blocks)

    def resize(self, num_pages: int) -> None:
        """Adds empty records for new pages, or drops the records past `num_pages` (the caller
        has made sure those pages are free)."""
        if num_pages < len(self.blocks):
            del self.blocks[num_pages:]
        else:
            self.blocks += [Block(p, self.tier) for p in range(len(self.blocks), num_pages)]

    def touch(self, page: int) -> None:
        """Marks `page` as the most recently accessed."""
        self._clock += 1
        block = self.blocks[page]
        block.last_access = self._clock
        block.touched_at = time.monotonic()
