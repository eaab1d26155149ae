"""The engine: runs the scheduler's plan on the device, one step at a time.

Each `step()` asks the scheduler (serving/scheduler.py) for a plan, makes the page copies it
asks for, then runs at most one decode call (every sequence that is generating) and one
prefill call (a chunk of every sequence still reading its prompt), samples, and hands the
results back. Sequences join and leave between steps without recompiling: every call is padded
to a bucket (powers of two) of rows, tokens per row and pages read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from aither_jax.compile import cache as compile_cache
from aither_jax.compile.buckets import bucket, page_bucket
from aither_jax.compile.code_maps import CodeMapBudget
from aither_jax.compile.counter import CompileCounter
from aither_jax.compile.step_jit import compile_workers
from aither_jax.core.scheduler import Scheduler
from aither_jax.core.sequence import Sequence
from aither_jax.device.sampling import SamplingBatch, SamplingParams
from aither_jax.device.steps import (
    copy_pages,
    decode_steps,
    forward_step,
    model_step,
    refill_sinks,
    top_log_probs,
    verify_step,
    write_step,
)
from aither_jax.speculative.config import SpeculativeConfig
from aither_jax.speculative.dflash import DFlashProposer
from aither_jax.speculative.draft_length import DraftLength
from aither_jax.speculative.ngram import ngram_propose
from models.config import ModelConfig
from models.kv_cache import init_cache
from models.kv_spec import MAX_SINK_TOKENS, parse_kv_spec
from models.kv_transform import load_key_transforms
from models.llama import ATTENTION_IMPLS, StepBatch
from models.tokenizer import Tokenizer
from models.weights import ModelWeights

log = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
# Pages a step reads per row are bucketed from MIN_PAGE_BUCKET up (few compiled shapes), or
# from MIN_WIDE_PAGE_BUCKET for steps of WIDE_STEP_ROWS rows or more, where every padding page
# read costs more (on 2 CPU cores ~8 ms a page at 16 rows of TurboQuant pages).
MIN_PAGE_BUCKET = 8
MIN_WIDE_PAGE_BUCKET = 4
WIDE_STEP_ROWS = 8
# Shared-prefix attention: a decode step whose rows all hold at least MIN_SHARED_PAGES common
# leading pages reads them once for the batch; the shared count is rounded down to a multiple
# of SHARED_PAGE_STEP to bound the number of compiled step shapes.
MIN_SHARED_PAGES = 32
SHARED_PAGE_STEP = 16
# The step calls a shape record names (`Engine.step_shapes`, `Engine.precompile`) and the
# fields that fix each one's compiled program (with the engine's own configuration):
# - forward: `forward_step` over [rows, tokens] (decode, or prefill chunks), its page reads,
#   which logits it returns ("none", "last", "all"), greedy-only sampling, the layers whose
#   hidden states it taps for a DFlash draft, and the pages it reads once for all rows;
# - steps: `decode_steps`, several decode steps in one call (num_scheduler_steps > 1);
# - verify: `verify_step` over [rows, tokens] of drafts (speculative decoding);
# - sinks: `refill_sinks` over [rows, tokens] (sink formats on prefix-cache hits);
# - copy: `copy_pages` of `pages` pages (prefix caching's copy on write);
# - draft: the DFlash draft's drafting call over [rows, pages] page tables.
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "forward": ("rows", "tokens", "pages", "logits", "greedy", "taps", "shared_pages"),
    "steps": ("rows", "pages", "greedy"),
    "verify": ("rows", "tokens", "pages", "logits", "greedy"),
    "sinks": ("rows", "tokens"),
    "copy": ("pages",),
    "draft": ("rows", "pages"),
}
RETURN_LOGITS = ("none", "last", "all")


class Engine:
    """Owns the device cache and runs the scheduler's sequences over it."""

    def __init__(
        self,
        weights: ModelWeights,
        cfg: ModelConfig,
        tokenizer: Tokenizer,
        *,
        max_num_seqs: int,
        max_model_len: int,
        num_pages: int,
        page_size: int = 16,
        max_prefill_chunk: int = 256,
        max_num_batched_tokens: int | None = None,
        kv_cache_dtype: str = "bf16",
        attention: str = "reference",
        enable_prefix_caching: bool | None = False,
        max_pinned_fraction: float = 0.5,
        cache_fill_value: float = 0.0,
        seed: int = 0,
        speculative: SpeculativeConfig | str | dict | None = None,
        model_name: str = "",
        shared_prefix_attention: bool = True,
        num_scheduler_steps: int = 1,
    ):
        max_num_batched_tokens = (
            max(max_prefill_chunk, max_num_seqs) if max_num_batched_tokens is None else max_num_batched_tokens
        )
        compile_cache.enable()
        for name, value, low in (
            ("max_num_seqs", max_num_seqs, 1),
            ("max_model_len", max_model_len, 1),
            ("num_pages", num_pages, 2),
            ("page_size", page_size, 1),
            ("max_prefill_chunk", max_prefill_chunk, 1),
            ("max_num_batched_tokens", max_num_batched_tokens, 1),
            ("num_scheduler_steps", num_scheduler_steps, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if max_model_len > cfg.max_context:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {cfg.max_context}")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        if page_size & (page_size - 1) or max_prefill_chunk & (max_prefill_chunk - 1):
            raise ValueError("page_size and max_prefill_chunk must be powers of two")
        self.weights = weights
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.max_prefill_chunk = max_prefill_chunk
        self.attention = attention
        self.max_pages_per_seq = -(-max_model_len // page_size)
        key_transform = None
        if parse_kv_spec(kv_cache_dtype).precondition:
            key_transform = load_key_transforms(model_name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.cache = init_cache(
            cfg,
            num_pages=num_pages,
            max_seqs=max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
            page_size=page_size,
            kv_cache_dtype=kv_cache_dtype,
            fill_value=cache_fill_value,
            key_transform=key_transform,
        )
        if enable_prefix_caching is None:
            enable_prefix_caching = True
        self.scheduler = Scheduler(
            num_pages=num_pages,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
            max_prefill_chunk=max_prefill_chunk,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            max_pinned_fraction=max_pinned_fraction,
            sink_tokens=self.cache.num_sinks,
            min_token_bucket=MIN_TOKEN_BUCKET,
        )
        self.speculative = SpeculativeConfig.parse(speculative)
        self.drafter: DFlashProposer | None = None
        if self.speculative is not None and self.speculative.method == "dflash":
            self.drafter = DFlashProposer(
                self.speculative,
                cfg,
                model_name=model_name,
                embed=weights.embed,
                lm_head=weights.lm_head,
                num_pages=num_pages,
                page_size=page_size,
                kernels=self.speculative.draft_kernels,
            )
            self.num_speculative_tokens = self.drafter.num_speculative_tokens
        elif self.speculative is not None:
            self.num_speculative_tokens = self.speculative.num_speculative_tokens or 8
        else:
            self.num_speculative_tokens = 0
        if num_scheduler_steps > 1 and self.speculative is not None:
            raise ValueError("num_scheduler_steps > 1 runs plain decode steps; it cannot be combined with speculative")
        # Decode steps per call when only decoding is left to do (`_decode_steps`): the
        # scheduler reserves pages for the extra tokens as it does for drafts.
        self.num_scheduler_steps = num_scheduler_steps
        self.num_multi_steps = 0  # `decode_steps` calls that ran more than one step
        self.num_lookahead_tokens = self.num_speculative_tokens or num_scheduler_steps - 1
        self.scheduler.lookahead = self.num_lookahead_tokens
        # Drafts per step chosen from measured acceptance and step times (`draft_length.py`).
        self.draft_length = (
            DraftLength(self.num_speculative_tokens) if self.speculative and self.speculative.adaptive else None
        )
        self._taps = self.drafter.taps if self.drafter else ()
        # Speculative decoding counters (vLLM's names): verify passes that carried drafts,
        # draft tokens proposed, draft tokens accepted, accepted per draft position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = np.zeros(self.num_speculative_tokens, np.int64)
        # dflash with prompt_lookup: rows whose drafts came from prompt lookup.
        self.num_lookup_drafts = 0
        # Per verify pass of a row (drafts or not): how many tokens it committed, 1 .. k + 1.
        self.committed_hist = np.zeros(self.num_speculative_tokens + 2, np.int64)
        # Decode steps whose rows share cached prefix pages read them once for the whole batch
        # (see `models.llama.forward`); counted in num_shared_prefix_steps. Not with sliding-
        # window layers (Gemma), whose shared part would need the window too.
        self.shared_prefix_attention = bool(shared_prefix_attention) and not cfg.window_layers
        self.num_shared_prefix_steps = 0
        # Slots admitted on cached pages whose sink tokens were recomputed (-s<n> formats).
        self.num_sink_refills = 0
        self._rng = np.random.default_rng(seed)
        self._next_id = 0
        # Every step shape run or precompiled, by `_shape_key` (records as `step_shapes` gives).
        self._shapes: dict[tuple, dict[str, Any]] = {}
        # Called with each shape record the first time a step of that shape runs (a server
        # appends it to its step-shapes file); not for shapes that `precompile` compiled.
        self.on_new_shape: Callable[[dict[str, Any]], None] | None = None
        self.warmed_up = False
        self.num_steps = 0
        # Compiled code is dropped when it nears the process's mapping limit (code_maps.py).
        self.code_budget = CodeMapBudget()
        # With `record`: (taps, top_k) of the calls over requests, and what they kept by request.
        self._recording: tuple[tuple[int, ...], int] | None = None
        self._records: dict[int, TapRecord] = {}

    # -- requests ---------------------------------------------------------------------------

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int | None = None) -> None:
        """Raises ValueError (naming the limit) if a prompt of this length cannot be served."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens and at least one must be left to generate."
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens."
            )

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        salt: bytes = b"",
        pin_tokens: int = 0,
        num_logprobs: int | None = None,
    ) -> Sequence:
        """Queues a tokenized prompt. Raises ValueError if it can never fit.

        Args:
            salt: root of the prefix-cache names (the tenant); only equal salts share pages.
            pin_tokens: pin the cached pages of this many leading prompt tokens once computed.
            num_logprobs: None for no log-probabilities, else how many top alternatives to
                record beside each sampled token's.
        """
        params.validate(self.cfg.vocab_size)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        self.check_prompt(len(prompt_ids))
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        usable = self.scheduler.num_usable_pages
        if self.scheduler.pages_needed(len(prompt_ids) + max_tokens) > usable:
            raise ValueError(
                f"the request needs {self.scheduler.pages_needed(len(prompt_ids) + max_tokens)} KV pages but the "
                f"cache has {usable}; lower max_tokens or raise num_pages"
            )
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.stop_token_ids)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        seq = Sequence(
            self._next_id,
            [int(t) for t in prompt_ids],
            params,
            seed,
            max_tokens,
            frozenset(stop_ids),
            salt=salt,
            pin_tokens=min(int(pin_tokens), len(prompt_ids)),
            num_logprobs=num_logprobs,
        )
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seq: Sequence) -> None:
        """Stops a request and returns its slot and pages."""
        self.scheduler.abort(seq)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Runs one scheduled step; returns the sequences that finished in it."""
        self.code_budget.release_after_compiles()
        if self.draft_length is not None:
            decoding = sum(not s.prefilling for s in self.scheduler.running)
            rows = bucket(max(decoding, 1), 1, self.max_num_seqs)
            self.scheduler.lookahead = self.draft_length.choose(rows)
        plan = self.scheduler.schedule()
        if plan.copies:
            self._copy_pages(plan.copies)
        if plan.sink_refills:
            self._refill_sinks(plan.sink_refills)
        if plan.decode and self.speculative is not None:
            start = time.perf_counter()
            self._speculate(plan.decode)
            if self.draft_length is not None:
                self.draft_length.observe_step(self.scheduler.lookahead, rows, time.perf_counter() - start)
        elif plan.decode and self._fused_decode(plan.decode):
            # Several steps when nothing else waits for the device (no prefill chunk, no
            # request waiting for a slot), so no one's first token is delayed.
            self._decode_steps(plan.decode, several=not plan.prefill and not self.scheduler.waiting)
        elif plan.decode:
            self._decode(plan.decode)
        if plan.prefill:
            self._decode(plan.prefill)
        self.num_steps += 1
        return self.scheduler.finish()

    def _decode(self, rows: list[tuple[Sequence, list[int]]]) -> None:
        """One call over (sequence, new tokens) rows (decode or prefill chunks); samples the
        next token of every row that has run all its pending tokens."""
        want_logprobs = any(s.num_logprobs is not None for s, _ in rows)
        taps, top_k = self._recording or (self._taps, 0)
        next_tokens, logits, hidden, batch = self._run(
            rows, return_logits="last" if want_logprobs or top_k else "none", taps=taps, host_logits=not top_k
        )
        if self._recording is not None:
            self._keep_record(rows, hidden, logits, top_k)
            logits = np.asarray(logits) if want_logprobs else None
        self._write_draft_context(hidden, batch)
        for i, ((s, toks), tok) in enumerate(zip(rows, next_tokens, strict=True)):
            self.scheduler.computed(s, len(toks))
            if s.num_pending == 0:
                self._append(s, int(tok), None if logits is None else logits[i])

    def _fused_decode(self, rows: list[tuple[Sequence, list[int]]]) -> bool:
        """Whether decode rows run through `decode_steps` (with num_scheduler_steps > 1): rows
        of one pending token each, none of which wants log probabilities (they need the
        step's logits)."""
        return self.num_scheduler_steps > 1 and all(s.num_logprobs is None and len(t) == 1 for s, t in rows)

    def _decode_steps(self, rows: list[tuple[Sequence, list[int]]], *, several: bool) -> None:
        """One `decode_steps` call over decode rows: with `several`, each row takes as many
        steps as the pages reserved for it allow (its lookahead + 1), otherwise one."""
        limits = [1 + self.scheduler.num_lookahead(s) if several else 1 for s, _ in rows]
        tokens, batch, sampling, num_pages, greedy_only, _ = self._pack(rows, all_logits=False, later=max(limits) - 1)
        padded = np.zeros(tokens.shape[0], np.int32)
        padded[: len(rows)] = limits
        out = np.asarray(self._steps(tokens, batch, sampling, padded, num_pages, greedy_only))
        self.num_multi_steps += max(limits) > 1
        for i, (s, _) in enumerate(rows):
            appended = self._append_tokens(s, out[i, : limits[i]].tolist())
            # The cache holds the row's last token and the sampled tokens fed back after it.
            self.scheduler.computed(s, appended)

    def _steps(self, tokens, batch, sampling, limits, num_pages: int, greedy_only: bool):
        """Runs `decode_steps`; returns its tokens [B, num_scheduler_steps] (a device array)."""
        self._note_shape("steps", warmed=True, rows=tokens.shape[0], pages=num_pages, greedy=greedy_only)
        args, static = self._steps_args(tokens, batch, sampling, limits, num_pages, greedy_only)
        out, self.cache = decode_steps(*args, **static)
        return out

    def _forward_args(
        self, tokens, batch, sampling, num_pages: int, return_logits: str, greedy_only: bool, *, taps=(), shared_pages=0
    ) -> tuple[tuple, dict]:
        static = dict(num_pages=num_pages, return_logits=return_logits, greedy_only=greedy_only)
        return self._step_args(tokens, batch, sampling, taps=taps, shared_pages=shared_pages, **static)

    def _steps_args(self, tokens, batch, sampling, limits, num_pages: int, greedy_only: bool) -> tuple[tuple, dict]:
        static = dict(num_pages=num_pages, greedy_only=greedy_only, num_steps=self.num_scheduler_steps)
        return self._step_args(tokens, batch, sampling, limits, **static)

    def _verify_args(
        self, tokens, batch, sampling, num_pages: int, greedy_only: bool, return_logits: bool, parents=None
    ) -> tuple[tuple, dict]:
        static = dict(num_pages=num_pages, greedy_only=greedy_only, return_logits=return_logits, parents=parents)
        return self._step_args(tokens, batch, sampling, taps=self._taps, **static)

    def _propose(self, rows: list[tuple[Sequence, list[int]]]) -> tuple[list[list[int]], list[list[int]] | None]:
        """Drafts for each decoding row, at most the row's lookahead, and with tree drafts
        each row's parents (`DFlashProposer.propose_tree`; chains for lookup rows), else None."""
        limits = [self.scheduler.num_lookahead(s) for s, _ in rows]
        spec = self.speculative
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
            self.num_lookup_drafts += sum(map(bool, lookup))
            if all(d or not k for d, k in zip(lookup, limits, strict=True)):
                return lookup, None  # every row has a match: the draft model has nothing to add
        self._sync_tables()
        n = bucket(len(rows), 1, self.max_num_seqs)
        ctx = np.zeros(n, np.int32)
        last = np.zeros(n, np.int32)
        slots = np.zeros(n, np.int32)
        for i, (s, toks) in enumerate(rows):
            ctx[i], last[i], slots[i] = s.num_cached, toks[-1], s.slot
        num_pages = self._pages_to_read(self.scheduler.pages_needed(int(ctx.max()) + 1), n)
        self._note_shape("draft", warmed=False, rows=n, pages=num_pages)
        table = self.scheduler.block_tables[slots, :num_pages]
        if self.drafter.tree:
            trees = self.drafter.propose_tree(table, ctx, last, limits)
            out = []
            for (s, _), d, tree in zip(rows, lookup or [[]] * len(rows), trees, strict=True):
                if d:  # prompt lookup's chain
                    out.append((d, list(range(len(d)))))
                elif s.num_cached < self.cache.num_sinks:  # sink tokens are stored by position: no tree
                    out.append(([], []))
                else:
                    out.append(tree)
            return [d for d, _ in out], [p for _, p in out]
        drafts = self.drafter.propose(table, ctx, last)
        drafts = [list(map(int, drafts[i, :k])) for i, k in enumerate(limits)]
        return (drafts if lookup is None else [a or b for a, b in zip(lookup, drafts, strict=True)]), None

    def _speculate(self, rows: list[tuple[Sequence, list[int]]]) -> None:
        """One draft-and-verify step over every decoding row (a plain step at lookahead 0)."""
        drafts, parents = self._propose(rows) if self.scheduler.lookahead else ([[] for _ in rows], None)
        if not any(drafts):  # nothing to verify: a plain decode step (one token per row)
            self._decode(rows)
            self.committed_hist[1] += len(rows)
            return
        verify_rows = [(s, toks + d) for (s, toks), d in zip(rows, drafts, strict=True)]
        want_logprobs = any(s.num_logprobs is not None for s, _ in rows)
        tokens, batch, sampling, num_pages, greedy_only, _ = self._pack(verify_rows, all_logits=True, min_tokens=2)
        tree = None
        if self.drafter is not None and self.drafter.tree:
            tree = chain_parents(*tokens.shape)
            for i, p in enumerate(parents or []):
                tree[i, 1 : 1 + len(p)] = p
        accepted, next_tokens, logits, path = self._verify(
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
                self.num_drafts += 1
                self.num_draft_tokens += proposed[i]
                self.num_accepted_tokens += n
                self.accepted_per_pos[:n] += 1
                s.num_spec_steps += 1
                s.num_draft_tokens += proposed[i]
                s.num_accepted_tokens += n
                if self.draft_length is not None:
                    self.draft_length.observe_row(proposed[i], n)
            appended = self._append_tokens(s, [*d[:n], int(next_tokens[i])], None if logits is None else logits[i])
            # The cache holds the last token and the accepted drafts that were kept.
            self.scheduler.computed(s, 1 + min(n, appended))
            self.committed_hist[appended] += 1

    def _verify(self, tokens, batch, sampling, num_pages: int, greedy_only: bool, return_logits: bool, parents=None):
        """The target's verify pass over [last, drafts] rows (a tree per row with `parents`),
        its cache write and the draft context write: (accepted counts, next tokens, logits or
        None, the accepted path of each tree or None)."""
        rows, num_tokens = tokens.shape
        self._note_shape(
            "verify", warmed=not return_logits, rows=rows, tokens=num_tokens, pages=num_pages, logits=return_logits,
            greedy=greedy_only,
        )  # fmt: skip
        args, static = self._verify_args(tokens, batch, sampling, num_pages, greedy_only, return_logits, parents)
        accepted, next_tokens, logits, update, hidden, path = verify_step(*args, **static)
        self.cache = write_step(self.cache, update)
        self._write_draft_context(hidden, batch)
        return accepted, next_tokens, logits, path

    def _write_draft_context(self, hidden, batch: StepBatch) -> None:
        """Feeds a target call's tapped hidden states to the DFlash draft's context cache."""
        if self.drafter is not None:
            self.drafter.write(hidden, self.cache.block_tables, batch.slots, batch.start, batch.num_new)

    def spec_stats(self) -> dict:
        """Speculative decoding so far: vLLM's counters, tau (tokens committed per verify pass
        of a row, bonus included) and its histogram."""
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
            "draft_length_steps": None if self.draft_length is None else dict(self.draft_length.chosen),
            "num_lookup_drafts": self.num_lookup_drafts,
        }

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        n = bucket(len(copies), 4, max(4, self.scheduler.num_usable_pages + 1))
        self._note_shape("copy", warmed=False, pages=n)
        src = np.zeros(n, np.int32)  # padding copies the null page onto itself
        dst = np.zeros(n, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.cache = copy_pages(self.cache, src, dst)
        if self.drafter is not None:
            self.drafter.copy_pages(src, dst)
        self.scheduler.copies_done(copies)

    def _refill_sinks(self, rows: list[tuple[Sequence, list[int]]]) -> None:
        """Fills the sink buffers of slots admitted on cached pages (`steps.refill_sinks`)."""
        num_rows = bucket(len(rows), 1, self.max_num_seqs)
        tokens = np.zeros((num_rows, bucket(self.cache.num_sinks, MIN_TOKEN_BUCKET, MAX_SINK_TOKENS)), np.int32)
        slots = np.full(num_rows, self.max_num_seqs, np.int32)  # padding rows: writes dropped
        num_new = np.zeros(num_rows, np.int32)
        for i, (s, toks) in enumerate(rows):
            tokens[i, : len(toks)], slots[i], num_new[i] = toks, s.slot, len(toks)
        self._note_shape("sinks", warmed=False, rows=num_rows, tokens=tokens.shape[1])
        batch = StepBatch(slots, np.zeros(num_rows, np.int32), num_new)
        self.cache = refill_sinks(
            self.weights, self.cache, tokens, batch, cfg=self.cfg, num_pages=0, attention=self.attention
        )
        self.num_sink_refills += len(rows)

    def _append_tokens(self, seq: Sequence, tokens: list[int], logits: np.ndarray | None = None) -> int:
        """Appends `tokens` (with logits [len, V] for log probabilities) until `seq` finishes;
        returns how many it took."""
        for j, token in enumerate(tokens):
            self._append(seq, int(token), None if logits is None else logits[j])
            if seq.finished:
                return j + 1
        return len(tokens)

    def _append(self, seq: Sequence, token: int, logits: np.ndarray | None) -> None:
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.num_logprobs is not None and logits is not None:
            seq.logprobs.append(top_logprobs(logits, token, seq.num_logprobs))
        stops = seq.params.stop_strings
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
        elif stops:
            text = self.tokenizer.decode(seq.output_ids)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                seq.text = text[: min(hits)]
                seq.finish_reason = "stop"
                return
        if seq.finish_reason is None and len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            seq.text = self.tokenizer.decode(seq.output_ids)

    def _pages_to_read(self, needed: int, num_rows: int) -> int:
        """Pages per row a step over `num_rows` (padded) rows reads when its longest row needs
        `needed`: the page bucket, from MIN_WIDE_PAGE_BUCKET up for wide steps."""
        minimum = MIN_WIDE_PAGE_BUCKET if num_rows >= WIDE_STEP_ROWS else MIN_PAGE_BUCKET
        return page_bucket(needed, minimum, self.max_pages_per_seq)

    def _sync_tables(self) -> None:
        if self.scheduler.tables_dirty:
            self.cache = self.cache.replace(block_tables=jax.device_put(self.scheduler.block_tables))
            self.scheduler.tables_dirty = False

    def _pack(
        self,
        rows: list[tuple[Sequence, list[int]]],
        *,
        all_logits: bool,
        min_tokens: int = MIN_TOKEN_BUCKET,
        share_prefix: bool = False,
        later: int = 0,
    ):
        """Pads (sequence, new tokens) rows to a bucketed batch: (tokens, StepBatch,
        SamplingBatch, pages to read per row, whether every row is greedy, shared pages read
        once for the batch: 0 unless `share_prefix` and `_shared_pages` finds some). The pages
        also cover `later` tokens past the new ones (steps fused into the same call)."""
        self._sync_tables()
        num_rows = bucket(len(rows), 1, self.max_num_seqs)
        longest = max(len(toks) for _, toks in rows)
        num_tokens = 1 if longest == 1 and not all_logits else bucket(longest, min_tokens, self.max_prefill_chunk)
        shared = self._shared_pages(rows) if share_prefix and num_tokens == 1 else 0
        if num_tokens > 1 and all(s.num_cached == 0 for s, _ in rows):
            num_pages = 0  # fresh prompts: nothing stored yet, so attention reads no pages
        else:
            end = max(s.num_cached + len(toks) for s, toks in rows) + later
            num_pages = self._pages_to_read(self.scheduler.pages_needed(end) - shared, num_rows)
        tokens = np.zeros((num_rows, num_tokens), np.int32)
        slots = np.full(num_rows, self.max_num_seqs, np.int32)  # padding rows: out-of-range slot, writes dropped
        start = np.zeros(num_rows, np.int32)
        num_new = np.zeros(num_rows, np.int32)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        for i, (s, toks) in enumerate(rows):
            tokens[i, : len(toks)] = toks
            slots[i], start[i], num_new[i] = s.slot, s.num_cached, len(toks)
            temperature[i], top_k[i], top_p[i] = s.params.temperature, s.params.top_k, s.params.top_p
            seeds[i] = s.seed
        # numpy inputs go straight to the jitted step, whose C++ dispatch path transfers them
        # (a Python device_put per array cost ~0.25 ms each, several per decode step).
        batch = StepBatch(slots, start, num_new)
        sampling = SamplingBatch(temperature, top_k, top_p, seeds)
        return tokens, batch, sampling, num_pages, bool(np.all(temperature == 0)), shared

    def _shared_pages(self, rows: list[tuple[Sequence, list[int]]]) -> int:
        """Leading block-table pages that every row holds and has fully stored (prefix-cache
        hits shared by all rows), rounded down to SHARED_PAGE_STEP; 0 below MIN_SHARED_PAGES
        or the sink tokens' pages, for a single row, or when shared-prefix attention is off."""
        if not self.shared_prefix_attention or len(rows) < 2:
            return 0
        full = min(s.num_cached for s, _ in rows) // self.page_size
        if full < MIN_SHARED_PAGES:
            return 0
        tables = self.scheduler.block_tables[[s.slot for s, _ in rows], :full]
        same = np.all(tables == tables[:1], axis=0)
        common = full if same.all() else int(np.argmin(same))
        shared = common // SHARED_PAGE_STEP * SHARED_PAGE_STEP
        return shared if shared >= MIN_SHARED_PAGES and shared * self.page_size >= self.cache.num_sinks else 0

    def _run(
        self,
        rows: list[tuple[Sequence, list[int]]],
        *,
        return_logits: str,
        taps: tuple[int, ...] = (),
        host_logits: bool = True,
    ) -> tuple[np.ndarray, Any, Any, StepBatch]:
        """One padded call of the jitted step over (sequence, new tokens) rows: (next tokens,
        logits by `return_logits` (a device array unless `host_logits`), tapped hidden states
        or None, the padded batch)."""
        tokens, batch, sampling, num_pages, greedy_only, shared = self._pack(
            rows, all_logits=return_logits == "all", share_prefix=True
        )
        next_tokens, logits, hidden = self._dispatch(
            tokens, batch, sampling, num_pages, return_logits, greedy_only, taps=taps, shared_pages=shared
        )
        if logits is not None and host_logits:
            logits = np.asarray(logits)
        return np.asarray(next_tokens)[: len(rows)], logits, hidden, batch

    def _dispatch(
        self, tokens, batch, sampling, num_pages: int, return_logits: str, greedy_only: bool, *, taps=(), shared_pages=0
    ):
        num_rows, num_tokens = tokens.shape
        # Shared-prefix shapes depend on the prompts: warm-up leaves them to first use.
        self._note_shape(
            "forward", warmed=num_tokens == 1 and return_logits == "none" and not shared_pages, rows=num_rows,
            tokens=num_tokens, pages=num_pages, logits=return_logits, greedy=greedy_only, taps=taps,
            shared_pages=shared_pages,
        )  # fmt: skip
        self.num_shared_prefix_steps += bool(shared_pages)
        args, static = self._forward_args(
            tokens, batch, sampling, num_pages, return_logits, greedy_only, taps=taps, shared_pages=shared_pages
        )
        next_tokens, logits, self.cache, hidden = model_step(*args, **static)
        return next_tokens, logits, hidden

    def _step_args(self, tokens, batch, sampling, *more, **static) -> tuple[tuple, dict]:
        """The (positional, keyword) arguments of a step function's call (`forward_step`,
        `verify_step`, `decode_steps`): the weights, the cache and the call's own inputs;
        its static arguments with the model's config and attention path added."""
        return (self.weights, self.cache, tokens, batch, sampling, *more), dict(
            static, cfg=self.cfg, attention=self.attention
        )

    def _note_shape(self, kind: str, *, warmed: bool, **fields: Any) -> None:
        """Records a step shape (`shape_record(kind, **fields)`); warns when warm-up should have
        compiled it (`warmed`) and did not; tells `on_new_shape` about a shape not seen before."""
        record = shape_record(kind, **fields)
        key = _shape_key(record)
        if key in self._shapes:
            return
        if self.warmed_up and warmed:
            log.warning("step shape %s was not compiled during warm-up: this step compiles", record)
        self._shapes[key] = record
        if self.on_new_shape is not None:
            self.on_new_shape(dict(record))

    def step_shapes(self) -> list[dict[str, Any]]:
        """The step shapes this engine has run or precompiled, in first-seen order: one record
        (a JSON-able dict, `SHAPE_FIELDS`) per compiled program. `precompile` takes them, in
        this process or in the next one (`aither_jax.compile.shape_file`)."""
        return [dict(r) for r in self._shapes.values()]

    def warmup(
        self, max_len: int | None = None, *, sampling: bool = True, progress: bool = False, workers: int | None = None
    ) -> int:
        """Compiles every decode shape for sequences up to `max_len` tokens.

        Covers each batch bucket (1, 2, 4, .. max_num_seqs) times each of its page buckets
        (`_pages_to_read`) up to `max_len` (default max_model_len), greedy
        and, with `sampling`, sampled. With
        speculative decoding each such shape also compiles the verify pass over the draft block,
        the draft context write and (DFlash) the drafting call. The calls run on padding rows
        only, which write to the null page and change nothing. Afterwards a decode step with a
        shape outside this set logs a warning. Code compiled before the warm-up that already nears
        the process's memory-mapping limit is dropped first; the warm-up stops early, with a
        warning, once its own shapes near it (aither_jax/code_maps.py). Returns the number of
        shapes compiled.

        The target's step calls compile on `workers` threads first (`_precompile`; default
        `step_jit.compile_workers()`, 1 compiles each call when it first runs).
        """
        max_len = self.max_model_len if max_len is None else max_len
        if not 1 <= max_len <= self.max_model_len:
            raise ValueError(f"max_len must be in [1, {self.max_model_len}], got {max_len}")
        workers = compile_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        rows = sorted({bucket(n, 1, self.max_num_seqs) for n in range(1, self.max_num_seqs + 1)})
        max_pages = self.scheduler.pages_needed(max_len + self.num_lookahead_tokens)  # page_bucket() caps it
        pages = {r: sorted({self._pages_to_read(n, r) for n in range(1, max_pages + 1)}) for r in rows}
        shapes = [(r, p, g) for r in rows for p in pages[r] for g in ((True, False) if sampling else (True,))]
        # Code compiled for earlier shapes (another configuration's, say) that already holds the
        # budget is dropped first, so the warm-up stops only when its own shapes fill it
        # (`precompile` makes that check itself).
        if workers > 1:
            self._precompile(shapes, workers, progress)
        else:
            self.code_budget.release_if_over()
        done, tokens = 0, None
        for num_rows, num_pages, greedy_only in tqdm(shapes, desc="compiling decode steps", disable=not progress):
            if self.code_budget.over():
                log.warning(
                    "warm-up stopped after %d of %d shapes: their code nears the memory-mapping limit "
                    "(vm.max_map_count = %s); the rest compile on first use",
                    done,
                    len(shapes),
                    self.code_budget.limit,
                )
                break
            tokens, batch, params = self._padding_rows(num_rows, greedy_only)
            if self.num_scheduler_steps > 1:
                tokens = self._steps(tokens, batch, params, np.zeros(num_rows, np.int32), num_pages, greedy_only)
            else:
                tokens, _, hidden = self._dispatch(
                    tokens, batch, params, num_pages, "none", greedy_only, taps=self._taps
                )
                self._write_draft_context(hidden, batch)
            if self.num_speculative_tokens:
                self._warm_speculative(batch, params, num_pages, greedy_only)
            done += 1
        if tokens is not None:
            tokens.block_until_ready()
        self.warmed_up = True
        return done

    def _padding_rows(
        self, num_rows: int, greedy_only: bool, num_tokens: int = 1
    ) -> tuple[np.ndarray, StepBatch, SamplingBatch]:
        """A call's inputs on `num_rows` padding rows (out-of-range slots, so nothing is
        written): tokens [num_rows, num_tokens], the batch and greedy or sampled parameters."""
        zeros = np.zeros(num_rows, np.int32)
        batch = StepBatch(np.full(num_rows, self.max_num_seqs, np.int32), zeros, zeros)
        temperature = np.full(num_rows, 0.0 if greedy_only else 1.0, np.float32)
        params = SamplingBatch(temperature, zeros, np.ones(num_rows, np.float32), zeros.astype(np.uint32))
        return np.zeros((num_rows, num_tokens), np.int32), batch, params

    def _verify_shapes(self, num_rows: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The verify passes a decode shape of `num_rows` rows may need: (tokens, tree parents or
        None) for every token bucket, since drafts may come short (a request near max_tokens,
        prompt lookup). Empty without speculative decoding."""
        if not self.num_speculative_tokens:
            return []
        buckets = {bucket(n, 2, self.max_prefill_chunk) for n in range(2, self.num_speculative_tokens + 2)}
        tree = self.drafter is not None and self.drafter.tree
        return [
            (np.zeros((num_rows, t), np.int32), chain_parents(num_rows, t) if tree else None) for t in sorted(buckets)
        ]

    def _precompile(self, shapes: list[tuple[int, int, bool]], workers: int, progress: bool) -> None:
        """Compiles the calls of the warm-up `shapes` (rows, pages, greedy only) on `workers`
        threads: each shape's decode step (`decode_steps` with num_scheduler_steps > 1), its
        cache writes and, with speculative decoding, its verify passes and (DFlash) the
        drafting call and the draft's context writes."""
        records = []
        for num_rows, num_pages, greedy_only in shapes:
            common = dict(rows=num_rows, pages=num_pages, greedy=greedy_only)
            if self.num_scheduler_steps > 1:
                records.append(shape_record("steps", **common))
                continue
            records.append(shape_record("forward", **common, tokens=1, logits="none", taps=self._taps, shared_pages=0))
            if self.drafter is not None and greedy_only:  # drafting does not depend on sampling
                records.append(shape_record("draft", rows=num_rows, pages=num_pages))
            for tokens, _ in self._verify_shapes(num_rows):
                records.append(shape_record("verify", **common, tokens=tokens.shape[1], logits=False))
        self.precompile(records, workers=workers, progress=progress)

    def precompile(
        self, shapes: Iterable[dict[str, Any]], *, workers: int | None = None, progress: bool = False
    ) -> int:
        """Compiles step shapes before any request needs them, on `workers` threads (default
        `step_jit.compile_workers()`): records as `step_shapes` gives them, typically an
        earlier run's (`aither_jax.compile.shape_file`; `serve --compile-shapes`).

        Each record's call is lowered on this thread, on padding inputs of its shape, and
        compiled in a thread pool (XLA's backend compilation releases the GIL; on the H200's
        host a step shape takes ~13 s, almost all of it there). The executables land in JAX's
        in-memory cache under the keys that the real calls of the same shapes then find.
        Forward and verify records compile their cache writes too. A record this engine cannot
        run (more rows than max_num_seqs, more pages than a sequence holds, fused steps when
        num_scheduler_steps is 1, ...) is skipped with a warning. Raises ValueError for a
        malformed record. Returns the number of records compiled.
        """
        workers = compile_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        records = [_checked_shape(i, r) for i, r in enumerate(shapes)]
        usable = []
        for record in records:
            why = self._unfit(record)
            if why:
                log.warning("step shape %s skipped: %s", record, why)
            else:
                usable.append(record)
        writes: set[str] = set()
        done = 0
        self.code_budget.release_if_over()  # earlier shapes' code does not stop this one
        bar = tqdm(total=0, desc=f"compiling steps ({workers} threads)", disable=not progress)
        with ThreadPoolExecutor(workers, thread_name_prefix="aither-compile") as pool:
            futures = []

            def submit(lowered) -> None:
                bar.total += 1
                bar.refresh()
                futures.append(pool.submit(lowered.compile))
                futures[-1].add_done_callback(lambda _: bar.update())

            for record in usable:
                if self.code_budget.over():
                    log.warning(
                        "precompile stopped after %d of %d shapes: their code nears the memory-mapping limit "
                        "(vm.max_map_count = %s); the rest compile on first use",
                        done,
                        len(usable),
                        self.code_budget.limit,
                    )
                    break
                lowered, update, hidden = self._lower_shape(record)
                submit(lowered)
                if update is not None:
                    key = str(jax.tree.map(lambda a: (a.shape, a.dtype), update))
                    if key not in writes:
                        writes.add(key)
                        submit(write_step.lower(self.cache, update))
                if hidden is not None and self.drafter is not None:  # the draft context write
                    key = f"draft {hidden.shape}"
                    if key not in writes:
                        writes.add(key)
                        submit(self.drafter.lower_write(hidden, self.cache.block_tables, record["rows"]))
                self._shapes.setdefault(_shape_key(record), record)
                done += 1
            for future in futures:
                future.result()
        bar.close()
        return done

    def _unfit(self, record: dict[str, Any]) -> str | None:
        """Why this engine cannot run a (well-formed) shape record, or None if it can."""
        kind = record["kind"]
        rows = record.get("rows", 1)
        if rows != bucket(rows, 1, self.max_num_seqs):
            return f"rows must be a power of two (or max_num_seqs) up to max_num_seqs {self.max_num_seqs}"
        longest = MAX_SINK_TOKENS if kind == "sinks" else self.max_prefill_chunk
        if record.get("tokens", 1) > longest:
            return f"more than {longest} tokens per row"
        pages = record.get("pages", 0)
        if kind != "copy" and pages + record.get("shared_pages", 0) > self.max_pages_per_seq:
            return f"more pages than a sequence holds ({self.max_pages_per_seq})"
        if kind == "copy" and pages > self.scheduler.num_usable_pages + 1:
            return f"more page copies than pages ({self.scheduler.num_usable_pages})"
        if kind == "steps" and self.num_scheduler_steps == 1:
            return "fused decode steps need num_scheduler_steps > 1"
        if kind == "verify" and not self.num_speculative_tokens:
            return "verify passes need speculative decoding"
        if kind == "draft" and self.drafter is None:
            return "drafting calls need a DFlash draft"
        if kind == "sinks" and not self.cache.num_sinks:
            return "the KV cache format keeps no sink tokens"
        if kind == "forward" and any(i >= self.cfg.num_layers for i in record["taps"]):
            return f"taps {record['taps']} are not layers of this model (0 to {self.cfg.num_layers - 1})"
        if kind == "forward" and record["shared_pages"] and not self.shared_prefix_attention:
            return "shared-prefix attention is off"
        return None

    def _lower_shape(self, record: dict[str, Any]) -> tuple[Any, Any, Any]:
        """A shape record's call lowered on padding inputs (rows on out-of-range slots, so
        nothing is written): (the lowered call, the cache update it returns for `write_step`
        or None, the tapped hidden states it returns for the draft's context write or None)."""
        kind = record["kind"]
        if kind == "copy":
            zeros = np.zeros(record["pages"], np.int32)
            return copy_pages.lower(self.cache, zeros, zeros), None, None
        if kind == "draft":
            return self.drafter.lower_propose(record["rows"], record["pages"]), None, None
        num_rows = record["rows"]
        tokens, batch, params = self._padding_rows(num_rows, record.get("greedy", True), record.get("tokens", 1))
        if kind == "sinks":
            lowered = refill_sinks.lower(
                self.weights, self.cache, tokens, batch, cfg=self.cfg, num_pages=0, attention=self.attention
            )
            return lowered, None, None
        if kind == "steps":
            limits = np.zeros(num_rows, np.int32)
            args, static = self._steps_args(tokens, batch, params, limits, record["pages"], record["greedy"])
            return decode_steps.lower(*args, **static), None, None
        if kind == "verify":
            parents = chain_parents(*tokens.shape) if self.drafter is not None and self.drafter.tree else None
            args, static = self._verify_args(
                tokens, batch, params, record["pages"], record["greedy"], record["logits"], parents
            )
            lowered = verify_step.lower(*args, **static)
            return lowered, lowered.out_info[3], lowered.out_info[4]
        args, static = self._forward_args(
            tokens, batch, params, record["pages"], record["logits"], record["greedy"],
            taps=tuple(record["taps"]), shared_pages=record["shared_pages"],
        )  # fmt: skip
        lowered = forward_step.lower(*args, **static)
        # Only a call with the draft's own taps writes the draft's context (`forward` with other
        # taps, for scoring or for a draft's training data, returns them and writes nothing).
        drafting = bool(self._taps) and tuple(record["taps"]) == tuple(self._taps)
        return lowered, lowered.out_info[2], lowered.out_info[3] if drafting else None

    def _warm_speculative(self, batch: StepBatch, params: SamplingBatch, num_pages: int, greedy_only: bool) -> None:
        """Compiles the drafting call and the verify pass of one decode shape on padding rows."""
        num_rows = batch.slots.shape[0]
        if self.drafter is not None and greedy_only:  # drafting does not depend on sampling
            zeros = np.zeros(num_rows, np.int32)
            table = np.zeros((num_rows, num_pages), np.int32)
            if self.drafter.tree:
                self.drafter.propose_tree(table, zeros, zeros, [0] * num_rows)
            else:
                self.drafter.propose(table, zeros, zeros)
        for tokens, parents in self._verify_shapes(num_rows):
            self._verify(tokens, batch, params, num_pages, greedy_only, return_logits=False, parents=parents)

    # -- recording what the target computed ---------------------------------------------------

    def record(self, taps: tuple[int, ...] | None, top_k: int = 0) -> None:
        """From now on, every call of the model over requests also keeps, per request, the
        hidden states after the layers in `taps` at every position it runs and, with `top_k`,
        the `top_k` most likely next tokens with their log probabilities at every position
        where a token is sampled (the last prompt position and every decode step); the
        top-k is chosen on the device. `take_record` hands them over. `None` stops recording.

        This is what a DFlash draft's training data needs, made by generation itself rather
        than by a second pass over each finished sequence. It needs plain one-step decoding
        and no prefix cache (a cached page's positions are never run, so they would have no
        hidden states)."""
        self._records.clear()
        if taps is None:
            self._recording = None
            return
        taps = tuple(taps)
        if not taps or any(not 0 <= i < self.cfg.num_layers for i in taps):
            raise ValueError(f"taps must be layer indices in [0, {self.cfg.num_layers}), got {taps!r}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if self.speculative is not None or self.num_scheduler_steps > 1:
            raise ValueError("recording needs plain decoding: no speculative decoding, num_scheduler_steps 1")
        if self.scheduler.prefix_cache is not None:
            raise ValueError("recording needs enable_prefix_caching=False: cached positions are never run")
        self._recording = (taps, top_k)

    def _keep_record(self, rows: list[tuple[Sequence, list[int]]], hidden, logits, top_k: int) -> None:
        """Keeps one call's tapped hidden states and, for rows that sample, their top-k (called
        before the rows' new tokens are marked computed)."""
        hidden, (ids, logp) = jax.device_get((hidden, top_log_probs(logits, top_k) if top_k else (None, None)))
        for i, (s, toks) in enumerate(rows):
            record = self._records.setdefault(s.seq_id, TapRecord({}, {}))
            if s.num_cached == 0:  # a first run, or a preempted request's recompute: its states replace any kept
                record.hidden.clear()
            record.hidden[s.num_cached] = hidden[i, : len(toks)].astype(np.float16)
            if top_k and s.num_pending == len(toks):  # this call runs its last pending token: it samples
                record.top[s.num_cached + len(toks) - 1] = (ids[i], logp[i])

    def take_record(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """What `record` kept for a finished request, dropped from the engine: (the tapped
        hidden states [n, len(taps) * D] float16, the top-k ids [n, k] int32 and log
        probabilities [n, k] float32, or None without top_k) for its n = num_tokens positions.
        Its last token was sampled, never run: its hidden states are zeros. Positions where
        nothing was sampled (the prompt's but its last, and the last) hold id 0 and log
        probability -inf. Raises RuntimeError if any other position was never run."""
        if self._recording is None:
            raise RuntimeError("nothing is recorded: call record(taps) before adding the requests")
        taps, top_k = self._recording
        record = self._records.pop(seq.seq_id, TapRecord({}, {}))
        n = seq.num_tokens
        hidden = np.full((n, len(taps) * self.cfg.hidden_size), np.nan, np.float16)
        for start, h in record.hidden.items():
            hidden[start : start + len(h)] = h
        hidden[n - 1] = 0
        missing = np.flatnonzero(np.isnan(hidden).any(axis=1))
        if missing.size:
            raise RuntimeError(f"request {seq.seq_id}: positions {missing[:5].tolist()} were never run")
        if not top_k:
            return hidden, None, None
        ids = np.zeros((n, top_k), np.int32)
        logp = np.full((n, top_k), -np.inf, np.float32)
        for pos, (i, lp) in record.top.items():
            ids[pos], logp[pos] = i, lp
        return hidden, ids, logp

    # -- scoring ----------------------------------------------------------------------------

    def score(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), V] float32 for every position, computed through the paged cache."""
        return self.forward(ids)[0]

    def hidden_states(self, ids: list[int], taps: tuple[int, ...]) -> np.ndarray:
        """The hidden states after each layer in `taps`, concatenated: [len(ids), len(taps) * D]."""
        return self.forward(ids, taps=taps, logits=False)[1]

    def forward(
        self, ids: list[int], *, taps: tuple[int, ...] = (), logits: bool = True, top_k: int = 0
    ) -> tuple[Any, np.ndarray | None]:
        """Runs `ids` through a temporary slot in one pass: (every position's logits [len(ids), V]
        float32 or None without `logits`, the hidden states after the layers in `taps`
        concatenated [len(ids), len(taps) * D] or None without taps).

        With `top_k` > 0 (and `logits`) the logits stay on the device, and the first result is
        instead the `top_k` most likely next tokens at every position with their log
        probabilities: ([len(ids), k] int32, [len(ids), k] float32), most likely first.
        """
        taps = tuple(taps)
        if any(not 0 <= i < self.cfg.num_layers for i in taps):
            raise ValueError(f"taps must be layer indices in [0, {self.cfg.num_layers}), got {taps!r}")
        if not taps and not logits:
            raise ValueError("nothing to return: ask for logits, taps or both")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not ids:
            raise ValueError("ids is empty")
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the maximum context length of {self.max_model_len} tokens")
        num_pages = self.scheduler.pages_needed(len(ids))
        if not self.scheduler.can_take_slot(num_pages):
            raise RuntimeError("no free cache slot or pages to score with; wait for running requests")
        seq = Sequence(-1, list(ids), SamplingParams(max_tokens=1, temperature=0.0), 0, 1, frozenset())
        self.scheduler.take_slot(seq, num_pages)
        chunks, hidden = [], []
        try:
            while seq.num_cached < len(ids):
                n = min(len(ids) - seq.num_cached, self.max_prefill_chunk)
                rows = [(seq, seq.prompt_ids[seq.num_cached : seq.num_cached + n])]
                _, out, h, _ = self._run(
                    rows, return_logits="all" if logits else "none", taps=taps, host_logits=not top_k
                )
                if taps:
                    hidden.append(np.asarray(h[0, :n], np.float32))
                if logits:
                    # Top-k over the whole padded call (bucketed shapes compile once), then the row's part.
                    parts = jax.device_get(top_log_probs(out, top_k)) if top_k else (out,)
                    chunks.append([a[0, :n] for a in parts])
                seq.num_cached += n
        finally:
            self.scheduler.release(seq)
        hidden = np.concatenate(hidden) if taps else None
        if not logits:
            return None, hidden
        joined = tuple(np.concatenate(parts) for parts in zip(*chunks, strict=True))
        return (joined if top_k else joined[0]), hidden

    @property
    def num_compiles(self) -> int:
        """XLA compilations so far in this process."""
        return CompileCounter.count()


def chain_parents(num_rows: int, num_tokens: int) -> np.ndarray:
    """[num_rows, num_tokens] int32 parents of a chain (token i follows i - 1; -1 for the first)."""
    return np.tile(np.arange(-1, num_tokens - 1, dtype=np.int32), (num_rows, 1))


def top_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the k most likely (token, log-probability)) from raw logits [V]."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    top = np.argpartition(-logp, k)[:k] if 0 < k < logp.size else np.arange(logp.size if k else 0)
    top = top[np.argsort(-logp[top], kind="stable")]
    return float(logp[token]), [(int(t), float(logp[t])) for t in top]


def shape_record(kind: str, **fields: Any) -> dict[str, Any]:
    """A step shape record: `kind` and exactly its `SHAPE_FIELDS`, in that order (taps as a
    list, as JSON has them)."""
    names = SHAPE_FIELDS[kind]
    if set(fields) != set(names):
        raise TypeError(f"a {kind} shape has the fields {names}, got {sorted(fields)}")
    return {"kind": kind, **{f: list(fields[f]) if f == "taps" else fields[f] for f in names}}


def _shape_key(record: dict[str, Any]) -> tuple:
    """A shape record as a hashable key: its kind and fields in `SHAPE_FIELDS` order."""
    return (
        record["kind"],
        *(tuple(v) if isinstance(v, list) else v for v in map(record.get, SHAPE_FIELDS[record["kind"]])),
    )


def _checked_shape(index: int, record: Any) -> dict[str, Any]:
    """A well-formed copy of shape record `index` (its kind's fields only), or ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"step shape {index}: expected an object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind not in SHAPE_FIELDS:
        raise ValueError(f"step shape {index}: kind must be one of {sorted(SHAPE_FIELDS)}, got {kind!r}")
    out: dict[str, Any] = {"kind": kind}
    for field in SHAPE_FIELDS[kind]:
        if field not in record:
            raise ValueError(f"step shape {index} ({kind}): missing {field!r}")
        value = record[field]
        if field == "greedy" or (field == "logits" and kind == "verify"):
            ok = isinstance(value, bool)
        elif field == "logits":
            ok = value in RETURN_LOGITS
        elif field == "taps":
            ok = isinstance(value, list | tuple) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
            )
            value = list(value) if ok else value
        else:  # counts: rows and tokens from 1, pages from 0
            low = 0 if field in ("pages", "shared_pages") else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= 1 << 20
        if not ok:
            raise ValueError(f"step shape {index} ({kind}): bad {field} {value!r}")
        out[field] = value
    return out


@dataclasses.dataclass
class TapRecord:
    """What `Engine.record` kept for one request: tapped hidden states [n, len(taps) * D]
    float16 by the position of their first token, and (top-k ids, log probabilities) by
    position."""

    hidden: dict[int, np.ndarray]
    top: dict[int, tuple[np.ndarray, np.ndarray]]
