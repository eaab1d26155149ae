"""Prefix caching: KV pages named by a SHA-256 chain over their tokens, salted per tenant.

A full page's name is SHA-256(parent name || its token ids); the first page's parent is the
tenant's salt, so two tenants sending the same prompt never share (or time) each other's
pages. The cache keeps one reference of its own on every page it names, so a named page
outlives the sequence that computed it; a page whose only reference is the cache's is idle and
may be evicted, in the order the eviction policy ranks them (the graph eviction advisor by
default, or least recently used first; aither_jax/eviction/policy.py). A pin is one more
reference: pinned pages are never idle. A sequence's last, partially filled page can be
kept too (named by its parent and its tokens); it is never written by anyone else, so whoever
adopts it gets a copy (copy on write).
With lower tiers (kv/tiers.py), an evicted full page is demoted to host or disk instead of
dropped, and a lookup continues past the device's pages into them (`match_lower`, `promote`).
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from aither_jax.kv.allocator import PageAllocator
from aither_jax.kv.blocks import Block


def tenant_salt(secret: bytes, tenant: str) -> bytes:
    """The root of a tenant's hash chains, derived on the server from a process secret."""
    return hashlib.sha256(secret + b"\x00tenant\x00" + tenant.encode("utf-8", "surrogatepass")).digest()


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def hash_chain(salt: bytes, tokens: Sequence[int], page_size: int, parent: bytes | None = None) -> list[bytes]:
    """Names of the full pages of `tokens` (continuing from `parent` when given)."""
    names, last = [], salt if parent is None else parent
    for i in range(len(tokens) // page_size):
        last = page_hash(last, tokens[i * page_size : (i + 1) * page_size])
        names.append(last)
    return names


class EvictionPolicy(Protocol):
    """Which idle pages go first when pages must be freed (implementations:
    aither_jax/eviction/policy.py)."""

    name: str
    protects: bool  # whether some idle pages are never victims (num_evictable < candidates)

    def victims(self, candidates: Sequence[Block], n: int) -> list[Block]:
        """Up to `n` of the idle `candidates`, the first to evict first (a policy may keep
        some candidates, protected ones, out of every answer)."""
        ...

    def num_evictable(self, candidates: Sequence[Block]) -> int:
        """How many of the idle `candidates` `victims` could ever return."""
        ...

    def demoted(self, blocks: Sequence[Block], resident: Callable[[bytes], bool]) -> None:
        """`blocks` are leaving the device for a lower tier (`resident`: whether a page name
        stays on the device)."""
        ...

    def forgotten(self, names: Sequence[bytes]) -> None:
        """The pages of `names` are gone: dropped from the device with no lower tier to go
        to, or from the lowest tier holding them."""
        ...

    def attended(self, rows: Sequence[Sequence[tuple[Block, float]]]) -> None:
        """One step's attention mass: per row, (page record, mass) of each page it holds."""
        ...

    def reused(self, gap: float | None, returning: bool = True) -> None:
        """A request was admitted (once per admission): the deepest page of its chain used
        before was last used `gap` seconds ago (None: unknown, or no page was), and it continues
        a conversation (`returning`) rather than starting one under a shared prompt."""
        ...

    def protected(self, block: Block) -> bool:
        """Whether the policy never evicts this page while it is idle (within its cap)."""
        ...


class PrefixCache:
    """Maps page names to page ids; owns one allocator reference per named page. What it knows
    of each page (name, parent, pins, accesses) is in the page's block record."""

    def __init__(self, allocator: PageAllocator, page_size: int, *, max_pinned_pages: int, policy: EvictionPolicy):
        self.allocator = allocator
        self.blocks = allocator.blocks
        self.page_size = page_size
        self.max_pinned_pages = max_pinned_pages
        self.policy = policy
        self._full: dict[bytes, int] = {}  # name -> page
        self._partial: dict[bytes, dict[tuple[int, ...], int]] = {}  # parent name -> tokens -> page
        self._branches: collections.Counter[bytes] = collections.Counter()  # name -> full pages continuing it
        # names of shared prompts: pages two cached chains continued at once, or protected pages
        # that left the device (most recent last, bounded like the ghosts)
        self._shared: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._cached: set[int] = set()  # pages named here (full or partial): the blocks to scan
        self.tiers = None  # KVTiers below the device, if any (set by the engine)
        self.clock = time.monotonic  # the time of a page's uses (`Block.used_at`)
        # names of pages that left the device -> their last use: a request that would have
        # reused one still tells the policy how long the page sat idle before it was wanted
        self._ghosts: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    # -- lookups ------------------------------------------------------------------------------

    def match(self, names: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached run of `names` from the start (not yet referenced)."""
        pages = []
        for name in names:
            page = self._full.get(name)
            if page is None:
                break
            pages.append(page)
        for page in reversed(pages):  # parents end up more recent than children: evicted later
            self.blocks.touch(page)
        return pages

    def match_partial(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(page, n): the cached partial page under `parent` holding the longest prefix of
        `tokens` shorter than all of them (one token must be left to compute), or None."""
        best = None
        for stored, page in self._partial.get(parent, {}).items():
            n = len(stored)
            if n < len(tokens) and tuple(tokens[:n]) == stored and (best is None or n > best[1]):
                best = (page, n)
        if best is not None:
            self.blocks.touch(best[0])
        return best

    REUSE_SMOOTHING = 0.5  # weight of the newest idle gap in a page's `reuse_interval`
    GHOSTS_PER_PAGE = 4  # names of pages gone from the device remembered, per page of the pool

    def used(self, pages: Sequence[int], names: Sequence[bytes] = (), *, admission: bool = True) -> None:
        """A request was admitted on the cached device `pages`, for the chain `names`: each
        page's idle gap since its last use (`Block.used_at`) joins its moving `reuse_interval`,
        the advisor's estimate of when the page will be wanted again. The request's own gap,
        at the deepest page of its chain used before (on the device, or remembered by name
        after it left), goes to the policy (`reused`): the gap after which a conversation
        comes back, or a prompt's prefix is asked for again. Each page counts a hit. Called
        once per admission (a lookup can repeat while a request waits, so `match` neither
        measures gaps nor counts hits); `admission=False` for pages a running request takes
        later (bounded residency's `_load_cached`): their hits and gaps only."""
        now, a, last = self.clock(), self.REUSE_SMOOTHING, {}
        for page in pages:
            block = self.blocks[page]
            block.hits += 1
            if block.used_at > 0.0:
                gap = max(now - block.used_at, 0.0)
                block.reuse_interval = gap if block.reuse_interval <= 0.0 else (1 - a) * block.reuse_interval + a * gap
                if block.name is not None:
                    last[block.name] = (gap, block)
            block.used_at = now
        if not admission:
            return
        # The deepest page reused tells a conversation coming back (its chain's end, or a page
        # it diverges at) from a new one under a shared prompt (a page two chains continued, a
        # protected page).
        for name in reversed(names):
            if name in last:
                gap, block = last[name]
            elif name in self._ghosts:
                gap, block = max(now - self._ghosts[name], 0.0), None
            elif self.tiers is not None and self.tiers.holds(name):  # on disk from an earlier process
                gap, block = None, None
            else:
                continue
            shared = name in self._shared or (block is not None and self.policy.protected(block))
            self.policy.reused(gap, returning=not shared)
            return
        self.policy.reused(None, returning=False)

    def contains(self, name: bytes) -> bool:
        return name in self._full

    def runs(self, names: Sequence[bytes]) -> list[tuple[list[bytes], bool]]:
        """The leading cached part of the chain `names`, as runs (names, on the device?) in
        chain order: device and lower-tier runs by turns (a resized pool demotes pages wherever
        they sit in a chain). Device pages are not touched (`match` does that)."""
        runs, hit = [], 0
        while hit < len(names):
            start = hit
            while hit < len(names) and names[hit] in self._full:
                hit += 1
            if hit > start:
                runs.append((list(names[start:hit]), True))
            lower = self.match_lower(names[hit:])
            if lower:
                runs.append((lower, False))
                hit += len(lower)
            if hit == start:
                break
        return runs

    def match_lower(self, names: Sequence[bytes]) -> list[bytes]:
        """The leading run of `names` held in a lower tier (host or disk), not on the device."""
        if self.tiers is None:
            return []
        run = []
        for name in names:
            if name in self._full or not self.tiers.holds(name):
                break
            run.append(name)
        self.tiers.touch(run)  # the most recently used below the device: kept while promoted
        return run

    def promote(self, names: Sequence[bytes], pages: Sequence[int], parent: bytes | None, *, hit: bool = True) -> int:
        """Fills fresh device `pages` (allocated by the caller) with the lower-tier pages
        `names` (`match_lower`'s run, following `parent`), and names them here; with `hit`
        (a request admitted on them) each counts a hit, which a prefetch leaves to the
        admission (`used`). Returns how many were filled; the caller frees the rest (a disk
        file that failed its checksum)."""
        n = self.tiers.promote(names, pages)
        for name, page in zip(names[:n], pages[:n], strict=True):
            self.insert(name, page, parent)
            self.blocks[page].restore(self.tiers.meta(name))  # its tag, importance, hits
            self.blocks[page].hits += int(hit)
            parent = name
        return n

    # -- registration -------------------------------------------------------------------------

    def insert(self, name: bytes, page: int, parent: bytes | None = None) -> bool:
        """Names a full page the caller computed (`parent`: the previous page's name, None for
        a first page); False if that name is already cached (the caller's copy then stays
        private). The page and its cached ancestors become the most recently used, parents
        last, so eviction takes a chain from its end and leaves a usable prefix."""
        if name in self._full or page in self._cached:
            return False
        self._ghosts.pop(name, None)
        self.allocator.share([page])
        self._full[name] = page
        self._cached.add(page)
        block = self.blocks[page]
        block.name, block.parent = name, parent
        if parent is not None:
            self._branches[parent] += 1
            if self._branches[parent] > 1:
                self._mark_shared(parent)
        self.blocks.touch(page)
        block.used_at = now = self.clock()
        while parent is not None and parent in self._full:
            ancestor = self._full[parent]
            self.blocks.touch(ancestor)
            self.blocks[ancestor].used_at = now
            parent = self.blocks[ancestor].parent
        return True

    def insert_partial(self, parent: bytes, tokens: Sequence[int], page: int) -> bool:
        tokens = tuple(int(t) for t in tokens)
        if not 0 < len(tokens) < self.page_size or page in self._cached:
            return False
        entries = self._partial.setdefault(parent, {})
        if tokens in entries:
            return False
        self.allocator.share([page])
        entries[tokens] = page
        self._cached.add(page)
        block = self.blocks[page]
        block.parent, block.partial = parent, tokens
        self.blocks.touch(page)
        block.used_at = self.clock()
        return True

    def persist(self) -> int:
        """Writes every named page, on the device or the host, to the disk tier (a clean
        shutdown); returns the pages written."""
        if self.tiers is None:
            return 0
        blocks = [self.blocks[p] for p in self._full.values()]
        return self.tiers.flush([(b.name, b.parent, b.page, b.metadata()) for b in blocks])

    # -- eviction -----------------------------------------------------------------------------

    def _idle(self, page: int) -> bool:
        return self.allocator.ref_count(page) == 1 and not self.blocks[page].pins

    def idle(self, page: int) -> bool:
        """Whether `page` is cached here and nothing else holds it (evicting it frees it)."""
        return page in self._cached and self._idle(page)

    def describe(self, name: bytes) -> dict:
        """What is known of a named page, wherever it is (for a debug dump)."""
        page = self._full.get(name)
        if page is None:
            on_host = self.tiers is not None and self.tiers.holds(name)
            return {"tier": "host_or_disk" if on_host else "gone"}
        b = self.blocks[page]
        return {
            "tier": "device", "page": page, "tag": b.source_tag, "importance": b.importance, "hits": b.hits,
            "pins": b.pins, "refs": b.refs, "token_range": b.token_range, "attention_mass": b.attention_mass,
        }  # fmt: skip

    def cached_blocks(self) -> list[Block]:
        """The records of every page named here (the advisor's ranking thread reads them)."""
        return [self.blocks[p] for p in list(self._cached)]

    def _idle_blocks(self) -> list[Block]:
        return [self.blocks[p] for p in self._cached if self._idle(p)]

    def num_evictable_taken(self, pages: Sequence[int]) -> int:
        """How many fewer pages could be evicted once `pages` (some cached) are held."""
        taken = {p for p in pages if p in self._cached and self._idle(p)}
        if not taken or not self.policy.protects:
            return len(taken)
        idle = self._idle_blocks()
        return self.policy.num_evictable(idle) - self.policy.num_evictable([b for b in idle if b.page not in taken])

    @property
    def num_evictable(self) -> int:
        return self.policy.num_evictable(self._idle_blocks())

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def evict(self, n: int) -> int:
        """Drops up to `n` idle pages, in the policy's order; returns how many."""
        if n <= 0:
            return 0
        return self._evict(self.policy.victims(self._idle_blocks(), n))

    def evict_pages(self, pages: Sequence[int]) -> int:
        """Drops those of `pages` that are cached and idle (unpinned, held by nothing else),
        whatever the policy would rank them, moving them to the tiers below as `evict` does;
        returns how many (a pool about to shrink gives back its top pages this way)."""
        return self._evict([self.blocks[p] for p in pages if self.idle(p)])

    def _evict(self, victims: list[Block]) -> int:
        if self.tiers is not None:
            demoted = [b for b in victims if b.partial is None]
            leaving = {b.page for b in victims}
            self.policy.demoted(demoted, lambda name: name in self._full and self._full[name] not in leaving)
            self.tiers.demote([(b.name, b.parent, b.page, b.metadata()) for b in demoted])
            lost = self.tiers.take_lost()  # the victims themselves included (a batch over the host pool)
            self.policy.forgotten([n for n in lost if n not in self._full or self._full[n] in leaving])
        else:
            self.policy.forgotten([b.name for b in victims if b.name is not None])
        for block in victims:
            if block.name is not None and block.used_at > 0.0:
                self._ghosts[block.name] = block.used_at
                self._ghosts.move_to_end(block.name)
            if block.name is not None and self.policy.protected(block):  # past the protected cap
                self._mark_shared(block.name)
            self._drop(block.page)
        self._trim(self._ghosts)
        return len(victims)

    def _mark_shared(self, name: bytes) -> None:
        self._shared[name] = None
        self._shared.move_to_end(name)
        self._trim(self._shared)

    def _trim(self, names: collections.OrderedDict) -> None:
        """Forgets the oldest of `names` past `GHOSTS_PER_PAGE` per page of the pool."""
        while len(names) > self.GHOSTS_PER_PAGE * self.allocator.num_pages:
            names.popitem(last=False)

    def clear(self) -> int:
        """Forgets every unpinned name; returns the pages dropped."""
        pages = [p for p in self._cached if not self.blocks[p].pins]
        for page in pages:
            self._drop(page)
        self._ghosts.clear()
        self._shared.clear()
        return len(pages)

    def _drop(self, page: int) -> None:
        """Forgets a page's name and gives back the cache's reference."""
        block = self.blocks[page]
        self._cached.discard(page)
        if block.partial is None:
            del self._full[block.name]
            if block.parent is not None:
                self._branches[block.parent] -= 1
                if not self._branches[block.parent]:
                    del self._branches[block.parent]
        else:
            entries = self._partial[block.parent]
            del entries[block.partial]
            if not entries:
                del self._partial[block.parent]
        block.forget()
        self.allocator.free([page])

    # -- pins ---------------------------------------------------------------------------------

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._cached if self.blocks[p].pins)

    def pin(self, names: Sequence[bytes]) -> int:
        """Pins the cached pages named `names` (a prefix's chain); stops at the first name not
        cached or when the pinned share is full. Returns the number of pages pinned by this
        call (pages already pinned count as pinned without taking more of the share)."""
        done, pinned = 0, self.num_pinned
        for name in names:
            page = self._full.get(name)
            if page is None:
                break
            block = self.blocks[page]
            if not block.pins:
                if pinned >= self.max_pinned_pages:
                    break
                self.allocator.share([page])
                pinned += 1
            block.pins += 1
            done += 1
        return done

    def num_pinned_of(self, names: Sequence[bytes]) -> int:
        """How many of the pages named `names` are cached and pinned."""
        return sum(1 for name in names if (page := self._full.get(name)) is not None and self.blocks[page].pins)

    def unpin(self, names: Sequence[bytes]) -> int:
        """Drops one pin from each named page; returns the pages unpinned."""
        done = 0
        for name in names:
            page = self._full.get(name)
            if page is None or not self.blocks[page].pins:
                continue
            self.blocks[page].pins -= 1
            if not self.blocks[page].pins:
                self.allocator.free([page])
            done += 1
        return done
