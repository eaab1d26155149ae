"""The block graph: typed, weighted, decaying edges between KV pages, for the eviction advisor.

Nodes are pages known by their chain names (prefix_cache.page_hash), which stay the same
while a page moves between the device, host and disk tiers. Each edge type is created by one
real event:

- PREFIX_SHARE: a request reuses cached pages of another request's chain; the last reused page
  is linked to the first page the new request computes after it (where the chains fork).
- CO_ATTEND: pages that carry high attention mass in the same steps; counted for every pair
  of the step's highest-mass pages (chosen by mass, never by id), an edge from the third
  co-occurrence on, its weight growing with each further one.
- SEMANTIC: two pages whose mean-key summaries (centred on their running mean) have cosine
  similarity of at least 0.8 (a new page links to its 3 closest such pages).
- TEMPORAL: consecutive pages of one sequence (a page and the one computed after it).
- SPILL_LINK: a page demoted below the device and the device pages of its chain it leaves
  behind, so that promoting one brings its spilled neighbours along.
- MEMORY_REF: pages filled by a retrieved-memory section and the page of the request that
  read them.

Weights decay exponentially with a half-life (`half_life_s`). Every weight decays by the same
factor, so each is stored as its value at one reference time (a weight added at t counts
2^((t - t0) / half_life) times its amount) and read back by one shared factor; the reference
moves forward every `REBASE_HALF_LIVES` half-lives to keep the numbers finite. Each page's
summed weight is kept the same way as edges change, so a page's degree and strength cost one
lookup (`stats`) and the weakest edges are the smallest stored values, whatever the time.
The graph is bounded: past `max_edges` the weakest tenth of the edges goes, and `max_nodes`
bounds the co-attendance and summary records. All methods may be called from any thread (one
lock); the advisor's ranking thread reads `stats()`.
"""

from __future__ import annotations

import collections
import enum
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np


class EdgeType(enum.Enum):
    PREFIX_SHARE = "prefix_share"
    CO_ATTEND = "co_attend"
    SEMANTIC = "semantic"
    TEMPORAL = "temporal"
    SPILL_LINK = "spill_link"
    MEMORY_REF = "memory_ref"


CO_ATTEND_MIN = 3  # co-occurrences before a CO_ATTEND edge exists
SEMANTIC_MIN_COSINE = 0.8
SEMANTIC_WINDOW = 2048  # the most recent summaries a new one is compared with
SEMANTIC_TOP = 3  # a new page links to at most this many of its closest summaries
REBASE_HALF_LIVES = 64.0  # stored weights grow by 2 per half-life past the reference: 2^64 at most


def _pair(a: bytes, b: bytes) -> tuple[bytes, bytes]:
    return (a, b) if a <= b else (b, a)


class BlockGraph:
    """Typed, weighted, decaying edges between pages (by name)."""

    def __init__(
        self,
        *,
        half_life_s: float = 600.0,
        max_edges: int = 200_000,
        max_nodes: int = 100_000,
        co_attend_top: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ):
        if half_life_s <= 0 or max_edges < 1 or max_nodes < 1 or co_attend_top < 2:
            raise ValueError("half_life_s must be > 0, max_edges and max_nodes >= 1, co_attend_top >= 2")
        self.half_life_s = half_life_s
        self.max_edges = max_edges
        self.max_nodes = max_nodes
        self.co_attend_top = co_attend_top
        self.clock = clock
        self._lock = threading.Lock()
        # (a, b) with a <= b, type -> weight at the reference time `_t0`
        self._edges: dict[tuple[tuple[bytes, bytes], EdgeType], float] = {}
        self._adj: dict[bytes, set[tuple[bytes, EdgeType]]] = collections.defaultdict(set)
        self._strength: dict[bytes, float] = {}  # per page, the sum of its edges' stored weights
        self._t0 = -math.inf  # set by the first edge
        self._latest = -math.inf  # the latest time seen: reads never run the clock backwards
        self._co_counts: collections.OrderedDict[tuple[bytes, bytes], int] = collections.OrderedDict()
        self._summaries: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._mean: np.ndarray | None = None  # running mean of the summaries
        self._num_summaries = 0
        self.num_pruned = 0

    # -- edges --------------------------------------------------------------------------------

    def _now(self) -> float:
        self._latest = max(self._latest, self.clock())
        return self._latest

    def _decay(self, now: float) -> float:
        """The factor from stored weights to weights at `now`."""
        return 0.0 if self._t0 == -math.inf else 2.0 ** (-(now - self._t0) / self.half_life_s)

    def _rebase(self, now: float) -> None:
        """Moves the reference time to `now` (every stored weight and strength rescaled, the
        strengths summed afresh)."""
        decay = self._decay(now)
        self._t0 = now
        for key in self._edges:
            self._edges[key] *= decay
        self._strength = dict.fromkeys(self._adj, 0.0)
        for ((a, b), _), w in self._edges.items():
            self._strength[a] += w
            self._strength[b] += w

    def add(self, a: bytes, b: bytes, kind: EdgeType, amount: float = 1.0) -> None:
        """Adds `amount` to the (decayed) weight of the `kind` edge between `a` and `b`."""
        if a == b:
            return
        with self._lock:
            self._add(a, b, kind, amount, self._now())

    def _add(self, a: bytes, b: bytes, kind: EdgeType, amount: float, now: float) -> None:
        if self._t0 == -math.inf or now - self._t0 > REBASE_HALF_LIVES * self.half_life_s:
            self._rebase(now)
        stored = amount / self._decay(now)
        key = (_pair(a, b), kind)
        new = key not in self._edges
        self._edges[key] = self._edges.get(key, 0.0) + stored
        for x, y in ((a, b), (b, a)):
            self._strength[x] = self._strength.get(x, 0.0) + stored
            if new:
                self._adj[x].add((y, kind))
        if new and len(self._edges) > self.max_edges:
            self._prune()

    def _prune(self) -> None:
        """Drops the weakest tenth of the edges (the smallest stored weights: every weight
        decays alike)."""
        keys = list(self._edges)
        n = max(len(keys) // 10, 1)
        weights = np.fromiter(self._edges.values(), np.float64, count=len(keys))
        weakest = np.argpartition(weights, n - 1)[:n].tolist() if n < len(keys) else range(len(keys))
        for i in weakest:
            self._remove_edge(keys[i])
        self.num_pruned += n

    def _remove_edge(self, key: tuple[tuple[bytes, bytes], EdgeType]) -> None:
        (a, b), kind = key
        stored = self._edges.pop(key)
        for x, y in ((a, b), (b, a)):
            links = self._adj.get(x)
            if links is not None:
                links.discard((y, kind))
                if links:
                    self._strength[x] -= stored
                else:
                    del self._adj[x]
                    self._strength.pop(x, None)

    def weight(self, a: bytes, b: bytes, kind: EdgeType) -> float:
        """The decayed weight of an edge (0 when there is none)."""
        with self._lock:
            return self._edges.get((_pair(a, b), kind), 0.0) * self._decay(self._now())

    def neighbours(self, name: bytes, kinds: Iterable[EdgeType] | None = None) -> list[tuple[bytes, EdgeType, float]]:
        """(other page, edge type, decayed weight) of each edge at `name`."""
        kinds = None if kinds is None else set(kinds)
        with self._lock:
            decay = self._decay(self._now())
            return [
                (other, kind, self._edges[(_pair(name, other), kind)] * decay)
                for other, kind in self._adj.get(name, ())
                if kinds is None or kind in kinds
            ]

    def remove(self, name: bytes) -> None:
        """Forgets a page that left every tier (its edges, counts and summary)."""
        with self._lock:
            for other, kind in list(self._adj.get(name, ())):
                self._remove_edge((_pair(name, other), kind))
            self._summaries.pop(name, None)

    def stats(self, names: Iterable[bytes] | None = None) -> dict[bytes, tuple[int, float]]:
        """Per page with edges (of `names`, or every one): (degree, sum of decayed edge
        weights), read at one instant."""
        with self._lock:
            decay = self._decay(self._now())
            strength, adj = self._strength, self._adj
            if names is None:
                return {x: (len(links), max(strength[x] * decay, 0.0)) for x, links in adj.items()}
            return {x: (len(adj[x]), max(strength[x] * decay, 0.0)) for x in names if x in strength}

    def num_edges(self, kind: EdgeType | None = None) -> int:
        with self._lock:
            return sum(1 for _, k in self._edges if kind is None or k == kind)

    # -- events -------------------------------------------------------------------------------

    def co_attend(self, masses: dict[bytes, float], threshold: float) -> int:
        """One step's attention: of the pages with mass >= `threshold`, the `co_attend_top`
        heaviest (ties broken by name, so no range of ids is favoured) count one co-occurrence
        per pair; a pair's edge exists from its CO_ATTEND_MIN-th and grows by one with each
        further. Returns the edges created or grown."""
        heavy = sorted((m, n) for n, m in masses.items() if m >= threshold)
        top = sorted(n for _, n in heavy[-self.co_attend_top :])
        done = 0
        with self._lock:
            now = self._now()
            for a, b in itertools.combinations(top, 2):
                count = self._co_counts.pop((a, b), 0) + 1
                self._co_counts[(a, b)] = count  # the most recently counted last
                if count >= CO_ATTEND_MIN:
                    self._add(a, b, EdgeType.CO_ATTEND, 1.0, now)
                    done += 1
            while len(self._co_counts) > self.max_nodes:
                self._co_counts.popitem(last=False)
        return done

    def summarize(self, name: bytes, summary: np.ndarray) -> int:
        """Records a page's mean-key summary and links it SEMANTIC to the SEMANTIC_TOP closest
        of the last SEMANTIC_WINDOW recorded pages whose summary has cosine >=
        SEMANTIC_MIN_COSINE with it (weight: the cosine), so that text that repeats (a small
        vocabulary, a template) cannot make the graph dense and every page's degree alike.
        Summaries are compared centred on their running mean: keys share a large common
        direction, so raw mean keys would all look alike. Returns the links."""
        v = np.asarray(summary, np.float32).ravel()
        if not np.isfinite(v).all() or not v.any():
            return 0
        with self._lock:
            now = self._now()
            if self._mean is None or self._mean.shape != v.shape:
                self._mean, self._num_summaries = np.zeros_like(v), 0
            self._num_summaries += 1
            self._mean += (v - self._mean) / min(self._num_summaries, 1000)
            recent = itertools.islice(reversed(self._summaries.items()), SEMANTIC_WINDOW)  # not a copy of all
            others = [(n, s) for n, s in reversed(list(recent)) if n != name]
            self._summaries[name] = v
            self._summaries.move_to_end(name)
            while len(self._summaries) > self.max_nodes:
                self._summaries.popitem(last=False)
            centred = v - self._mean
            norm = float(np.linalg.norm(centred))
            others = [(n, s) for n, s in others if s.shape == v.shape]
            if not others or norm == 0:
                return 0
            names, matrix = zip(*others, strict=True)
            rest = np.stack(matrix) - self._mean
            cosines = rest @ centred / np.maximum(np.linalg.norm(rest, axis=1) * norm, 1e-30)
            linked = 0
            for i in np.argsort(-cosines)[:SEMANTIC_TOP]:
                if cosines[i] >= SEMANTIC_MIN_COSINE:
                    if (_pair(name, names[i]), EdgeType.SEMANTIC) not in self._edges:
                        self._add(name, names[i], EdgeType.SEMANTIC, float(cosines[i]), now)
                    linked += 1
        return linked

    # -- inspection ---------------------------------------------------------------------------

    def to_json(self, describe: Callable[[bytes], dict] | None = None, limit: int = 10_000) -> dict:
        """Nodes and edges (by type), names in hex, for a debug dump; `describe` adds what is
        known of a node (its block record)."""
        with self._lock:
            decay = self._decay(self._now())
            edges = list(itertools.islice(self._edges.items(), limit))
        by_type: dict[str, list] = {k.value: [] for k in EdgeType}
        nodes: set[bytes] = set()
        for ((a, b), kind), stored in edges:
            by_type[kind.value].append([a.hex(), b.hex(), round(stored * decay, 4)])
            nodes.update((a, b))
        return {
            "num_edges": {k: len(v) for k, v in by_type.items()},
            "nodes": [{"name": n.hex(), **(describe(n) if describe else {})} for n in sorted(nodes)],
            "edges": by_type,
        }
