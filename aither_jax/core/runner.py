"""The model runner: packs (sequence, new tokens) rows into padded calls of the jitted steps and
dispatches them over the device state.

Every call is padded to a bucket (compile/buckets.py) of rows, tokens per row and pages read,
so sequences join and leave between steps without recompiling. Padding rows carry an
out-of-range slot: their cache writes are dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from aither_jax.compile.buckets import bucket, page_bucket
from aither_jax.compile.shapes import ShapeRegistry
from aither_jax.core.scheduler import Scheduler
from aither_jax.core.sequence import Sequence
from aither_jax.device.sampling import SamplingBatch
from aither_jax.device.steps import decode_steps, model_step, refill_sinks, verify_step, write_step
from aither_jax.kv.store import PageStore
from models.config import ModelConfig
from models.kv_spec import MAX_SINK_TOKENS
from models.llama import StepBatch
from models.weights import ModelWeights

Rows = list[tuple[Sequence, list[int]]]

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


class ModelRunner:
    """Owns the weights and the page store, and runs padded step calls over them."""

    def __init__(
        self,
        weights: ModelWeights,
        cfg: ModelConfig,
        store: PageStore,
        scheduler: Scheduler,
        shapes: ShapeRegistry,
        *,
        attention: str,
        shared_prefix_attention: bool,
        num_scheduler_steps: int,
        taps: tuple[int, ...] = (),
    ):
        self.weights, self.cfg, self.store, self.scheduler, self.shapes = weights, cfg, store, scheduler, shapes
        self.attention = attention
        self.max_num_seqs = scheduler.max_num_seqs
        self.max_prefill_chunk = scheduler.max_prefill_chunk
        self.max_pages_per_seq = scheduler.block_tables.shape[1]
        self.page_size = scheduler.page_size
        self.num_scheduler_steps = num_scheduler_steps
        self.taps = taps  # the layers a DFlash draft reads (its context features)
        self.mass_layers: tuple[int, ...] = ()  # layers whose attention mass per page steps return
        # Decode steps whose rows share cached prefix pages read them once for the whole batch
        # (see `models.llama.forward`); counted in num_shared_prefix_steps. Not with sliding-
        # window layers (Gemma), whose shared part would need the window too, nor batch-invariant
        # ones, which read each row's pages as the row alone would.
        self.shared_prefix_attention = (
            bool(shared_prefix_attention) and not cfg.window_layers and attention != "invariant"
        )
        self.num_shared_prefix_steps = 0
        # Slots admitted on cached pages whose sink tokens were recomputed (-s<n> formats).
        self.num_sink_refills = 0

    @property
    def cache(self):
        return self.store.cache

    @cache.setter
    def cache(self, value) -> None:
        self.store.cache = value

    @property
    def drafter(self):
        return self.store.drafter

    @property
    def bounded(self) -> bool:
        """Bounded residency (core/bounded.py): every call carries each row's RoPE offset, so
        all of this engine's step shapes take one (zeros for rows with nothing held off)."""
        return self.scheduler.bounded is not None

    # -- packing ------------------------------------------------------------------------------

    def pages_to_read(self, needed: int, num_rows: int) -> int:
        """Pages per row a step over `num_rows` (padded) rows reads when its longest row needs
        `needed`: the page bucket, from MIN_WIDE_PAGE_BUCKET up for wide steps."""
        minimum = MIN_WIDE_PAGE_BUCKET if num_rows >= WIDE_STEP_ROWS else MIN_PAGE_BUCKET
        return page_bucket(needed, minimum, self.max_pages_per_seq)

    def sync_tables(self) -> None:
        if self.scheduler.tables_dirty:
            self.cache = self.cache.replace(block_tables=jax.device_put(self.scheduler.block_tables))
            self.scheduler.tables_dirty = False

    def pack(self, rows: Rows, *, all_logits: bool, min_tokens: int = MIN_TOKEN_BUCKET, share_prefix=False, later=0):
        """Pads (sequence, new tokens) rows to a bucketed batch: (tokens, StepBatch,
        SamplingBatch, pages to read per row, whether every row is greedy, shared pages read
        once for the batch: 0 unless `share_prefix` and `shared_pages` finds some). The pages
        also cover `later` tokens past the new ones (steps fused into the same call)."""
        self.sync_tables()
        num_rows = bucket(len(rows), 1, self.max_num_seqs)
        longest = max(len(toks) for _, toks in rows)
        num_tokens = 1 if longest == 1 and not all_logits else bucket(longest, min_tokens, self.max_prefill_chunk)
        shared = self.shared_pages(rows) if share_prefix and num_tokens == 1 else 0
        if num_tokens > 1 and all(s.num_cached == 0 for s, _ in rows):
            num_pages = 0  # fresh prompts: nothing stored yet, so attention reads no pages
        else:
            end = max(s.num_cached - s.kv_offset + len(toks) for s, toks in rows) + later
            num_pages = self.pages_to_read(self.scheduler.pages_needed(end) - shared, num_rows)
        tokens = np.zeros((num_rows, num_tokens), np.int32)
        slots = np.full(num_rows, self.max_num_seqs, np.int32)  # padding rows: out-of-range slot, writes dropped
        start = np.zeros(num_rows, np.int32)
        num_new = np.zeros(num_rows, np.int32)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        offset = np.zeros(num_rows, np.int32)
        for i, (s, toks) in enumerate(rows):
            tokens[i, : len(toks)] = toks
            slots[i], start[i], num_new[i], offset[i] = s.slot, s.num_cached - s.kv_offset, len(toks), s.kv_offset
            temperature[i], top_k[i], top_p[i] = s.params.temperature, s.params.top_k, s.params.top_p
            seeds[i] = s.seed
        # numpy inputs go straight to the jitted step, whose C++ dispatch path transfers them
        # (a Python device_put per array cost ~0.25 ms each, several per decode step).
        batch = StepBatch(slots, start, num_new, offset if self.bounded else None)
        sampling = SamplingBatch(temperature, top_k, top_p, seeds)
        return tokens, batch, sampling, num_pages, bool(np.all(temperature == 0)), shared

    def shared_pages(self, rows: Rows) -> int:
        """Leading block-table pages that every row holds and has fully stored (prefix-cache
        hits shared by all rows), rounded down to SHARED_PAGE_STEP; 0 below MIN_SHARED_PAGES
        or the sink tokens' pages, for a single row, or when shared-prefix attention is off."""
        if not self.shared_prefix_attention or len(rows) < 2 or self.bounded:
            return 0
        full = min(s.num_cached for s, _ in rows) // self.page_size
        if full < MIN_SHARED_PAGES:
            return 0
        tables = self.scheduler.block_tables[[s.slot for s, _ in rows], :full]
        same = np.all(tables == tables[:1], axis=0)
        common = full if same.all() else int(np.argmin(same))
        shared = common // SHARED_PAGE_STEP * SHARED_PAGE_STEP
        return shared if shared >= MIN_SHARED_PAGES and shared * self.page_size >= self.cache.num_sinks else 0

    def padding_rows(
        self, num_rows: int, greedy_only: bool, num_tokens: int = 1
    ) -> tuple[np.ndarray, StepBatch, SamplingBatch]:
        """A call's inputs on `num_rows` padding rows (out-of-range slots, so nothing is
        written): tokens [num_rows, num_tokens], the batch and greedy or sampled parameters."""
        zeros = np.zeros(num_rows, np.int32)
        batch = StepBatch(np.full(num_rows, self.max_num_seqs, np.int32), zeros, zeros, zeros if self.bounded else None)
        temperature = np.full(num_rows, 0.0 if greedy_only else 1.0, np.float32)
        params = SamplingBatch(temperature, zeros, np.ones(num_rows, np.float32), zeros.astype(np.uint32))
        return np.zeros((num_rows, num_tokens), np.int32), batch, params

    # -- calls --------------------------------------------------------------------------------

    def run(self, rows: Rows, *, return_logits: str, taps: tuple[int, ...] = (), host_logits: bool = True):
        """One padded call of the jitted step over (sequence, new tokens) rows: (next tokens,
        logits by `return_logits` (a device array unless `host_logits`), tapped hidden states
        or None, the padded batch, with `mass_layers` (attention mass per page read [rows,
        pages], query summaries [rows, Hkv * Dh]; device arrays, padding rows included) else None)."""
        tokens, batch, sampling, num_pages, greedy_only, shared = self.pack(
            rows, all_logits=return_logits == "all", share_prefix=True
        )
        next_tokens, logits, hidden, mass = self.dispatch(
            tokens, batch, sampling, num_pages, return_logits, greedy_only, taps=taps, shared_pages=shared
        )
        if logits is not None and host_logits:
            logits = np.asarray(logits)
        # Attention mass stays on the device until a consumer reads it (the advisor folds one
        # decode call in `MASS_EVERY`).
        return np.asarray(next_tokens)[: len(rows)], logits, hidden, batch, mass

    def dispatch(
        self, tokens, batch, sampling, num_pages: int, return_logits: str, greedy_only: bool, *, taps=(), shared_pages=0
    ):
        num_rows, num_tokens = tokens.shape
        # Shared-prefix shapes depend on the prompts: warm-up leaves them to first use.
        self.shapes.note(
            "forward", warmed=num_tokens == 1 and return_logits == "none" and not shared_pages, rows=num_rows,
            tokens=num_tokens, pages=num_pages, logits=return_logits, greedy=greedy_only, taps=taps,
            shared_pages=shared_pages,
        )  # fmt: skip
        self.num_shared_prefix_steps += bool(shared_pages)
        args, static = self.forward_args(
            tokens, batch, sampling, num_pages, return_logits, greedy_only, taps=taps, shared_pages=shared_pages
        )
        next_tokens, logits, self.cache, hidden, mass = model_step(*args, **static)
        return next_tokens, logits, hidden, mass

    def steps(self, tokens, batch, sampling, limits, num_pages: int, greedy_only: bool):
        """Runs `decode_steps`; returns its tokens [B, num_scheduler_steps] (a device array)."""
        self.shapes.note("steps", warmed=True, rows=tokens.shape[0], pages=num_pages, greedy=greedy_only)
        args, static = self.steps_args(tokens, batch, sampling, limits, num_pages, greedy_only)
        out, self.cache = decode_steps(*args, **static)
        return out

    def verify(self, tokens, batch, sampling, num_pages: int, greedy_only: bool, return_logits: bool, parents=None):
        """The target's verify pass over [last, drafts] rows (a tree per row with `parents`),
        its cache write and the draft context write: (accepted counts, next tokens, logits or
        None, the accepted path of each tree or None)."""
        rows, num_tokens = tokens.shape
        self.shapes.note(
            "verify", warmed=not return_logits, rows=rows, tokens=num_tokens, pages=num_pages, logits=return_logits,
            greedy=greedy_only,
        )  # fmt: skip
        args, static = self.verify_args(tokens, batch, sampling, num_pages, greedy_only, return_logits, parents)
        accepted, next_tokens, logits, update, hidden, path = verify_step(*args, **static)
        self.cache = write_step(self.cache, update)
        self.write_draft_context(hidden, batch)
        return accepted, next_tokens, logits, path

    def write_draft_context(self, hidden, batch: StepBatch) -> None:
        """Feeds a target call's tapped hidden states to the DFlash draft's context cache."""
        if self.drafter is not None:
            self.drafter.write(hidden, self.cache.block_tables, batch.slots, batch.start, batch.num_new)

    def refill_sinks(self, rows: Rows) -> None:
        """Fills the sink buffers of slots admitted on cached pages (`steps.refill_sinks`)."""
        num_rows = bucket(len(rows), 1, self.max_num_seqs)
        tokens = np.zeros((num_rows, bucket(self.cache.num_sinks, MIN_TOKEN_BUCKET, MAX_SINK_TOKENS)), np.int32)
        slots = np.full(num_rows, self.max_num_seqs, np.int32)  # padding rows: writes dropped
        num_new = np.zeros(num_rows, np.int32)
        for i, (s, toks) in enumerate(rows):
            tokens[i, : len(toks)], slots[i], num_new[i] = toks, s.slot, len(toks)
        self.shapes.note("sinks", warmed=False, rows=num_rows, tokens=tokens.shape[1])
        batch = StepBatch(slots, np.zeros(num_rows, np.int32), num_new)
        self.cache = refill_sinks(
            self.weights, self.cache, tokens, batch, cfg=self.cfg, num_pages=0, attention=self.attention
        )
        self.num_sink_refills += len(rows)

    # -- call arguments -----------------------------------------------------------------------

    def forward_args(
        self, tokens, batch, sampling, num_pages: int, return_logits: str, greedy_only: bool, *, taps=(), shared_pages=0
    ):
        static = dict(num_pages=num_pages, return_logits=return_logits, greedy_only=greedy_only)
        if self.mass_layers:
            static["mass_layers"] = self.mass_layers
        return self.step_args(tokens, batch, sampling, taps=taps, shared_pages=shared_pages, **static)

    def steps_args(self, tokens, batch, sampling, limits, num_pages: int, greedy_only: bool) -> tuple[tuple, dict]:
        static = dict(num_pages=num_pages, greedy_only=greedy_only, num_steps=self.num_scheduler_steps)
        return self.step_args(tokens, batch, sampling, limits, **static)

    def verify_args(
        self, tokens, batch, sampling, num_pages: int, greedy_only: bool, return_logits: bool, parents=None
    ):
        static = dict(num_pages=num_pages, greedy_only=greedy_only, return_logits=return_logits, parents=parents)
        return self.step_args(tokens, batch, sampling, taps=self.taps, **static)

    def step_args(self, tokens, batch, sampling, *more, **static) -> tuple[tuple, dict[str, Any]]:
        """The (positional, keyword) arguments of a step function's call (`forward_step`,
        `verify_step`, `decode_steps`): the weights, the cache and the call's own inputs;
        its static arguments with the model's config and attention path added."""
        return (self.weights, self.cache, tokens, batch, sampling, *more), dict(
            static, cfg=self.cfg, attention=self.attention
        )
