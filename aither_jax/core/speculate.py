"""The speculative step: drafts for every decoding row (prompt lookup, a DFlash draft, or both),
one verify pass of the target over them, and the accepted tokens appended (device/verify.py
holds the acceptance rule; speculative/ the proposers)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from aither_jax.compile.buckets import bucket
from aither_jax.core.output import OutputProcessor
from aither_jax.core.runner import ModelRunner
from aither_jax.core.scheduler import Scheduler
from aither_jax.core.sequence import Sequence
from aither_jax.speculative.config import SpeculativeConfig
from aither_jax.speculative.dflash import DFlashProposer
from aither_jax.speculative.draft_length import DraftLength
from aither_jax.speculative.ngram import ngram_propose

Rows = list[tuple[Sequence, list[int]]]


class SpecCounters:
    """Speculative decoding counters (vLLM's names): verify passes that carried drafts, draft
    tokens proposed, draft tokens accepted, accepted per draft position; dflash with prompt
    lookup: rows whose drafts came from prompt lookup; per verify pass of a row (drafts or
    not), how many tokens it committed, 1 .. k + 1."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = np.zeros(num_speculative_tokens, np.int64)
        self.num_lookup_drafts = 0
        self.committed_hist = np.zeros(num_speculative_tokens + 2, np.int64)

    def stats(self, draft_length: DraftLength | None) -> dict:
        """vLLM's counters, tau (tokens committed per verify pass of a row, bonus included) and
        its histogram."""
        passes = int(self.committed_hist.sum())
        committed = int((self.committed_hist * np.arange(self.committed_hist.size)).sum())
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": self.accepted_per_pos.tolist(),
            "num_verify_passes": passes,
            "tau_mean": committed / passes if passes else 0.0,
            "tau_histogram": self.committed_hist.tolist(),
            # Adaptive drafts per step: how many steps ran each option (0 = a plain step).
            "draft_length_steps": None if draft_length is None else dict(draft_length.chosen),
            "num_lookup_drafts": self.num_lookup_drafts,
        }


class SpeculativeStep:
    """Runs one draft-and-verify step over the decoding rows."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        output: OutputProcessor,
        counters: SpecCounters,
        *,
        num_speculative_tokens: int,
    ):
        self.config, self.runner, self.scheduler, self.output = config, runner, scheduler, output
        self.counters = counters
        self.drafter: DFlashProposer | None = runner.drafter
        # Drafts per step chosen from measured acceptance and step times (`draft_length.py`).
        self.draft_length = DraftLength(num_speculative_tokens) if config.adaptive else None
        self._num_rows = 1  # the row bucket `choose_lookahead` chose for

    def choose_lookahead(self) -> None:
        """Before scheduling: sets the drafts this step's rows carry from measured acceptance
        and step times at the current batch size (adaptive configs only)."""
        if self.draft_length is not None:
            decoding = sum(not s.prefilling for s in self.scheduler.running)
            self._num_rows = bucket(max(decoding, 1), 1, self.runner.max_num_seqs)
            self.scheduler.lookahead = self.draft_length.choose(self._num_rows)

    def step(self, rows: Rows, plain: Callable[[Rows], None]) -> None:
        """Drafts and verifies `rows`; `plain` runs a plain decode step when nothing is drafted."""
        start = time.perf_counter()
        self._speculate(rows, plain)
        if self.draft_length is not None:
            self.draft_length.observe_step(self.scheduler.lookahead, self._num_rows, time.perf_counter() - start)

    def propose(self, rows: Rows) -> tuple[list[list[int]], list[list[int]] | None]:
        """Drafts for each decoding row, at most the row's lookahead, and with tree drafts
        each row's parents (`DFlashProposer.propose_tree`; chains for lookup rows), else None."""
        limits = [self.scheduler.num_lookahead(s) for s, _ in rows]
        spec = self.config
        lookup = None
        if self.drafter is None or spec.prompt_lookup:
            lookup = [
                ngram_propose(
                    s.token_slice(0, s.num_tokens), k, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max
                )
                if k
                else []
                for (s, _), k in zip(rows, limits, strict=True)
            ]
            if self.drafter is None:
                return lookup, None
            self.counters.num_lookup_drafts += sum(map(bool, lookup))
            if all(d or not k for d, k in zip(lookup, limits, strict=True)):
                return lookup, None  # every row has a match: the draft model has nothing to add
        self.runner.sync_tables()
        n = bucket(len(rows), 1, self.runner.max_num_seqs)
        ctx = np.zeros(n, np.int32)
        last = np.zeros(n, np.int32)
        slots = np.zeros(n, np.int32)
        for i, (s, toks) in enumerate(rows):
            ctx[i], last[i], slots[i] = s.num_cached, toks[-1], s.slot
        num_pages = self.runner.pages_to_read(self.scheduler.pages_needed(int(ctx.max()) + 1), n)
        self.runner.shapes.note("draft", warmed=False, rows=n, pages=num_pages)
        table = self.scheduler.block_tables[slots, :num_pages]
        if self.drafter.tree:
            trees = self.drafter.propose_tree(table, ctx, last, limits)
            out = []
            for (s, _), d, tree in zip(rows, lookup or [[]] * len(rows), trees, strict=True):
                if d:  # prompt lookup's chain
                    out.append((d, list(range(len(d)))))
                elif s.num_cached < self.runner.cache.num_sinks:  # sink tokens are stored by position: no tree
                    out.append(([], []))
                else:
                    out.append(tree)
            return [d for d, _ in out], [p for _, p in out]
        drafts = self.drafter.propose(table, ctx, last)
        drafts = [list(map(int, drafts[i, :k])) for i, k in enumerate(limits)]
        return (drafts if lookup is None else [a or b for a, b in zip(lookup, drafts, strict=True)]), None

    def _speculate(self, rows: Rows, plain: Callable[[Rows], None]) -> None:
        """One draft-and-verify step over every decoding row (a plain step at lookahead 0)."""
        c = self.counters
        drafts, parents = self.propose(rows) if self.scheduler.lookahead else ([[] for _ in rows], None)
        if not any(drafts):  # nothing to verify: a plain decode step (one token per row)
            plain(rows)
            c.committed_hist[1] += len(rows)
            return
        verify_rows = [(s, toks + d) for (s, toks), d in zip(rows, drafts, strict=True)]
        want_logprobs = any(s.num_logprobs is not None for s, _ in rows)
        tokens, batch, sampling, num_pages, greedy_only, _ = self.runner.pack(
            verify_rows, all_logits=True, min_tokens=2
        )
        tree = None
        if self.drafter is not None and self.drafter.tree:
            tree = chain_parents(*tokens.shape)
            for i, p in enumerate(parents or []):
                tree[i, 1 : 1 + len(p)] = p
        accepted, next_tokens, logits, path = self.runner.verify(
            tokens, batch, sampling, num_pages, greedy_only, want_logprobs, parents=tree
        )
        accepted, next_tokens = np.asarray(accepted), np.asarray(next_tokens)
        logits = None if logits is None else np.asarray(logits)
        proposed = [len(d) for d in drafts]  # tokens drafted per row (a tree's nodes)
        if path is not None:  # a tree's drafts along its accepted path, in order
            path = np.asarray(path)
            drafts = [list(map(int, tokens[i, path[i, 1:]])) if d else [] for i, d in enumerate(drafts)]
        for i, ((s, _), d) in enumerate(zip(rows, drafts, strict=True)):
            n = int(accepted[i])
            if d:
                c.num_drafts += 1
                c.num_draft_tokens += proposed[i]
                c.num_accepted_tokens += n
                c.accepted_per_pos[:n] += 1
                s.num_spec_steps += 1
                s.num_draft_tokens += proposed[i]
                s.num_accepted_tokens += n
                if self.draft_length is not None:
                    self.draft_length.observe_row(proposed[i], n)
            appended = self.output.append_tokens(
                s, [*d[:n], int(next_tokens[i])], None if logits is None else logits[i]
            )
            # The cache holds the last token and the accepted drafts that were kept.
            self.scheduler.computed(s, 1 + min(n, appended))
            c.committed_hist[appended] += 1


def chain_parents(num_rows: int, num_tokens: int) -> np.ndarray:
    """[num_rows, num_tokens] int32 parents of a chain (token i follows i - 1; -1 for the first)."""
    return np.tile(np.arange(-1, num_tokens - 1, dtype=np.int32), (num_rows, 1))
