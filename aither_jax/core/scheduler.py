"""The scheduler: which sequences run in the next step, on which pages.

Sequences wait in arrival order and are admitted while a cache slot is free and the pages for
their uncomputed prompt fit. Each step runs every decoding sequence (one token each) and then
prefill chunks of the others within a token budget (chunked prefill interleaved with decode).
The prefill call pads its rows to power-of-two buckets of rows and tokens, and that padded
size is held within the budget too: five 50-token prompts would make an 8 x 64 call that
costs twice a 4 x 64 one, so the fifth waits for the next step.
Pages are taken as tokens need them; when none are left a running sequence is preempted (the
one the eviction policy names: the newest with LRU, the one whose pages matter least with the
advisor): its pages go back (the full ones stay in the prefix cache) and it waits to be
recomputed from its prompt and the tokens it already produced.

With prefix caching a sequence starts from the longest run of cached pages of its tokens (and a
copy of a cached partial page after it), and every page it fills is named and kept for later
requests. A waiting sequence whose next page is being computed right now by a running one waits
for it instead of computing it twice. With sink tokens (KV formats ending in -s<n>) the first n
keys/values also live unquantized in a per-slot buffer that cached pages do not carry, so a
sequence admitted on cached pages comes with a sink refill: its first tokens, which the engine
runs once more to fill that buffer.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np

from aither_jax.compile.buckets import bucket
from aither_jax.core.bounded import ResidencyError
from aither_jax.core.page_records import link_memories, tag_pages
from aither_jax.core.plan import StepPlan
from aither_jax.core.sequence import Sequence
from aither_jax.eviction.graph import EdgeType
from aither_jax.eviction.policy import make_policy
from aither_jax.kv.allocator import PageAllocator
from aither_jax.kv.prefix_cache import PrefixCache, hash_chain, page_hash
from models.kv_cache import NULL_PAGE

log = logging.getLogger(__name__)

MAX_PINNED_FRACTION = 0.5
MAX_PROTECTED_FRACTION = 0.25


@dataclasses.dataclass
class CachedRun:
    """Consecutive full pages of a prompt's chain found cached: on the device (`pages`) or
    held in a lower tier (`pages` None, to promote)."""

    names: list[bytes]
    pages: list[int] | None


def _first_pages(runs: list[CachedRun], partial, limit: int) -> tuple[list[CachedRun], object]:
    """The cached `runs` cut to their first `limit` pages, and the partial page after them
    (None once cut)."""
    out, left = [], limit
    for run in runs:
        if len(run.names) > left:
            if left:
                out.append(CachedRun(run.names[:left], None if run.pages is None else run.pages[:left]))
            return out, None
        out.append(run)
        left -= len(run.names)
    return out, partial


class Scheduler:
    """Owns the queues, the slots, the block tables and the pages of every sequence."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        max_prefill_chunk: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = False,
        max_pinned_fraction: float = MAX_PINNED_FRACTION,
        sink_tokens: int = 0,
        min_token_bucket: int = 1,
        eviction_policy: str | None = None,
        max_protected_fraction: float | None = None,
        advisor_weights: dict | str | None = None,
        max_resident_pages: int | None = None,
    ):
        """`eviction_policy`: "lru", "advisor", or None for the advisor with prefix caching.
        `max_protected_fraction`: the advisor's protected share of the pool; None is
        `MAX_PROTECTED_FRACTION`, lowered where it must be to leave one request at full length
        room beside the pinned and protected pages (a share given explicitly that leaves none
        is refused here). `max_resident_pages`: with bounded residency, the most device pages
        a request holds (its full length otherwise)."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs ({max_num_seqs})"
            )
        if eviction_policy is None:
            eviction_policy = "advisor" if enable_prefix_caching else "lru"
        self._protected_fits = max_protected_fraction is None  # the default share yields to one request
        if max_protected_fraction is None:
            max_protected_fraction = MAX_PROTECTED_FRACTION
        fractions = {"max_pinned_fraction": max_pinned_fraction, "max_protected_fraction": max_protected_fraction}
        for name, value in fractions.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        # The device pages one request may need at once: pinned and protected pages leave room for them.
        self.request_pages = min(max_pages_per_seq, max_resident_pages or max_pages_per_seq)
        self.fractions = fractions  # the pinned and protected caps, as shares of the pool
        self.sink_tokens = sink_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunk = max_prefill_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_token_bucket = min_token_bucket
        self.allocator = PageAllocator(num_pages)
        max_pinned, max_protected = self._caps(num_pages)
        self.policy = make_policy(eviction_policy, max_protected_pages=max_protected, weights=advisor_weights)
        self.prefix_cache = None
        if enable_prefix_caching:
            _, share, room = self._shares(num_pages)
            if self.policy.name == "advisor" and share > room and not self._protected_fits:
                # Pinned and protected pages together must leave room for one request.
                raise ValueError(
                    f"the eviction advisor may hold {share} protected and {max_pinned} pinned pages of "
                    f"{num_pages - 1}, leaving less than one request's {self.request_pages}: "
                    "lower max_protected_fraction or max_pinned_fraction, or give the pool more pages"
                )
            if self.policy.name == "advisor" and share > max(room, 0):  # the default share, lowered
                log.warning(
                    "the eviction advisor keeps at most %d idle protected pages (system prompts) of %d: more would "
                    "leave a request of %d pages short beside %d pinned ones; give the pool more pages or lower "
                    "max_pinned_fraction",
                    max_protected, num_pages - 1, self.request_pages, max_pinned,
                )  # fmt: skip
            self.prefix_cache = PrefixCache(self.allocator, page_size, max_pinned_pages=max_pinned, policy=self.policy)
        elif eviction_policy != "lru":
            raise ValueError(f"eviction policy {eviction_policy!r} needs prefix caching")
        self.block_tables = np.full((max_num_seqs, max_pages_per_seq), NULL_PAGE, np.int32)
        self.tables_dirty = False
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._computing: set[bytes] = set()  # names of pages that running prefills will fill
        self.promoted: list[bytes] = []  # pages promoted at admission, whose graph neighbours may follow (Residency)
        self.named: list[tuple[bytes, int]] = []  # (name, page) of pages named since the engine last took them
        self._owned_pins: dict[bytes, list[bytes]] = {}  # a pin owner's key -> the names it holds pinned
        self.lookahead = 0  # draft tokens a decoding row may carry (speculative decoding)
        self.bounded = None  # core/bounded.py: each sequence's device pages capped, the rest on the host
        # Counters (tokens unless named otherwise), read by the metrics.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_preemptions = 0

    # -- pages --------------------------------------------------------------------------------

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free_pages(self) -> int:
        """Pages a sequence could get now: free ones plus idle cached ones."""
        return self.allocator.num_free + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    @property
    def num_usable_pages(self) -> int:
        return self.allocator.num_pages - 1

    def resize_pool(self, num_pages: int) -> int:
        """Grows or shrinks the pool's page ids to `num_pages` (between steps; the device pools
        follow in `PageStore.resize`) and scales the pinned and protected caps with it. A shrink
        first drops the idle cached pages it cuts off (to the tiers below, if any) and stops at
        `min_pool_size` (above the highest page still held, and where an explicit protected share
        still leaves one request room). Returns the new page count.

        Raises:
            ValueError: fewer pages than one sequence of full length needs.
        """
        least = self.max_pages_per_seq + 1
        if num_pages < least:
            raise ValueError(
                f"a pool of {num_pages} pages is too small: one sequence of full length needs {least - 1} pages "
                "plus the null page"
            )
        old = self.allocator.num_pages
        if num_pages < old:
            num_pages = self._fitting(max(num_pages, self.min_pool_size()))
            if self.prefix_cache is not None:
                self.prefix_cache.evict_pages(range(num_pages, old))
        self.allocator.resize(num_pages)
        max_pinned, max_protected = self._caps(num_pages)
        if self.policy.protects:
            self.policy.max_protected_pages = max_protected
        if self.prefix_cache is not None:
            self.prefix_cache.max_pinned_pages = max_pinned
        return num_pages

    def min_pool_size(self) -> int:
        """The fewest pages `resize_pool` can shrink to now: one sequence of full length plus
        the null page, above the highest page a sequence or a pin holds (idle cached pages
        above it can go), and large enough that a protected share given explicitly still leaves
        one request room beside the pinned pages (the check the constructor makes)."""
        cache = self.prefix_cache
        top = next(
            (
                p for p in range(self.allocator.num_pages - 1, 0, -1)
                if self.allocator.ref_count(p) > 0 and not (cache is not None and cache.idle(p))
            ),
            0,
        )  # fmt: skip
        return max(top + 1, self._fitting(self.max_pages_per_seq + 1))

    def _fitting(self, num_pages: int) -> int:
        """The smallest pool of at least `num_pages` pages (and at most the pool's size now,
        which fits: the constructor checked it) where an explicit protected share leaves one
        request room. The shares round down, so fitting is not monotone in the size."""
        now = self.allocator.num_pages
        return next((n for n in range(num_pages, now) if self._share_fits(n)), max(num_pages, now))

    @property
    def _explicit_share(self) -> bool:
        """Whether pages are protected under a share given explicitly (which never yields)."""
        return not self._protected_fits and self.prefix_cache is not None and self.policy.protects

    def _share_fits(self, num_pages: int) -> bool:
        """Whether a pool of `num_pages` leaves one request room beside an explicit protected
        share and the pinned one (always, for the default share, which yields)."""
        _, protected, room = self._shares(num_pages)
        return not self._explicit_share or protected <= room

    def _shares(self, num_pages: int) -> tuple[int, int, int]:
        """(pinned, protected, room) of a pool of `num_pages` pages: the two shares of its usable
        pages, and the most protected pages that leave one request room beside the pinned ones
        (negative when the pinned share alone leaves none)."""
        usable = num_pages - 1
        pinned = int(self.fractions["max_pinned_fraction"] * usable)
        return pinned, int(self.fractions["max_protected_fraction"] * usable), usable - pinned - self.request_pages

    def _caps(self, num_pages: int) -> tuple[int, int]:
        """(pinned, protected) page caps of a pool of `num_pages` pages: their shares, the default
        protected share lowered to leave one request room (`_shares`)."""
        pinned, protected, room = self._shares(num_pages)
        return pinned, max(min(protected, room), 0) if self._protected_fits else protected

    def allocate(self, n: int) -> list[int]:
        """`n` free device pages, evicting idle cached pages if it must."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.allocate(n)

    def set_row(self, seq: Sequence) -> None:
        """Rewrites `seq`'s block-table row from its pages (uploaded before the next step)."""
        self.block_tables[seq.slot] = NULL_PAGE
        self.block_tables[seq.slot, : len(seq.pages)] = seq.pages
        self.tables_dirty = True

    def take_slot(self, seq: Sequence, num_pages: int) -> None:
        """Gives `seq` a slot and `num_pages` fresh pages (for callers outside the queues)."""
        seq.pages = self.allocate(num_pages)
        seq.slot = self._free_slots.pop()
        if self.bounded is not None:
            self.bounded.admit(seq)
        self.set_row(seq)

    def can_take_slot(self, num_pages: int) -> bool:
        return bool(self._free_slots) and num_pages <= self.num_free_pages

    def release(self, seq: Sequence) -> None:
        """Returns a sequence's slot and pages (named pages stay in the prefix cache)."""
        if seq.slot < 0:
            return
        if self.prefix_cache is not None and seq.finished and seq.num_cached % self.page_size:
            i = seq.num_cached // self.page_size
            parent = seq.names[i - 1] if i else seq.salt
            tokens = seq.token_slice(i * self.page_size, seq.num_cached)
            self.prefix_cache.insert_partial(parent, tokens, seq.page_at(i))
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.resident = None  # pages held on the host go with it
        self.block_tables[seq.slot] = NULL_PAGE
        self.tables_dirty = True
        self._free_slots.append(seq.slot)
        seq.slot = -1

    # -- queues -------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        seq.finish_reason = seq.finish_reason or "abort"
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> tuple[list[tuple[int, int]], list[tuple[Sequence, list[int]]]]:
        """Moves waiting sequences to running while slots and pages allow; returns page copies
        and sink refills."""
        copies, refills = [], []
        budget = self.num_free_pages
        deferred = []
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            runs, names, partial = self._lookup(seq)
            if self.bounded is not None:  # a longer hit would start over the bound: the rest comes later
                runs, partial = _first_pages(runs, partial, self.bounded.max_cached_pages)
            found = [n for run in runs if run.pages is None for n in run.names]  # held below the device
            # Reloading them also brings back the device pages after them: every token past the
            # first device run (`lead`) is saved.
            lead = 1 if runs and runs[0].pages is not None else 0
            saved = sum(len(run.names) for run in runs[lead:])
            if found and not self.prefix_cache.tiers.should_reload(found, saved * self.page_size, count=False):
                runs, partial = runs[:lead], None  # recomputing them is faster (kv/tiers.py, ReloadCost)
            hit = sum(len(run.names) for run in runs)
            if names and hit < len(names) and names[hit] in self._computing:
                deferred.append(seq)  # a running prefill is filling its next page right now
                continue
            num_cached = hit * self.page_size + (partial[1] if partial else 0)
            device = [p for run in runs if run.pages is not None for p in run.pages]
            # Cached pages that were idle stop counting as free once this sequence holds them.
            need = self.pages_needed(seq.num_tokens)
            if self.bounded is not None:
                need = self.bounded.pages_to_admit(need)
            need = max(need - len(device), 0)
            if self.prefix_cache is not None:  # idle pages it will hold (shared, or a copy source)
                need += self.prefix_cache.num_evictable_taken(device + ([partial[0]] if partial else []))
            if need > budget:
                self.waiting.appendleft(seq)
                break
            budget -= need
            if found:  # the cost model's decision is counted (and logged) once, at admission
                self.prefix_cache.tiers.should_reload(found, saved * self.page_size)
            cached = device
            if self.prefix_cache is not None:
                if seq.num_preemptions == 0:  # before promotion renames the lower-tier pages
                    self.prefix_cache.used(device + ([partial[0]] if partial else []), names)
                self.allocator.share(device)
                if partial:
                    self.allocator.share([partial[0]])  # held until the copy is made (copies_done)
                if len(device) < hit:  # pages held on host or disk come back instead of being recomputed
                    cached, num_cached, partial = self._promote(runs, num_cached, partial)
                if seq.num_preemptions == 0:
                    self.num_prefix_queries += len(seq.prompt_ids)
                    self.num_prefix_hits += num_cached
                    seq.num_cached_prompt = num_cached
            seq.pages = cached
            seq.names = names[: len(cached)]
            seq.fork = seq.names[-1] if seq.names else None
            seq.num_cached = num_cached
            if partial:
                (page,) = self.allocate(1)
                copies.append((partial[0], page))
                seq.pages = [*cached, page]
            seq.slot = self._free_slots.pop()
            if self.bounded is not None:
                self.bounded.admit(seq)
            self.set_row(seq)
            self.running.append(seq)
            self._computing.update(names[len(cached) :])  # later arrivals in this pass wait for these
            if self.sink_tokens and num_cached:
                refills.append((seq, seq.token_slice(0, min(self.sink_tokens, num_cached))))
        self.waiting.extendleft(reversed(deferred))
        return copies, refills

    def _lookup(self, seq: Sequence) -> tuple[list[CachedRun], list[bytes], tuple[int, int] | None]:
        """(the cached runs of full pages from the start, on the device or held in a lower tier
        by turns; the names of the full pages of everything but the last token; a cached partial
        page (page, tokens) to copy after the runs, or None). A chain can alternate: a resized
        pool demotes its pages above the cut, wherever they sit in a chain."""
        if self.prefix_cache is None:
            return [], [], None
        # The last token is never taken from the cache: its logits are needed to sample.
        tokens = seq.token_slice(0, seq.num_tokens - 1)
        names = hash_chain(seq.salt, tokens, self.page_size)
        cache = self.prefix_cache
        runs = [CachedRun(run, cache.match(run) if on_device else None) for run, on_device in cache.runs(names)]
        hit = sum(len(run.names) for run in runs)
        parent = names[hit - 1] if hit else seq.salt
        partial = self.prefix_cache.match_partial(parent, seq.token_slice(hit * self.page_size, seq.num_tokens))
        return runs, names, partial

    def _promote(self, runs: list[CachedRun], num_cached: int, partial) -> tuple[list[int], int, object]:
        """Device pages for the lower-tier runs among `runs`, filled from host or disk, the
        device runs' pages (already shared) between them; returns (the sequence's cached pages,
        its cached tokens, the partial page to copy after them). A page that cannot be read
        back ends the hit there: the pages after it and the partial page are given back."""
        pages, parent = [], None
        for i, run in enumerate(runs):
            if run.pages is not None:
                pages += run.pages
            else:
                filled = self._promote_run(run.names, parent)
                pages += filled
                if len(filled) < len(run.names):
                    self.allocator.free([p for later in runs[i + 1 :] if later.pages for p in later.pages])
                    if partial:
                        self.allocator.free([partial[0]])
                    return pages, len(pages) * self.page_size, None
            parent = run.names[-1]
        return pages, num_cached, partial

    def _promote_run(self, names: list[bytes], parent: bytes | None) -> list[int]:
        """Fresh device pages filled from the tiers with the lower-tier run `names` (following
        `parent`), up to the first that cannot be read back (the rest are given back); the
        advisor's prefetch later looks at their graph neighbours."""
        fresh = self.allocate(len(names))
        n = self.prefix_cache.promote(names, fresh, parent)
        if n < len(names):
            self.allocator.free(fresh[n:])
        if self.policy.graph is not None:
            self.promoted.extend(names[:n])
        return fresh[:n]

    LOAD_PAGES_PER_STEP = 64  # cached pages a bounded sequence takes back per step (in chunks)

    def _load_cached(self, seq: Sequence) -> None:
        """Under bounded residency, a prompt's cached pages past the ones it was admitted with
        (`max_cached_pages`) come back a chunk at a time instead of being recomputed, its
        lowest-scored pages paged out to make room as for a prefill chunk: device pages are
        shared, lower-tier ones promoted (unless the cost model says recompute, or no page is
        free without preempting)."""
        ps, cache, bounded, taken = self.page_size, self.prefix_cache, self.bounded, 0
        chunk = max(bounded.chunk_tokens // ps, 1)
        while taken < self.LOAD_PAGES_PER_STEP * ps and seq.num_cached % ps == 0:
            i = seq.num_cached // ps
            if len(seq.names) != i or seq.resident.num_pages != i:  # named and paged up to its end only
                break
            parent = seq.names[-1] if i else None
            names = hash_chain(seq.salt, seq.token_slice(i * ps, min(seq.num_tokens - 1, (i + chunk) * ps)), ps, parent)
            runs = cache.runs(names)
            if not runs:
                break
            run, on_device = runs[0]
            if not on_device and (
                self.allocator.num_free + cache.num_evictable < len(run)
                or not cache.tiers.should_reload(run, len(run) * ps, count=False)
            ):
                break  # no room without preempting, or recomputing them is faster (ReloadCost)
            try:
                bounded.grow(seq, (i + len(run)) * ps)  # pages its lowest-scored pages out first
            except ResidencyError:
                break  # no room: the rest is computed chunk by chunk
            if on_device:
                pages = cache.match(run)
                self.allocator.share(pages)
                cache.used(pages, admission=False)
            else:
                cache.tiers.should_reload(run, len(run) * ps)  # the decision, counted
                pages = self._promote_run(run, parent)
            if not pages:
                break
            seq.pages.extend(pages)
            bounded.grew(seq, len(pages))
            self.set_row(seq)
            seq.names.extend(run[: len(pages)])
            seq.fork = seq.names[-1]  # the first page it computes follows the last it took back
            seq.num_cached += len(pages) * ps
            taken += len(pages) * ps
            if seq.num_preemptions == 0:
                seq.num_cached_prompt += len(pages) * ps
                self.num_prefix_hits += len(pages) * ps
            if len(pages) < len(run):
                break

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)  # not finished: its partial page is not kept
        seq.names, seq.num_cached = [], 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preemption_victim(self) -> Sequence:
        """The running sequence to preempt when pages run out, as the eviction policy says: LRU
        takes the newest, which has the least computed work to lose and, admitted last, would
        have waited longest had it not fit; the advisor the one whose pages matter least."""
        return self.policy.preemption_victim(self.running, self.allocator.blocks)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` pages for `num_tokens` cached tokens, preempting newer sequences if it
        must; False if `seq` itself was preempted."""
        if seq.resident is not None:
            try:
                need = self.bounded.grow(seq, num_tokens)  # pages its lowest-scored pages out first
            except ResidencyError as e:  # this request fails; the others go on
                log.error("%s; the request is aborted", e)
                seq.finish_reason = "abort"
                return False
        else:
            need = self.pages_needed(num_tokens) - len(seq.pages)
        # Free pages first: `num_free_pages` also counts the idle cached ones, a pass over the cache.
        while need > self.allocator.num_free and need > self.num_free_pages:
            victim = self.preemption_victim()
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            self.add_pages(seq, need)
        return True

    def add_pages(self, seq: Sequence, n: int) -> None:
        """Appends `n` fresh device pages to `seq` (its next page indices) and its table row."""
        seq.pages.extend(self.allocate(n))
        if seq.resident is not None:
            self.bounded.grew(seq, n)
        self.set_row(seq)

    # -- steps --------------------------------------------------------------------------------

    def num_lookahead(self, seq: Sequence) -> int:
        """Draft tokens `seq` may carry this step: never more than it may still generate."""
        return max(0, min(self.lookahead, seq.max_tokens - len(seq.output_ids) - 1))

    def schedule(self) -> StepPlan:
        """Admits what fits and picks this step's rows: every decode, then prefill chunks."""
        copies, refills = self._admit()
        budget = self.max_num_batched_tokens
        decode, prefill = [], []
        for seq in [s for s in self.running if not s.prefilling]:
            # Pages for the pending token and its drafts (rejected ones are overwritten later).
            extra = self.num_lookahead(seq)
            if seq in self.running and self._grow(seq, seq.num_cached + 1 + extra):
                decode.append((seq, seq.token_slice(seq.num_cached, seq.num_tokens)))
                budget -= 1 + extra
        for seq in [s for s in self.running if s.prefilling]:
            if seq.resident is not None and self.prefix_cache is not None:
                self._load_cached(seq)  # cached pages past its start come back instead of being recomputed
                if not seq.prefilling:
                    continue
            n = min(seq.num_pending, self.max_prefill_chunk, budget)
            if seq.resident is not None:
                n = min(n, self.bounded.chunk_tokens)
            if prefill:  # a further row must keep the padded call (rows x width) within the budget
                width = self._row_width(len(prefill) + 1)
                if width < self._token_bucket(max(len(t) for _, t in prefill)):
                    break
                n = min(n, width)
            if n <= 0:
                break
            if seq in self.running and self._grow(seq, seq.num_cached + n):
                prefill.append((seq, seq.token_slice(seq.num_cached, seq.num_cached + n)))
                budget -= n
        # A preempted sequence may have been picked before a later one preempted it.
        decode = [(s, t) for s, t in decode if s.slot >= 0]
        prefill = [(s, t) for s, t in prefill if s.slot >= 0]
        refills = [(s, t) for s, t in refills if s.slot >= 0]
        self._computing = set()
        if self.prefix_cache is not None:
            for s, _ in prefill:
                rest = s.prompt_ids[len(s.names) * self.page_size :]
                self._computing.update(hash_chain(s.salt, rest, self.page_size, s.names[-1] if s.names else None))
        return StepPlan(prefill, decode, copies, refills)

    def _token_bucket(self, num_tokens: int) -> int:
        """The width the engine pads a prefill call's rows to (its token bucket)."""
        return bucket(num_tokens, self.min_token_bucket, self.max_prefill_chunk)

    def _row_width(self, num_rows: int) -> int:
        """The widest power-of-two token bucket a prefill call of `num_rows` rows may have: the
        padded call (row bucket x token bucket) stays within max_num_batched_tokens, which is at
        least max_num_seqs, so this is at least 1."""
        per_row = self.max_num_batched_tokens // bucket(num_rows, 1, self.max_num_seqs)
        return 1 << (per_row.bit_length() - 1)

    def copies_done(self, copies: list[tuple[int, int]]) -> None:
        """Drops the references that kept copy sources alive until the copies were made."""
        self.allocator.free([src for src, _ in copies])

    def computed(self, seq: Sequence, num_new: int) -> None:
        """Records that `num_new` more tokens of `seq` are in the cache; names its full pages,
        and gives the pages its prompt's tagged sections fill their tag and importance."""
        tag_pages(self.allocator.blocks, seq, seq.num_cached, seq.num_cached + num_new, self.page_size)
        seq.num_cached += num_new
        seq.num_computed += num_new
        if self.prefix_cache is None:
            return
        graph = self.policy.graph
        while (len(seq.names) + 1) * self.page_size <= seq.num_cached:
            i = len(seq.names)
            parent = seq.names[-1] if seq.names else seq.salt
            name = page_hash(parent, seq.token_slice(i * self.page_size, (i + 1) * self.page_size))
            seq.names.append(name)
            page = seq.page_at(i)
            if page is None:  # held on the host (bounded residency): its name still chains
                continue
            if self.prefix_cache.insert(name, page, parent if i else None):
                block = self.allocator.blocks[page]
                block.tenant, block.token_range = seq.salt, (i * self.page_size, (i + 1) * self.page_size)
                block.created_at = block.touched_at
            if graph is not None:
                self.named.append((name, page))
                if i:
                    graph.add(parent, name, EdgeType.PREFIX_SHARE if seq.fork == parent else EdgeType.TEMPORAL)
        if graph is not None and seq.sections and seq.num_cached >= len(seq.prompt_ids) > seq.num_cached - num_new:
            link_memories(graph, seq, self.page_size)
        if seq.pin_tokens and seq.num_pinned_pages is None and seq.num_cached >= seq.pin_tokens:
            seq.num_pinned_pages = self.pin(seq.names[: seq.pin_tokens // self.page_size], seq.pin_key)

    def pin(self, names: list[bytes], key: bytes | None = None) -> int:
        """Pins the cached pages `names` (`PrefixCache.pin`); returns the pages pinned. Under
        an owner's `key` the pin replaces the one the owner held, and pages the owner holds
        pinned already are not pinned again, so an owner holds at most one pin on a page."""
        if key is None:
            return self.prefix_cache.pin(names)
        held = self._owned_pins.get(key, [])
        if held == names and self.prefix_cache.num_pinned_of(held) == len(held):
            return len(held)
        self.prefix_cache.unpin(held)
        done = self.prefix_cache.pin(names)
        self._owned_pins[key] = names[:done]
        return done

    def release_pin(self, key: bytes) -> int:
        """Drops the pin an owner holds (`pin`); returns the pages unpinned."""
        held = self._owned_pins.pop(key, [])  # nothing without prefix caching
        return self.prefix_cache.unpin(held) if held else 0

    def finish(self) -> list[Sequence]:
        """Releases and returns the running sequences that have finished."""
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.running.remove(seq)
            self.release(seq)
        return done
