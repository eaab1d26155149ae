"""Eviction policies: given the idle pages of the prefix cache, which to drop (or demote) first.

A policy sees each candidate's block record (aither_jax/kv/blocks.py: access clock, hits,
pins, and the metadata the context pipeline fills in) and returns the victims in order.

- `LRUPolicy`: least recently used first, where a lookup touches a chain's pages from its end
  to its start, so eviction takes a chain from its end and leaves a usable prefix. It knows
  nothing of what a page holds: under pressure it evicts a model's identity like any page.
- `AdvisorPolicy`: the graph eviction advisor. A page's score (higher: evicted first) is
  `age 0.01 - degree 5 - edge weights 2 - importance 20 - hits 3 - attention mass 10 + reuse
  distance 1000` (per second of age since its last use; degree and summed decayed weights in the
  block graph, eviction/graph.py; reuse distance: how far now is from the page's expected next
  use, in typical reuse intervals, mixed with its idle time by the share of recent requests
  that returned to a conversation, `reuse_distance`). The reuse term outweighs the graph's
  (a page's degree and edge weights reach 100-200 points), which say how connected a page is,
  not when it is wanted next. Protected pages (tags `system`,
  `identity`, `axioms`, or importance 1.0) are never candidates, up to `max_protected_pages`
  idle ones (the most recently used; beyond that cap the least recently used of them lose
  protection and are ranked with the other pages: the cap is what protection may hold, so idle
  system prompts nobody has used for longest, such as a retired persona's, cannot crowd out the
  pages of live conversations, and still never go before the pages that continue them).
  Rankings are computed off the engine's loop by a background thread about every 0.5 s and
  published with one atomic swap; eviction reads the latest, scoring pages newer than it
  inline, and falls back to LRU order (protection kept) when it is older than about 2 s.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from aither_jax.eviction.graph import BlockGraph, EdgeType
from aither_jax.kv.blocks import Block

log = logging.getLogger(__name__)


class LRUPolicy:
    """Least recently used first."""

    name = "lru"
    protects = False
    graph = None  # it keeps none

    def victims(self, candidates: Sequence[Block], n: int) -> list[Block]:
        return sorted(candidates, key=lambda b: b.last_access)[: max(n, 0)]

    def num_evictable(self, candidates: Sequence[Block]) -> int:
        return len(candidates)

    def demoted(self, blocks: Sequence[Block], resident: Callable[[bytes], bool]) -> None:
        pass

    def forgotten(self, names: Sequence[bytes]) -> None:
        pass

    def reused(self, gap: float | None, returning: bool = True) -> None:
        pass

    def protected(self, block: Block) -> bool:
        return False

    def attended(self, rows: Sequence[tuple[Sequence[Block], Sequence[float]]]) -> None:
        pass

    def preemption_victim(self, running: Sequence, blocks) -> object:
        """The newest running sequence: the least computed work to lose."""
        return running[-1]


PROTECTED_TAGS = frozenset({"system", "identity", "axioms"})


@dataclasses.dataclass(frozen=True)
class AdvisorWeights:
    """The score's terms (the original advisor's weights; attention mass ours)."""

    age: float = 0.01  # per second since the page's last use
    degree: float = 5.0
    edge_weight: float = 2.0
    importance: float = 20.0
    hits: float = 3.0
    attention: float = 10.0
    reuse: float = 1000.0  # per typical reuse interval between now and the page's expected next use

    @classmethod
    def parse(cls, spec: dict | str | None) -> AdvisorWeights:
        """Weights from a dict (or a JSON object) of some of the fields; the rest keep their
        defaults. Raises ValueError naming an unknown field or a value that is not a finite
        number."""
        if spec is None:
            return cls()
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"advisor weights must be a JSON object: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"advisor weights must be an object of weights, got {spec!r}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key, value in spec.items():
            if key not in fields:
                raise ValueError(f"unknown advisor weight {key!r}; the weights are {', '.join(fields)}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
                raise ValueError(f"advisor weight {key!r} must be a finite number, got {value!r}")
        return cls(**{k: float(v) for k, v in spec.items()})


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _key(block: Block) -> tuple:
    """What identifies a page's content in a published ranking (page ids are reused)."""
    return (block.page, block.name, block.partial)


LATE_FACTOR = 4.0  # a page late by a quarter of its interval ranks with one just used
MAX_REUSE_DISTANCE = 4.0  # past this, pages differ by the other terms (all are long overdue)
# The typical interval's floor: requests admitted together on a shared prompt report gaps of
# milliseconds, which would make every page look overdue by thousands of intervals.
MIN_TYPICAL_S = 1.0


def reuse_distance(block: Block, now: float, typical: float, trust: float = 1.0) -> float:
    """How far `now` is from the page's expected next use (its last use plus its reuse
    interval, or `typical` when it has never been reused), in units of `typical`: 0 for a page
    due now, about 1 for a page just used. A page past its expected use counts `LATE_FACTOR`
    times as far as it is late: a conversation that stopped coming back (ended, or a warm-up's)
    goes soon after it misses its return, instead of holding pages that look due. That part is
    at most `MAX_REUSE_DISTANCE`; 0.0 while no interval is known anywhere.

    `trust` (0-1, `AdvisorPolicy.trust`) mixes that expectation with the page's idle time in
    the same units (not capped): when new conversations arrive instead of old ones returning,
    pages that look due are likely an ended set's, and the one idle longest goes first, as LRU
    would."""
    if typical <= 0.0 or block.used_at <= 0.0:
        return 0.0
    interval = block.reuse_interval if block.reuse_interval > 0.0 else typical
    early = block.used_at + interval - now
    predicted = min((early if early >= 0.0 else -LATE_FACTOR * early) / typical, MAX_REUSE_DISTANCE)
    idle = max(now - block.used_at, 0.0) / typical  # uncapped: the longest idle goes first
    return trust * predicted + (1.0 - trust) * idle


CHAIN_MARGIN = 1e-6  # how much lower a page scores than its lowest-scoring continuation


def _deepest_first(records: Sequence[tuple]) -> list[tuple[tuple, tuple]]:
    """(page, its parent page) for each page whose parent is among `records`, children before
    their parents (by depth in the chain). A record is (block, key, name, parent name), read
    once: the engine's thread renames and forgets pages while a ranking is computed."""
    by_name = {r[2]: r for r in records if r[2] is not None}
    depth: dict[bytes, int] = {}

    def depth_of(name: bytes) -> int:
        """1 + the number of ancestors of `name` among `records`."""
        path, cur = [], name
        while cur is not None and cur in by_name and cur not in depth:
            path.append(cur)
            cur = by_name[cur][3]
        d = depth.get(cur, 0)
        for n in reversed(path):
            d += 1
            depth[n] = d
        return depth[name]

    pairs = []
    for r in records:
        parent = by_name.get(r[3]) if r[3] is not None else None
        if parent is not None and parent is not r:
            pairs.append((depth_of(r[2]) if r[2] is not None else depth_of(parent[2]) + 1, r, parent))
    pairs.sort(key=lambda t: -t[0])
    return [(r, parent) for _, r, parent in pairs]


class AdvisorPolicy:
    """The graph eviction advisor (module docstring)."""

    name = "advisor"
    protects = True

    def __init__(
        self,
        graph: BlockGraph | None = None,
        *,
        max_protected_pages: int,
        weights: AdvisorWeights = AdvisorWeights(),
        protected_tags: frozenset[str] = PROTECTED_TAGS,
        refresh_s: float = 0.5,
        stale_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_protected_pages < 0:
            raise ValueError(f"max_protected_pages must be >= 0, got {max_protected_pages}")
        self.graph = graph if graph is not None else BlockGraph(clock=clock)
        self.max_protected_pages = max_protected_pages
        self.weights = weights
        self.protected_tags = protected_tags
        self.refresh_s = refresh_s
        self.stale_s = stale_s
        self.clock = clock
        # (when, page key -> score, page name -> score, typical reuse interval, trust), published together
        self._ranking: tuple[float, dict[tuple, float], dict[bytes, float], float, float] = (
            -math.inf, {}, {}, 0.0, 1.0
        )  # fmt: skip
        # How far the expected next use of a page (`reuse_distance`) is trusted over its idle
        # time: recent admissions' share of returns to a conversation. New conversations
        # arriving instead of old ones returning mean the old ones' expected returns are not
        # coming; ranking by idle time (as LRU does) then lets them go.
        self.trust = 1.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.evicted_by_tag: collections.Counter[str] = collections.Counter()
        self.num_stale = 0  # eviction calls that fell back to LRU order
        self.num_refreshes = 0
        self.gaps: collections.deque[float] = collections.deque(maxlen=self.MAX_GAPS)  # seconds idle before a reuse
        self.refresh_seconds = 0.0  # time the ranking thread spent ranking

    # -- scores -------------------------------------------------------------------------------

    def protected(self, block: Block) -> bool:
        return block.source_tag in self.protected_tags or (block.importance or 0.0) >= 1.0

    def score(
        self, block: Block, stats: dict[bytes, tuple[int, float]], now: float, typical: float = 0.0, trust: float = 1.0
    ) -> float:
        w = self.weights
        degree, strength = stats.get(block.name, (0, 0.0)) if block.name is not None else (0, 0.0)
        return (
            w.age * max(now - block.touched_at, 0.0)
            - w.degree * degree
            - w.edge_weight * strength
            - w.importance * (block.importance or 0.0)
            - w.hits * block.hits
            - w.attention * block.attention_mass
            + w.reuse * reuse_distance(block, now, typical, trust)
        )

    def refresh(self, blocks: Sequence[Block]) -> None:
        """Scores `blocks` and publishes the ranking (one assignment: readers see the old one
        or the new one, never a mix).

        A page never ranks before a page that continues its chain: evicting a chain's middle
        would strand the pages after it, so each page's score is below its descendants'. And
        a run of pages that continues into no other (one conversation's pages after the
        prefix it shares) ranks as one: every page of it takes its best page's score (its
        first page's, after the rule above; never a protected page's, which would keep a
        persona's only conversation for good), deeper pages a hair higher, so eviction empties
        the least valuable run from its end before touching the next. Scored page by page,
        eviction would trim the newest turn off every conversation instead, and each
        follow-up would recompute its own last turn."""
        start = time.perf_counter()
        now = self.clock()
        stats = self.graph.stats()
        gaps = self.gaps.copy()  # the engine's thread appends (deque.copy holds the GIL)
        typical = max(statistics.median(gaps), MIN_TYPICAL_S) if gaps else 0.0
        trust = self.trust
        # Each page's key, name and parent read once (`_deepest_first`).
        records = [(b, _key(b), b.name, b.parent) for b in blocks]
        ranking = {key: self.score(b, stats, now, typical, trust) for b, key, _, _ in records}
        pairs = _deepest_first(records)
        for (_, key, _, _), (_, parent, _, _) in pairs:
            ranking[parent] = min(ranking[parent], ranking[key] - CHAIN_MARGIN)
        children = collections.Counter(parent[1] for _, parent in pairs)
        for (_, key, name, _), (parent, parent_key, _, _) in reversed(pairs):  # a run's head is settled first
            if children[parent_key] == 1 and name is not None and not self.protected(parent):
                ranking[key] = ranking[parent_key] + CHAIN_MARGIN
        by_name = {name: ranking[key] for _, key, name, _ in records if name is not None}
        self._ranking = (now, ranking, by_name, typical, trust)
        self.num_refreshes += 1
        self.refresh_seconds += time.perf_counter() - start

    @property
    def ranking_age(self) -> float:
        return self.clock() - self._ranking[0]

    # -- the background thread ----------------------------------------------------------------

    def start(self, source: Callable[[], Sequence[Block]]) -> None:
        """Ranks `source()` (the cached pages' records; a bound method, held weakly) every
        `refresh_s` on a daemon thread, until this policy or the source's
        owner is garbage collected."""
        if self._thread is not None:
            return
        policy_ref, source_ref, stop = weakref.ref(self), weakref.WeakMethod(source), self._stop

        def loop() -> None:
            while True:
                policy = policy_ref()
                if policy is None:
                    return
                interval = policy.refresh_s
                del policy
                if stop.wait(interval):
                    return
                policy, fetch = policy_ref(), source_ref()
                if policy is None or fetch is None:
                    return
                try:
                    policy.refresh(fetch())
                except RuntimeError:  # a container changed while it was copied: next time
                    pass
                except Exception:  # never the thread's end: eviction would fall back to LRU for good
                    log.exception("the eviction advisor's ranking failed; it ranks again in %.1f s", interval)
                del policy, fetch

        self._thread = threading.Thread(target=loop, name="kv-advisor", daemon=True)
        self._thread.start()

    def __del__(self):
        self._stop.set()

    # -- decisions ----------------------------------------------------------------------------

    def _evictable(self, candidates: Sequence[Block], order) -> list[Block]:
        """The open candidates and the protected ones beyond the cap, in eviction order."""
        open_, protected = [], []
        for b in candidates:
            (protected if self.protected(b) else open_).append(b)
        protected.sort(key=lambda b: b.last_access, reverse=True)  # the most recently used keep protection
        # Past the cap a page loses its protection, not its rank: ranked with the others, a
        # retired persona's system page (long idle) goes early, and none goes before the
        # conversation pages that continue it (no lookup could reach those after it).
        return sorted(open_ + protected[self.max_protected_pages :], key=order)

    def _order(self):
        """Eviction order: by the published ranking while fresh (scoring newer pages inline),
        else least recently used first."""
        at, ranking, by_name, typical, trust = self._ranking
        now = self.clock()
        if now - at > self.stale_s:
            self.num_stale += 1
            return lambda b: b.last_access

        def key(b: Block) -> float:
            score = ranking.get(_key(b))
            if score is None:
                parent = by_name.get(b.parent) if b.parent is not None else None
                if parent is not None:  # a page newer than the ranking continues its parent's run
                    return -(parent + CHAIN_MARGIN)
                stats = self.graph.stats(() if b.name is None else (b.name,))  # its own entry: one lookup
                score = self.score(b, stats, now, typical, trust)
            return -score

        return key

    def victims(self, candidates: Sequence[Block], n: int) -> list[Block]:
        chosen = self._evictable(candidates, self._order())[: max(n, 0)]
        for b in chosen:
            self.evicted_by_tag[b.source_tag or "untagged"] += 1
        return chosen

    def num_evictable(self, candidates: Sequence[Block]) -> int:
        protected = sum(1 for b in candidates if self.protected(b))
        return len(candidates) - protected + max(protected - self.max_protected_pages, 0)

    def demoted(self, blocks: Sequence[Block], resident: Callable[[bytes], bool]) -> None:
        """SPILL_LINK: each demoted page and the pages of its chain (its parent, its graph
        neighbours) that stay on the device."""
        for b in blocks:
            near = [b.parent] + [n for n, kind, _ in self.graph.neighbours(b.name) if kind != EdgeType.SPILL_LINK]
            for other in near:
                if other is not None and resident(other):
                    self.graph.add(b.name, other, EdgeType.SPILL_LINK)

    def forgotten(self, names: Sequence[bytes]) -> None:
        """Pages gone from every tier leave the graph (their edges, counts and summary)."""
        for name in names:
            self.graph.remove(name)

    MAX_GAPS = 1024
    RETURN_SMOOTHING = 0.5  # weight of the newest admission in `trust`

    def reused(self, gap: float | None, returning: bool = True) -> None:
        """A request was admitted. `gap`: the seconds since the deepest page of its chain was
        used before (None if none was): the median of recent gaps is the typical reuse
        interval of `reuse_distance`. `returning`: that page ended a conversation's chain,
        where False means the request starts a new one (it shares a system prompt at most).
        `trust` is a moving average of `returning` (1.0 before any admission)."""
        if gap is not None:
            self.gaps.append(gap)
        a = self.RETURN_SMOOTHING
        self.trust = (1 - a) * self.trust + a * float(returning)

    MASS_SMOOTHING = 0.3  # weight of a step's mass in a page's moving average
    CO_ATTEND_THRESHOLD = 0.05  # share of a row's attention that makes a page "attended"

    def attended(self, rows: Sequence[tuple[Sequence[Block], Sequence[float]]]) -> None:
        """One step's attention: each row's page records and the mass it put on each (floats).
        Folds the mass into each page's moving average and its last-attended time, and counts
        the row's heavily attended named pages as co-attending (CO_ATTEND edges). It visits
        every page every row holds, so it runs on plain Python floats (`page_records.attended`)."""
        now, a = self.clock(), self.MASS_SMOOTHING
        keep, threshold = 1.0 - a, self.CO_ATTEND_THRESHOLD
        for blocks, masses in rows:
            heavy = {}
            for block, mass in zip(blocks, masses, strict=False):
                block.attention_mass = keep * block.attention_mass + a * mass
                if mass >= threshold:
                    block.attended_at = now
                    if block.name is not None:
                        heavy[block.name] = mass
            if len(heavy) > 1:
                self.graph.co_attend(heavy, threshold)

    def preemption_victim(self, running: Sequence, blocks) -> object:
        """The running sequence whose pages matter least (lowest mean importance; the newest
        among equals), never one holding protected pages while another does not."""

        def worth(i_seq) -> tuple:
            i, seq = i_seq
            records = [blocks[p] for p in seq.pages]
            protected = any(self.protected(b) for b in records)
            importance = sum(b.importance or 0.0 for b in records) / max(len(records), 1)
            return (protected, importance, -i)

        return min(enumerate(running), key=worth)[1]


POLICIES = ("lru", "advisor")


def make_policy(name: str, *, max_protected_pages: int = 0, weights: dict | str | None = None, **kwargs):
    """The policy registered under `name` (ValueError naming the choices otherwise); `weights`:
    the advisor's score weights that differ from the defaults (`AdvisorWeights.parse`)."""
    if name == "lru":
        if weights:
            raise ValueError("advisor weights apply to the advisor only (eviction policy 'advisor', prefix caching on)")
        return LRUPolicy()
    if name == "advisor":
        return AdvisorPolicy(max_protected_pages=max_protected_pages, weights=AdvisorWeights.parse(weights), **kwargs)
    raise ValueError(f"eviction policy must be one of {list(POLICIES)}, got {name!r}")
