"""Bounded residency: a sequence's KV grows past the device pages it may hold.

Each sequence under `--max-resident-tokens N` keeps at most N / page_size pages on the device:
its sink pages (the first tokens), its protected pages (system and identity text, by the tag
rule of core/page_records.py), a tail window of its newest pages, and the best-scored of the
rest. The others are held on the host, byte-exact: the same gather and scatter that move pages
between the KV tiers (`PageStore.read` and `write`, every pool that shares page ids, the
DFlash draft's context rows included) take them off the device and bring them back.

The sequence's block table lists only its resident pages, in order. Keys were rotated at their
true positions when written, so a page can leave and come back unchanged; the step batch
carries each row's `offset`, the tokens of the pages held off the device, all of which lie
before the tail: table positions, lengths and every mask count resident tokens only (the
table is the exact mask: a page not in it is never read, and it is rebuilt whenever the
resident set changes), and RoPE takes table position + offset, the true position. Shapes do not
depend on which pages are resident.

Reselection runs every tau tokens (at least history / 45, so rescoring stays rare on long
contexts) with one of four scorers:
- `attention`: the moving average of the softmax mass each page received at the model's last
  global layer while resident (`forward(mass_layers=...)`; a page held off keeps its last
  average), plus `qk`'s estimate for the newest query, which a held page gets too (with
  measured mass alone, held pages would be scored on stale or no evidence).
- `qk`: each page's estimated attention share for the newest query (heads averaged per KV
  head): the softmax over the candidate pages of the query against the page's mean key,
  summed over KV heads; every page has a mean key, resident or held.
- `lru`: most recently written or brought back first (the control).
- `window`: sinks and the newest pages only, no protection (StreamingLLM).
"""

from __future__ import annotations

import bisect
import dataclasses
import time

import numpy as np

from aither_jax.core.page_records import page_span
from aither_jax.core.sequence import Sequence
from aither_jax.eviction.policy import PROTECTED_TAGS

SCORERS = ("attention", "qk", "lru", "window")
MASS_WEIGHT = 0.3  # weight of the newest step in a page's moving-average attention mass
HISTORY_PER_RESCORE = 45  # reselect at most every history / 45 tokens


class ResidencyError(RuntimeError):
    """A page of a sequence could not be placed on the device."""


@dataclasses.dataclass(frozen=True)
class ResidencyConfig:
    """Bounded residency's settings (validated by `check`)."""

    max_tokens: int
    tau: int = 64
    scorer: str = "attention"
    sink_tokens: int = 16  # the first tokens never leave the device (whole pages)
    tail_tokens: int = 128  # nor do the newest (raised to a sliding window + a page)
    chunk_tokens: int = 64  # longest prefill chunk of a bounded sequence

    def check(self) -> None:
        for name in ("max_tokens", "tau", "sink_tokens", "tail_tokens", "chunk_tokens"):
            value = getattr(self, name)
            low = 0 if name == "sink_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"residency {name} must be an integer >= {low}, got {value!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"residency scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")


class ResidentSet:
    """One sequence's pages under bounded residency. `logical[j]` is the page index (within the
    sequence) of the device page `seq.pages[j]`; `held` maps the page indices held on the host
    to their bytes (one array per pool leaf, as `PageStore.read` gives them)."""

    def __init__(self, protected: frozenset[int], page_size: int):
        self.page_size = page_size
        self.logical: list[int] = []
        self.held: dict[int, list[np.ndarray]] = {}
        self.protected = protected
        self.mass: dict[int, float] = {}  # moving-average attention mass per page
        self.keys: dict[int, np.ndarray] = {}  # mean key per page [Hkv * Dh] (qk)
        self.query: np.ndarray | None = None  # the newest query summary [Hkv * Dh] (qk)
        self.used: dict[int, int] = {}  # page -> clock of its last write or page-in (lru)
        self.next_select = 0

    @property
    def offset(self) -> int:
        """Tokens held off the device (all before the resident tail)."""
        return len(self.held) * self.page_size

    @property
    def num_pages(self) -> int:
        return len(self.logical) + len(self.held)

    def page_at(self, seq: Sequence, i: int) -> int | None:
        j = bisect.bisect_left(self.logical, i)
        return seq.pages[j] if j < len(self.logical) and self.logical[j] == i else None


class BoundedResidency:
    """The resident sets of one scheduler's sequences, moved through its page store."""

    def __init__(
        self, config: ResidencyConfig, scheduler, store, *, window: int | None, mass_layer: int, head_dim: int
    ):
        config.check()
        # The layer whose attention mass steps report (`attention`) and whose queries and mean
        # keys `qk` compares.
        self.config, self.scheduler, self.store, self.mass_layer = config, scheduler, store, mass_layer
        self.head_dim = head_dim
        ps = self.page_size = scheduler.page_size
        self.max_pages = config.max_tokens // ps
        self.sink_pages = max(1, -(-config.sink_tokens // ps), -(-scheduler.sink_tokens // ps))
        tail = max(config.tail_tokens, window + ps if window else 0)
        self.tail_pages = -(-tail // ps)
        # A prefill chunk of a bounded sequence: its pages come on top of the fixed ones.
        self.chunk_tokens = min(scheduler.max_prefill_chunk, config.chunk_tokens)
        self.chunk_pages = -(-self.chunk_tokens // ps) + 1 + scheduler.lookahead // ps + 1
        least = self.sink_pages + self.tail_pages + self.chunk_pages
        if self.max_pages < least:
            raise ValueError(
                f"max_resident_tokens {config.max_tokens} holds {self.max_pages} pages of {ps} tokens, fewer than the "
                f"{least} that never leave: {self.sink_pages} of sink tokens, a tail window of {self.tail_pages} and "
                f"{self.chunk_pages} for the tokens of one step; raise max_resident_tokens to at least {least * ps}"
            )
        if self.max_pages > scheduler.num_usable_pages:
            raise ValueError(
                f"max_resident_tokens {config.max_tokens} needs {self.max_pages} KV pages but the cache has "
                f"{scheduler.num_usable_pages}; lower it or raise num_pages"
            )
        self.clock = 0
        # Counters: reselections run, pages moved each way, seconds spent reselecting.
        self.num_reselections = 0
        self.num_paged_out = 0
        self.num_paged_in = 0
        self.reselect_seconds = 0.0
        self.grow_seconds = 0.0  # paging out to make room for new pages (scoring included)

    # -- admission ------------------------------------------------------------------------------

    def protected_pages(self, seq: Sequence) -> frozenset[int]:
        """The prompt pages that never leave the device: tagged system/identity text, or of
        importance 1 (none for the `window` scorer)."""
        if self.config.scorer == "window" or not seq.sections:
            return frozenset()
        out = set()
        for i in range(-(-len(seq.prompt_ids) // self.page_size)):
            span = page_span(seq, i, self.page_size)
            if span is not None and (span.tag in PROTECTED_TAGS or span.importance >= 1.0):
                out.add(i)
        return frozenset(out)

    def check(self, seq: Sequence) -> None:
        """Raises ValueError if `seq`'s pages that never leave cannot all be resident."""
        fixed = self.sink_pages + self.tail_pages + self.chunk_pages
        protected = len(self.protected_pages(seq) - set(range(self.sink_pages)))
        if fixed + protected > self.max_pages:
            raise ValueError(
                f"the prompt's protected (system/identity) text fills {protected} KV pages, which with the sink, tail "
                f"and step pages ({fixed}) exceed max_resident_tokens {self.config.max_tokens} "
                f"({self.max_pages} pages): shorten the protected sections or raise max_resident_tokens"
            )

    def admit(self, seq: Sequence) -> None:
        """Starts `seq`'s resident set over the pages it was admitted with (all resident)."""
        resident = ResidentSet(self.protected_pages(seq), self.page_size)
        resident.logical = list(range(len(seq.pages)))
        resident.used = dict.fromkeys(resident.logical, self.clock)
        resident.next_select = self._next_select(seq.num_cached)
        seq.resident = resident

    @property
    def max_cached_pages(self) -> int:
        """Prefix-cache pages a sequence may start with: a hit that leaves a prefill chunk's
        room in the bound (the rest of its cached pages come back a chunk at a time as it
        prefills, `Scheduler._load_cached`, paging out as they come)."""
        return max(self.max_pages - self.chunk_pages, 0)

    def pages_to_admit(self, num_pages: int) -> int:
        """Device pages a sequence of `num_pages` pages needs at most."""
        return min(num_pages, self.max_pages)

    # -- growing --------------------------------------------------------------------------------

    def grow(self, seq: Sequence, num_tokens: int) -> int:
        """Makes room for `seq`'s pages up to `num_tokens` tokens (paging out its lowest-scored
        pages) and returns how many new device pages it needs."""
        resident = seq.resident
        need = self.scheduler.pages_needed(num_tokens) - resident.num_pages
        over = len(seq.pages) + max(need, 0) - self.max_pages
        if over > 0:
            start = time.perf_counter()
            out = self._ranked(seq)[:over]
            if len(out) < over:
                raise ResidencyError(
                    f"request {seq.seq_id}: {len(seq.pages) + need} KV pages must be resident but "
                    f"max_resident_tokens allows {self.max_pages}"
                )
            self.page_out(seq, out)
            self.grow_seconds += time.perf_counter() - start
        return max(need, 0)

    def grew(self, seq: Sequence, num_new: int) -> None:
        """Records `num_new` device pages appended to `seq.pages` (its next page indices)."""
        resident = seq.resident
        first = resident.num_pages
        self.clock += 1
        for i in range(first, first + num_new):
            resident.logical.append(i)
            resident.used[i] = self.clock

    # -- scores ---------------------------------------------------------------------------------

    def _fixed(self, seq: Sequence) -> set[int]:
        """`seq`'s pages that never leave (of those it has): sinks, the tail, protected ones."""
        resident, total = seq.resident, seq.resident.num_pages
        fixed = set(range(min(self.sink_pages, total))) | set(range(max(total - self.tail_pages, 0), total))
        return fixed | {i for i in resident.protected if i < total}

    def _scores(self, seq: Sequence, pages: list[int]) -> np.ndarray:
        """Keep-scores of page indices (higher stays)."""
        resident, scorer = seq.resident, self.config.scorer
        if scorer == "attention":  # measured mass, plus the estimate that also covers held pages
            estimate = self._estimated_shares(seq, pages)
            return np.array([resident.mass.get(i, 0.0) for i in pages]) + np.minimum(estimate, 1.0)
        if scorer == "lru":
            return np.array([resident.used.get(i, -1) for i in pages], np.float64)
        if scorer == "window":
            return np.array(pages, np.float64)
        return self._estimated_shares(seq, pages)

    def _estimated_shares(self, seq: Sequence, pages: list[int]) -> np.ndarray:
        resident = seq.resident
        self._summarize(seq)
        if resident.query is None:
            return np.zeros(len(pages))
        # Each page's estimated attention share at each KV head: the softmax over the candidate
        # pages of the newest query (heads of the group averaged) against the page's mean key,
        # summed over heads. A page without a mean key yet (still filling) ranks first.
        q = resident.query.reshape(-1, self.head_dim)  # [Hkv, Dh]
        known = [i for i in pages if i in resident.keys]
        out = np.full(len(pages), np.inf)
        if known:
            k = np.stack([resident.keys[i] for i in known]).reshape(len(known), *q.shape)  # [P, Hkv, Dh]
            logits = (k * q[None]).sum(-1) / np.sqrt(self.head_dim)  # [P, Hkv]
            share = np.exp(logits - logits.max(0, keepdims=True))
            share /= share.sum(0, keepdims=True)
            where = {i: j for j, i in enumerate(pages)}
            out[[where[i] for i in known]] = share.sum(1)
        return out

    def _summarize(self, seq: Sequence) -> None:
        """Mean keys of `seq`'s full resident pages that have none yet (one device call)."""
        resident = seq.resident
        full = seq.num_cached // self.page_size
        todo = [(i, p) for i, p in zip(resident.logical, seq.pages, strict=True) if i < full and i not in resident.keys]
        if todo:
            vectors = self.store.key_summaries([p for _, p in todo], self.mass_layer)
            for (i, _), vector in zip(todo, vectors, strict=True):
                resident.keys[i] = vector

    def _ranked(self, seq: Sequence) -> list[int]:
        """`seq`'s resident page indices that may leave, lowest score first."""
        fixed = self._fixed(seq)
        pages = [i for i in seq.resident.logical if i not in fixed]
        if not pages:
            return []
        scores = self._scores(seq, pages)
        return [pages[k] for k in np.argsort(scores, kind="stable")]

    def observe(self, rows, mass, query) -> None:
        """Folds a step's attention mass per page read (and query summaries) into the
        resident sets of its bounded rows (`mass` and `query` as the step returned them)."""
        for (seq, _), row_mass, row_query in zip(rows, np.asarray(mass), np.asarray(query), strict=False):
            resident = seq.resident
            if resident is None or seq.slot < 0:
                continue
            resident.query = row_query
            for i, m in zip(resident.logical, row_mass, strict=False):
                old = resident.mass.get(i)
                resident.mass[i] = float(m) if old is None else (1 - MASS_WEIGHT) * old + MASS_WEIGHT * float(m)

    # -- reselection ----------------------------------------------------------------------------

    def _next_select(self, num_tokens: int) -> int:
        return num_tokens + max(self.config.tau, num_tokens // HISTORY_PER_RESCORE)

    def reselect_due(self, seqs) -> int:
        """Reselects the resident set of every sequence in `seqs` that is due; returns the
        pages moved."""
        moved = 0
        start = time.perf_counter()
        for seq in seqs:
            resident = seq.resident
            if resident is not None and seq.slot >= 0 and seq.num_cached >= resident.next_select:
                moved += self.reselect(seq)
                self.num_reselections += 1
        self.reselect_seconds += time.perf_counter() - start
        return moved

    def reselect(self, seq: Sequence) -> int:
        """Makes `seq`'s resident set its fixed pages and the best-scored others up to the
        budget; returns the pages moved."""
        resident = seq.resident
        resident.next_select = self._next_select(seq.num_cached)
        if not resident.held or self.config.scorer == "window":
            return 0  # nothing held off, or the newest pages are resident already
        fixed = self._fixed(seq)
        others = [i for i in (*resident.logical, *resident.held) if i not in fixed]
        scores = self._scores(seq, others)
        keep = {others[k] for k in np.argsort(-scores, kind="stable")[: max(self.max_pages - len(fixed), 0)]}
        out = [i for i in resident.logical if i not in fixed and i not in keep]
        back = sorted(i for i in resident.held if i in keep)
        if out:
            self.page_out(seq, out)
        if back:
            self.page_in(seq, back)
        return len(out) + len(back)

    # -- moves ----------------------------------------------------------------------------------

    def page_out(self, seq: Sequence, pages: list[int]) -> None:
        """Moves `seq`'s page indices `pages` (resident, none of them its last page) to the
        host: their bytes are read, the device pages released."""
        resident = seq.resident
        if self.config.scorer in ("qk", "attention"):
            self._summarize(seq)
        index = [resident.logical.index(i) for i in pages]
        device = [seq.pages[j] for j in index]
        rows = self.store.read(device)
        for k, i in enumerate(pages):  # copies: a view would keep the whole padded read alive
            resident.held[i] = [leaf[k].copy() for leaf in rows]
        for j in sorted(index, reverse=True):
            del resident.logical[j]
            del seq.pages[j]
        self.scheduler.allocator.free(device)
        self.num_paged_out += len(pages)
        self._changed(seq)

    def page_in(self, seq: Sequence, pages: list[int]) -> int:
        """Brings page indices `pages` of `seq` back from the host into fresh device pages, as
        many as free pages allow; returns how many came back."""
        resident = seq.resident
        room = self.scheduler.num_free_pages
        pages = pages[:room]
        if not pages:
            return 0
        device = self.scheduler.allocate(len(pages))
        rows = [np.stack([resident.held[i][leaf] for i in pages]) for leaf in range(len(resident.held[pages[0]]))]
        self.store.write(device, rows)
        self.clock += 1
        for i, page in zip(pages, device, strict=True):
            j = bisect.bisect_left(resident.logical, i)
            resident.logical.insert(j, i)
            seq.pages.insert(j, page)
            del resident.held[i]
            resident.used[i] = self.clock
        self.num_paged_in += len(pages)
        self._changed(seq)
        return len(pages)

    def _changed(self, seq: Sequence) -> None:
        """Rewrites `seq`'s table row after a move (its offset follows from `held`)."""
        resident = seq.resident
        if resident.held and max(resident.held) > resident.logical[-1]:
            raise ResidencyError(f"request {seq.seq_id}: its newest page left the device")
        self.scheduler.set_row(seq)
