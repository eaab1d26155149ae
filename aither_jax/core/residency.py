"""Between steps, what the KV tiers move ahead of need (kv/tiers.py): idle cached pages demoted
while the device pool is above the high watermark, and, while it is below the low one, the
lower-tier pages of requests waiting for a slot promoted (their disk reads started in the
background first) along with the eviction advisor's spilled neighbours of pages promoted at
admission. Pages promoted ahead become idle cached device pages, so an admission finds them
on the device."""

from __future__ import annotations

from aither_jax.core.scheduler import Scheduler
from aither_jax.kv.prefix_cache import hash_chain


class Residency:
    """The tiers' watermarks over one scheduler's device pool."""

    MAX_NEIGHBOURS = 8  # spilled neighbours promoted after one step's promotions

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    @property
    def tiers(self):
        cache = self.scheduler.prefix_cache
        return cache.tiers if cache is not None else None

    def relieve_pressure(self) -> int:
        """Demotes idle cached pages while more of the device pool than the tiers' high
        watermark is in use; returns the pages demoted."""
        sched, tiers = self.scheduler, self.tiers
        if tiers is None:
            return 0
        over = sched.allocator.num_used - int(tiers.high_watermark * sched.num_usable_pages)
        return sched.prefix_cache.evict(over) if over > 0 else 0

    def _room(self) -> int:
        """Pages that may be promoted ahead: up to the low watermark (all of them free pages)."""
        sched = self.scheduler
        return max(int(self.tiers.low_watermark * sched.num_usable_pages) - sched.allocator.num_used, 0)

    def prefetch(self, depth: int = 4) -> int:
        """For the first `depth` requests waiting for a slot: starts reading their prompts'
        disk pages in the background and, below the low watermark, promotes their lower-tier
        pages (after the advisor's neighbours of pages just promoted), every lower run of a
        chain in order, up to the room there is. Returns the pages promoted."""
        sched, tiers = self.scheduler, self.tiers
        if tiers is None:
            return 0
        done = self._prefetch_neighbours() if sched.promoted else 0
        for seq in list(sched.waiting)[:depth]:
            names = hash_chain(seq.salt, seq.token_slice(0, seq.num_tokens - 1), sched.page_size)
            runs = self._lower_runs(names)
            for run, _ in runs:
                tiers.stage(run)
            for run, parent in runs:
                room = self._room()
                if not room or not tiers.should_reload(run[:room], len(run[:room]) * sched.page_size, count=False):
                    break
                promoted = self._promote(run[:room], parent)
                done += promoted
                if promoted < len(run):  # out of room, or a page that could not be read back
                    break
        return done

    def _lower_runs(self, names: list[bytes]) -> list[tuple[list[bytes], bytes | None]]:
        """The runs of a chain held below the device (`PrefixCache.runs`), in chain order, each
        with the name before it (None at the chain's start)."""
        out, hit = [], 0
        for run, on_device in self.scheduler.prefix_cache.runs(names):
            if not on_device:
                out.append((run, names[hit - 1] if hit else None))
            hit += len(run)
        return out

    def _promote(self, run: list[bytes], parent: bytes | None) -> int:
        """Promotes a lower-tier run of one chain into fresh pages the cache alone holds."""
        sched = self.scheduler
        pages = sched.allocator.allocate(len(run))
        n = sched.prefix_cache.promote(run, pages, parent, hit=False)  # a hit once admitted on them (`used`)
        sched.allocator.free(pages)  # the cache's own reference keeps the filled pages
        self.tiers.counters.num_prefetched += n
        return n

    def _prefetch_neighbours(self) -> int:
        """The eviction advisor's prefetch: the graph neighbours of the pages promoted since the
        last call that are held below the device and reachable (their chain parent is on the
        device, or they start a chain), highest edge weight + 2 importance first."""
        sched, tiers = self.scheduler, self.tiers
        promoted, sched.promoted = sched.promoted, []
        cache, ranked = sched.prefix_cache, {}
        for name in promoted:
            for other, _, weight in sched.policy.graph.neighbours(name):
                if cache.contains(other) or not tiers.holds(other):
                    continue
                parent = tiers.parent(other)
                if parent is not None and not cache.contains(parent):
                    continue
                importance = (tiers.meta(other) or {}).get("importance") or 0.0
                ranked[other] = max(ranked.get(other, 0.0), weight + 2 * importance)
        done = 0
        for name in sorted(ranked, key=ranked.get, reverse=True)[: self.MAX_NEIGHBOURS]:
            if self._room() and not cache.contains(name) and tiers.holds(name):  # not up with an earlier one
                done += self._promote([name], tiers.parent(name))
        return done
