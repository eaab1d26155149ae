"""The engine loop: schedule -> execute -> postprocess, one step at a time.

Each `step()` asks the scheduler (core/scheduler.py) for a plan (pages promoted from or
demoted to the host and disk tiers, kv/tiers.py, move while it plans), has the page store
apply the page copies it asks for, then runs at most one decode call (every sequence that is generating)
and one prefill call (a chunk of every sequence still reading its prompt), samples, and hands
the results back. The pieces it drives, one file each:
- `ModelRunner` (runner.py): the device state; packs rows into padded step calls;
- `SpeculativeStep` (speculate.py): drafts and one verify pass over them;
- `OutputProcessor` (output.py): stop tokens and strings, detokenizing, log probabilities;
- `Compiler` (warmup.py) and `ShapeRegistry` (compile/shapes.py): warm-up, precompiling, the
  record of compiled step shapes;
- `TapRecorder` (recorder.py): a draft's training data kept while generating.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from aither_jax.compile.code_maps import CodeMapBudget
from aither_jax.compile.counter import CompileCounter
from aither_jax.compile.scope import in_scope
from aither_jax.compile.services import services
from aither_jax.compile.shapes import ShapeRegistry
from aither_jax.core.bounded import BoundedResidency, ResidencyConfig
from aither_jax.core.output import OutputProcessor
from aither_jax.core.page_records import attended
from aither_jax.core.recorder import TapRecorder
from aither_jax.core.residency import Residency
from aither_jax.core.runner import MIN_TOKEN_BUCKET, ModelRunner
from aither_jax.core.scheduler import Scheduler
from aither_jax.core.scoring import forward_ids
from aither_jax.core.sequence import Sequence
from aither_jax.core.speculate import SpecCounters, SpeculativeStep
from aither_jax.core.warmup import Compiler
from aither_jax.device.sampling import SamplingParams
from aither_jax.kv.prefix_cache import hash_chain
from aither_jax.kv.store import PageStore
from aither_jax.kv.tiers import KVTiers, TierConfig
from aither_jax.speculative.config import SpeculativeConfig
from aither_jax.speculative.dflash import DFlashProposer
from models.config import ModelConfig
from models.kv_cache import init_cache
from models.kv_spec import parse_kv_spec
from models.kv_transform import load_key_transforms
from models.llama import ATTENTION_IMPLS
from models.registry import ModelHandle

Rows = list[tuple[Sequence, list[int]]]
# The eviction advisor folds the attention mass of every prefill call and of one plain decode
# call in this many: its host loop visits every page every row holds (64 rows of 256 pages take
# milliseconds), a pace a GPU decode step of a few milliseconds cannot keep.
MASS_EVERY = 8


class Engine:
    """Owns one model's device cache and runs the scheduler's sequences over it."""

    def __init__(
        self,
        model: ModelHandle,
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
        eviction_policy: str | None = None,
        max_protected_fraction: float | None = None,
        advisor_weights: dict | str | None = None,
        cache_fill_value: float = 0.0,
        seed: int = 0,
        speculative: SpeculativeConfig | str | dict | None = None,
        shared_prefix_attention: bool = True,
        num_scheduler_steps: int = 1,
        tiers: TierConfig | None = None,
        residency: ResidencyConfig | None = None,
    ):
        max_num_batched_tokens = (
            max(max_prefill_chunk, max_num_seqs) if max_num_batched_tokens is None else max_num_batched_tokens
        )
        self.compile_services = services()  # the persistent cache and the code budget, one per process
        _check_settings(
            model.config, attention, max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_pages=num_pages,
            page_size=page_size, max_prefill_chunk=max_prefill_chunk, max_num_batched_tokens=max_num_batched_tokens,
            num_scheduler_steps=num_scheduler_steps,
        )  # fmt: skip
        self.model = model
        weights, cfg = model.weights, model.config
        # Its steps compile apart from other models' (compile/scope.py), and run in it (`in_scope`).
        self.compile_scope = self.compile_services.scope(cfg, model.name)
        self.weights, self.cfg, self.tokenizer = weights, cfg, model.tokenizer
        self.max_num_seqs, self.max_model_len, self.page_size = max_num_seqs, max_model_len, page_size
        self.max_prefill_chunk = max_prefill_chunk
        self.max_pages_per_seq = -(-max_model_len // page_size)
        key_transform = None
        if parse_kv_spec(kv_cache_dtype).precondition:
            key_transform = load_key_transforms(model.key_transform or model.name, *_kv_shape(cfg))
        cache = init_cache(
            cfg, num_pages=num_pages, max_seqs=max_num_seqs, max_pages_per_seq=self.max_pages_per_seq,
            page_size=page_size, kv_cache_dtype=kv_cache_dtype, fill_value=cache_fill_value,
            key_transform=key_transform,
        )  # fmt: skip
        self.scheduler = Scheduler(
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq, max_prefill_chunk=max_prefill_chunk,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=True if enable_prefix_caching is None else enable_prefix_caching,
            max_pinned_fraction=max_pinned_fraction, sink_tokens=cache.num_sinks, min_token_bucket=MIN_TOKEN_BUCKET,
            eviction_policy=eviction_policy, max_protected_fraction=max_protected_fraction,
            advisor_weights=advisor_weights,
            max_resident_pages=None if residency is None else residency.max_tokens // page_size,
        )  # fmt: skip
        self.residency = Residency(self.scheduler)
        if self.scheduler.policy.name == "advisor":  # ranks the cached pages on its own thread
            self.scheduler.policy.start(self.scheduler.prefix_cache.cached_blocks)
        self.speculative = SpeculativeConfig.parse(speculative)
        drafter = _drafter(self.speculative, model, num_pages=num_pages, page_size=page_size)
        if drafter is not None:
            self.num_speculative_tokens = drafter.num_speculative_tokens
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
        self.num_mass_calls = 0  # plain decode calls that returned attention mass (`MASS_EVERY`)
        self.num_lookahead_tokens = self.num_speculative_tokens or num_scheduler_steps - 1
        self.scheduler.lookahead = self.num_lookahead_tokens
        self.shapes = ShapeRegistry()
        self.store = PageStore(
            cache, drafter=drafter, shapes=self.shapes, num_usable_pages=self.scheduler.num_usable_pages
        )
        tiers = tiers or TierConfig()
        if tiers.enabled:
            if self.scheduler.prefix_cache is None:
                raise ValueError("KV tiers below the device (host or disk) need prefix caching")
            self.scheduler.prefix_cache.tiers = tiers.build(self.store, model.fingerprint)
        self.runner = ModelRunner(
            weights, cfg, self.store, self.scheduler, self.shapes, attention=attention,
            shared_prefix_attention=shared_prefix_attention, num_scheduler_steps=num_scheduler_steps,
            taps=drafter.taps if drafter else (),
        )  # fmt: skip
        # The layer whose attention mass the advisor and the residency scorers read: the last
        # global one (a stand-in of only sliding-window layers: its last layer).
        last_global = max((i for i in range(cfg.num_layers) if cfg.window(i) is None), default=cfg.num_layers - 1)
        if self.scheduler.policy.name == "advisor":  # plain steps report attention mass per page
            self.runner.mass_layers = (last_global,)
        self.bounded = None
        if residency is not None:
            if self.speculative is not None:
                raise ValueError("bounded residency (max_resident_tokens) does not run with speculative decoding yet")
            if cache.num_sinks and cfg.window_layers:
                raise ValueError(
                    "bounded residency cannot run a sliding-window model with a sink-token KV format: pick a format "
                    "without -s<n>"
                )
            # Scorers read the last global layer (mass and queries there ranked pages better than
            # at the middle layers or summed over several: docs/BENCHMARKS.md, residency note).
            self.bounded = BoundedResidency(
                residency, self.scheduler, self.store, window=cfg.sliding_window if cfg.window_layers else None,
                mass_layer=last_global, head_dim=cfg.head_dim,
            )  # fmt: skip
            self.scheduler.bounded = self.bounded
            if residency.scorer in ("attention", "qk"):
                self.runner.mass_layers = (last_global,)
        self.output = OutputProcessor(model.tokenizer)
        self.spec_counters = SpecCounters(self.num_speculative_tokens)
        self.speculator = None
        if self.speculative is not None:
            parts = (self.runner, self.scheduler, self.output, self.spec_counters)
            self.speculator = SpeculativeStep(
                self.speculative, *parts, num_speculative_tokens=self.num_speculative_tokens
            )
        self.compiler = Compiler(
            self.runner, self.compile_services, self.compile_scope, max_model_len=max_model_len,
            num_speculative_tokens=self.num_speculative_tokens, num_lookahead_tokens=self.num_lookahead_tokens,
        )  # fmt: skip
        self.recorder: TapRecorder | None = None  # set by `record`
        self._rng = np.random.default_rng(seed)
        self._next_id = 0
        self._dropped_pins: collections.deque[bytes] = collections.deque()  # owners' keys (`release_pin`)
        self.num_steps = 0

    @property
    def code_budget(self) -> CodeMapBudget:
        """The process's code-mapping budget (compile/code_maps.py), shared with every engine."""
        return self.compile_services.budget

    @code_budget.setter
    def code_budget(self, budget: CodeMapBudget) -> None:
        self.compile_services.budget = budget

    @property
    def cache(self):
        """The target's paged KV cache (owned by the page store)."""
        return self.store.cache

    @property
    def num_pages(self) -> int:
        """Pages in the KV pool, the null page included."""
        return self.scheduler.allocator.num_pages

    @in_scope
    def resize_pool(self, num_pages: int) -> int:
        """Grows or shrinks the KV pool (every pool sharing page ids) to `num_pages` pages,
        between steps; returns the count it reached. A shrink gives back idle cached pages from
        the top (to the tiers below, if any) and stops above the highest page still in use. The
        steps compile again for the new pool size when they next run (or load from the
        persistent cache) unless `precompile_pool` readied them. Used by the fleet's balloon
        (aither_jax/fleet/balloon.py).

        Raises:
            ValueError: bounded residency is on, or fewer pages than one full-length sequence needs.
            Whatever the store's resize raised (out of device memory): the pool keeps its size.
        """
        if self.bounded is not None:
            raise ValueError("a pool under bounded residency (max_resident_tokens) cannot be resized")
        old = self.store.num_usable_pages + 1
        num_pages = self.scheduler.resize_pool(num_pages)
        if num_pages != old:
            try:
                self.store.resize(num_pages)
            except Exception:  # the device refused the new pools: the store keeps the old ones
                self.scheduler.resize_pool(old)
                raise
        return num_pages

    @in_scope
    def precompile_pool(
        self, num_pages: int, shapes: Iterable[dict[str, Any]] | None = None, *, workers: int | None = None
    ) -> int:
        """Compiles step shapes (default: every one this engine has run, `step_shapes`) for a
        pool of `num_pages` pages, and the resize to it from the size now, so that a later
        `resize_pool(num_pages)` and the steps after it compile nothing.
        It lowers over abstract pools and touches no engine state, so it may run on another
        thread while this engine steps (the server's balloon does). Returns the shapes compiled."""
        shapes = self.step_shapes() if shapes is None else list(shapes)
        self.store.abstract().lower_resize(num_pages).compile()  # the resize itself, from the size now
        return self.compiler.for_pool(num_pages).precompile(shapes, workers=workers)

    @property
    def drafter(self) -> DFlashProposer | None:
        return self.store.drafter

    @property
    def tiers(self) -> KVTiers | None:
        """The host and disk tiers below the device pool, if configured."""
        return self.scheduler.prefix_cache.tiers if self.scheduler.prefix_cache else None

    @in_scope
    def persist(self) -> int:
        """Writes every cached page (device and host) to the disk tier, before a clean exit;
        returns how many."""
        cache = self.scheduler.prefix_cache
        return cache.persist() if cache is not None else 0

    @property
    def draft_length(self):
        return None if self.speculator is None else self.speculator.draft_length

    @property
    def on_new_shape(self):
        """Called with each shape record the first time a step of that shape runs."""
        return self.shapes.on_new_shape

    @on_new_shape.setter
    def on_new_shape(self, callback) -> None:
        self.shapes.on_new_shape = callback

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

    @in_scope
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        salt: bytes = b"",
        pin_tokens: int = 0,
        num_logprobs: int | None = None,
        sections: tuple = (),
        pin_key: bytes | None = None,
    ) -> Sequence:
        """Queues a tokenized prompt. Raises ValueError if it can never fit.

        Args:
            salt: root of the prefix-cache names (the tenant); only equal salts share pages.
            pin_tokens: pin the cached pages of this many leading prompt tokens once computed.
            sections: `SectionSpan`s of the prompt (context/sections.py): the KV pages their
                tokens fill take their tag and importance.
            pin_key: the owner of the pin (a context pipeline's `Context`): once computed, the
                pin replaces the owner's earlier one, and a prefix the owner holds pinned is
                not pinned again (`Scheduler.pin`).
            num_logprobs: how many top alternatives to record beside each sampled token's
                log-probability; None: `params.logprobs` (None there: no log-probabilities).
        """
        params.validate(self.cfg.vocab_size)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        self.check_prompt(len(prompt_ids))
        self._release_dropped_pins()
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        usable = self.scheduler.num_usable_pages
        if self.bounded is None and self.scheduler.pages_needed(len(prompt_ids) + max_tokens) > usable:
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
            pin_key=pin_key,
            num_logprobs=params.logprobs if num_logprobs is None else num_logprobs,
            sections=tuple(sections),
        )
        if self.bounded is not None:
            self.bounded.check(seq)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unpin(self, prompt_ids: list[int], salt: bytes = b"") -> int:
        """Drops one pin from each cached full page of `prompt_ids` under `salt` (what a request
        with these tokens and `pin_tokens=len(prompt_ids)` pinned); returns the pages unpinned.
        Raises ValueError when prefix caching is off (nothing is ever pinned)."""
        cache = self.scheduler.prefix_cache
        if cache is None:
            raise ValueError("prefix caching is off: nothing is pinned")
        return cache.unpin(hash_chain(salt, prompt_ids, self.page_size))

    def cached_prefix_tokens(self, ids: Iterable[int], salt: bytes = b"") -> int:
        """How many leading tokens of `ids` under `salt` sit in full pages cached on the device
        now (what a request starting with them would not compute; 0 without prefix caching).
        Reads the cache without changing it, so any thread may ask."""
        cache = self.scheduler.prefix_cache
        if cache is None:
            return 0
        hit = 0
        for name in hash_chain(salt, list(ids), self.page_size):
            if not cache.contains(name):
                break
            hit += 1
        return hit * self.page_size

    def release_pin(self, pin_key: bytes) -> None:
        """Gives back the pin an owner (`add_request`'s `pin_key`) holds, at the next request or
        step. It only queues the key, so any thread may call it, a `weakref.finalize` callback
        included (the context pipeline's owners are released that way)."""
        self._dropped_pins.append(pin_key)

    def _release_dropped_pins(self) -> None:
        while self._dropped_pins:
            self.scheduler.release_pin(self._dropped_pins.popleft())

    @in_scope
    def abort(self, seq: Sequence) -> None:
        """Stops a request and returns its slot and pages."""
        self.scheduler.abort(seq)

    # -- the loop -------------------------------------------------------------------------------

    @in_scope
    def step(self) -> list[Sequence]:
        """Runs one scheduled step; returns the sequences that finished in it."""
        self.code_budget.release_after_compiles(self.compile_scope)
        self._release_dropped_pins()
        if self.speculator is not None:
            self.speculator.choose_lookahead()
        plan = self.scheduler.schedule()
        if plan.copies:
            self.store.copy(plan.copies)
            self.scheduler.copies_done(plan.copies)
        if plan.sink_refills:
            self.runner.refill_sinks(plan.sink_refills)
        if plan.decode and self.speculator is not None:
            self.speculator.step(plan.decode, plain=self._decode)
        elif plan.decode and self._fused_decode(plan.decode):
            # Several steps when nothing else waits for the device (no prefill chunk, no
            # request waiting for a slot), so no one's first token is delayed.
            self._decode_steps(plan.decode, several=not plan.prefill and not self.scheduler.waiting)
        elif plan.decode:
            self._decode(plan.decode)
        if plan.prefill:
            start, compiles = time.perf_counter(), CompileCounter.count()
            self._decode(plan.prefill)
            # The recompute side of the reload-or-recompute choice; a call that compiled is no speed.
            if self.tiers is not None and CompileCounter.count() == compiles:
                self.tiers.cost.observe_prefill(sum(len(t) for _, t in plan.prefill), time.perf_counter() - start)
        self.num_steps += 1
        finished = self.scheduler.finish()
        if self.scheduler.named:  # the advisor's SEMANTIC summaries of the pages this step named
            named, self.scheduler.named = self.scheduler.named, []
            vectors = self.store.key_summaries([p for _, p in named], self.runner.mass_layers[0])
            for (name, _), vector in zip(named, vectors, strict=True):
                self.scheduler.policy.graph.summarize(name, vector)
        if self.bounded is not None:  # bounded sequences due for reselection swap pages with the host
            self.bounded.reselect_due(self.scheduler.running)
        self.residency.relieve_pressure()  # the tiers' watermarks: demote ahead of need ...
        self.residency.prefetch()  # ... and promote what waiting requests will need
        return finished

    def _decode(self, rows: Rows) -> None:
        """One call over (sequence, new tokens) rows (decode or prefill chunks); samples the
        next token of every row that has run all its pending tokens."""
        want_logprobs = any(s.num_logprobs is not None for s, _ in rows)
        rec = self.recorder
        taps, top_k = (rec.taps, rec.top_k) if rec else (self.runner.taps, 0)
        next_tokens, logits, hidden, batch, mass = self.runner.run(
            rows, return_logits="last" if want_logprobs or top_k else "none", taps=taps, host_logits=not top_k
        )
        if mass is not None:  # the attention signal (advisor, residency), before new pages are named
            prefill = any(len(toks) > 1 for _, toks in rows)
            self.num_mass_calls += not prefill
            if self.scheduler.policy.name == "advisor" and (prefill or self.num_mass_calls % MASS_EVERY == 0):
                attended(self.scheduler.policy, self.scheduler.allocator.blocks, rows, mass[0])
            if self.bounded is not None:
                self.bounded.observe(rows, *mass)
        if rec is not None:
            rec.keep(rows, hidden, logits)
            logits = np.asarray(logits) if want_logprobs else None
        self.runner.write_draft_context(hidden, batch)
        for i, ((s, toks), tok) in enumerate(zip(rows, next_tokens, strict=True)):
            self.scheduler.computed(s, len(toks))
            if s.num_pending == 0:
                self.output.append(s, int(tok), None if logits is None else logits[i])

    def _fused_decode(self, rows: Rows) -> bool:
        """Whether decode rows run through `decode_steps` (with num_scheduler_steps > 1): rows
        of one pending token each, none of which wants log probabilities (they need the
        step's logits)."""
        return self.num_scheduler_steps > 1 and all(s.num_logprobs is None and len(t) == 1 for s, t in rows)

    def _decode_steps(self, rows: Rows, *, several: bool) -> None:
        """One `decode_steps` call over decode rows: with `several`, each row takes as many
        steps as the pages reserved for it allow (its lookahead + 1), otherwise one."""
        limits = [1 + self.scheduler.num_lookahead(s) if several else 1 for s, _ in rows]
        tokens, batch, sampling, num_pages, greedy_only, _ = self.runner.pack(
            rows, all_logits=False, later=max(limits) - 1
        )
        padded = np.zeros(tokens.shape[0], np.int32)
        padded[: len(rows)] = limits
        out = np.asarray(self.runner.steps(tokens, batch, sampling, padded, num_pages, greedy_only))
        self.num_multi_steps += max(limits) > 1
        for i, (s, _) in enumerate(rows):
            appended = self.output.append_tokens(s, out[i, : limits[i]].tolist())
            # The cache holds the row's last token and the sampled tokens fed back after it.
            self.scheduler.computed(s, appended)

    def spec_stats(self) -> dict:
        """Speculative decoding so far: vLLM's counters, tau (tokens committed per verify pass
        of a row, bonus included) and its histogram."""
        return self.spec_counters.stats(self.draft_length)

    # -- compiling ------------------------------------------------------------------------------

    @property
    def warmed_up(self) -> bool:
        return self.shapes.warmed_up

    def step_shapes(self) -> list[dict[str, Any]]:
        """The step shapes this engine has run or precompiled, in first-seen order: one record
        (a JSON-able dict, `compile.shapes.SHAPE_FIELDS`) per compiled program. `precompile`
        takes them, in this process or in the next one (`aither_jax.compile.shape_file`)."""
        return self.shapes.records()

    @in_scope
    def warmup(
        self, max_len: int | None = None, *, sampling: bool = True, progress: bool = False, workers: int | None = None
    ) -> int:
        """Compiles every decode shape for sequences up to `max_len` tokens (`Compiler.warmup`)."""
        return self.compiler.warmup(max_len, sampling=sampling, progress=progress, workers=workers)

    @in_scope
    def precompile(
        self, shapes: Iterable[dict[str, Any]], *, workers: int | None = None, progress: bool = False
    ) -> int:
        """Compiles step shape records, typically an earlier run's (`Compiler.precompile`)."""
        return self.compiler.precompile(shapes, workers=workers, progress=progress)

    @property
    def num_compiles(self) -> int:
        """XLA compilations so far in this process."""
        return CompileCounter.count()

    # -- recording what the target computed ---------------------------------------------------

    def record(self, taps: tuple[int, ...] | None, top_k: int = 0) -> None:
        """Keeps what the model computes for every request from now on (`TapRecorder`); `None`
        stops recording. Needs plain one-step decoding and no prefix cache."""
        self.recorder = None
        if taps is None:
            return
        recorder = TapRecorder(tuple(taps), top_k, self.cfg)
        if self.speculative is not None or self.num_scheduler_steps > 1:
            raise ValueError("recording needs plain decoding: no speculative decoding, num_scheduler_steps 1")
        if self.scheduler.prefix_cache is not None:
            raise ValueError("recording needs enable_prefix_caching=False: cached positions are never run")
        self.recorder = recorder

    def take_record(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """What `record` kept for a finished request, dropped from the engine (`TapRecorder.take`)."""
        if self.recorder is None:
            raise RuntimeError("nothing is recorded: call record(taps) before adding the requests")
        return self.recorder.take(seq)

    # -- scoring ----------------------------------------------------------------------------

    def score(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), V] float32 for every position, computed through the paged cache."""
        return self.forward(ids)[0]

    def hidden_states(self, ids: list[int], taps: tuple[int, ...]) -> np.ndarray:
        """The hidden states after each layer in `taps`, concatenated: [len(ids), len(taps) * D]."""
        return self.forward(ids, taps=taps, logits=False)[1]

    @in_scope
    def forward(
        self, ids: list[int], *, taps: tuple[int, ...] = (), logits: bool = True, top_k: int = 0, positions=None
    ) -> tuple[Any, np.ndarray | None]:
        """Runs `ids` through a temporary slot in one pass (`scoring.forward_ids`)."""
        return forward_ids(
            self.runner, ids, self.max_model_len, taps=taps, logits=logits, top_k=top_k, positions=positions
        )


def _drafter(spec: SpeculativeConfig | None, model: ModelHandle, **pool) -> DFlashProposer | None:
    """The DFlash draft of a dflash config (its context pools share the target's page ids)."""
    if spec is None or spec.method != "dflash":
        return None
    weights = model.weights
    draft = spec.model or model.draft
    return DFlashProposer(
        spec, model.config, draft=draft, model_name=model.name, embed=weights.embed, lm_head=weights.lm_head,
        kernels=spec.draft_kernels, **pool,
    )  # fmt: skip


def _kv_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim


def _check_settings(
    cfg: ModelConfig, attention: str, *, max_model_len: int, page_size: int, max_prefill_chunk: int, **counts: int
) -> None:
    """Raises ValueError naming the first engine setting out of range."""
    counts = dict(counts, max_model_len=max_model_len, page_size=page_size, max_prefill_chunk=max_prefill_chunk)
    lows = {"num_pages": 2}
    for name in (
        "max_num_seqs",
        "max_model_len",
        "num_pages",
        "page_size",
        "max_prefill_chunk",
        "max_num_batched_tokens",
        "num_scheduler_steps",
    ):
        value, low = counts[name], lows.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if max_model_len > cfg.max_context:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {cfg.max_context}")
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    if page_size & (page_size - 1) or max_prefill_chunk & (max_prefill_chunk - 1):
        raise ValueError("page_size and max_prefill_chunk must be powers of two")
