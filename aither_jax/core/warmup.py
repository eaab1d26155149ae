"""Compiling step shapes before requests need them: the warm-up over every decode shape up to a
length, and precompiling a list of shape records (an earlier run's, `compile/shape_file.py`)
on several threads."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from aither_jax.compile.buckets import bucket
from aither_jax.compile.code_maps import CodeMapBudget
from aither_jax.compile.scope import CompileScope
from aither_jax.compile.services import CompileServices
from aither_jax.compile.shapes import checked_shape, shape_key, shape_record
from aither_jax.compile.step_jit import compile_workers
from aither_jax.core.runner import MIN_TOKEN_BUCKET, ModelRunner
from aither_jax.core.speculate import chain_parents
from aither_jax.device.sampling import SamplingBatch
from aither_jax.device.steps import (
    accept_step,
    decode_steps,
    forward_step,
    refill_sinks,
    sample_step,
    verify_forward,
    write_step,
)
from models.kv_spec import MAX_SINK_TOKENS
from models.llama import StepBatch

log = logging.getLogger(__name__)


def program_key(record: dict[str, Any]) -> tuple:
    """What fixes a shape record's model program: its fields, except that forward steps greedy
    or not, and returning no logits or the last ones, share one (`forward_step`, sampled rows
    drawing in `sample_step`), and verify passes greedy or not, returning logits or not, share
    one (`verify_forward`, then `accept_step` per greedy and logits)."""
    if record["kind"] == "forward":
        return shape_key({**record, "greedy": True, "logits": "all" if record["logits"] == "all" else "none"})
    if record["kind"] == "verify":
        return shape_key({**record, "greedy": True, "logits": False})
    return shape_key(record)


class Compiler:
    """Compiles an engine's step shapes ahead of use, within the process's mapping budget."""

    def __init__(
        self, runner: ModelRunner, services: CompileServices, scope: CompileScope, *, max_model_len: int,
        num_speculative_tokens: int, num_lookahead_tokens: int,
    ):  # fmt: skip
        self.runner = runner
        self.services = services
        self.scope = scope  # the engine's (compile/scope.py): what a release over the budget drops first
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens

    def for_pool(self, num_pages: int) -> Compiler:
        """A compiler of this engine's calls over abstract pools of `num_pages` pages
        (`PageStore.abstract`): its `precompile` readies the steps for a resize to that size
        while the engine keeps stepping on its live pools, on another thread if need be."""
        runner = copy.copy(self.runner)
        runner.store = self.runner.store.abstract(num_pages)
        compiler = copy.copy(self)
        compiler.runner = runner
        return compiler

    @property
    def code_budget(self) -> CodeMapBudget:
        return self.services.budget  # read at each use: the process's budget may be replaced

    def warmup(self, max_len: int | None = None, *, sampling=True, progress=False, workers: int | None = None) -> int:
        """Compiles every decode shape for sequences up to `max_len` tokens.

        Covers each batch bucket (1, 2, 4, .. max_num_seqs) times each of its page buckets up
        to `max_len` (default max_model_len), greedy and, with `sampling`, sampled. With
        speculative decoding each such shape also compiles the verify pass over the draft block,
        the draft context write and (DFlash) the drafting call. The calls run on padding rows
        only, which write to the null page and change nothing. Afterwards a decode step with a
        shape outside this set logs a warning. Code compiled before the warm-up that already nears
        the process's memory-mapping limit is dropped first; the warm-up stops early, with a
        warning, once its own shapes near it (aither_jax/compile/code_maps.py). Returns the
        number of shapes compiled.

        The target's step calls compile on `workers` threads first (default
        `step_jit.compile_workers()`, 1 compiles each call when it first runs).
        """
        r = self.runner
        max_len = self.max_model_len if max_len is None else max_len
        if not 1 <= max_len <= self.max_model_len:
            raise ValueError(f"max_len must be in [1, {self.max_model_len}], got {max_len}")
        workers = compile_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        rows = sorted({bucket(n, 1, r.max_num_seqs) for n in range(1, r.max_num_seqs + 1)})
        max_pages = r.scheduler.pages_needed(max_len + self.num_lookahead_tokens)  # page_bucket() caps it
        pages = {n: sorted({r.pages_to_read(p, n) for p in range(1, max_pages + 1)}) for n in rows}
        shapes = [(n, p, g) for n in rows for p in pages[n] for g in ((True, False) if sampling else (True,))]
        # Code compiled for earlier shapes (another configuration's, say) that already holds the
        # budget is dropped first, so the warm-up stops only when its own shapes fill it
        # (`precompile` makes that check itself).
        if workers > 1:
            self._precompile_decode(shapes, workers, progress)
        else:
            self.code_budget.release_if_over(self.scope)
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
            tokens, batch, params = r.padding_rows(num_rows, greedy_only)
            if r.num_scheduler_steps > 1:
                tokens = r.steps(tokens, batch, params, np.zeros(num_rows, np.int32), num_pages, greedy_only)
            else:
                tokens, _, hidden, _ = r.dispatch(tokens, batch, params, num_pages, "none", greedy_only, taps=r.taps)
                r.write_draft_context(hidden, batch)
            if self.num_speculative_tokens:
                self._warm_speculative(batch, params, num_pages, greedy_only)
            done += 1
        if tokens is not None:
            tokens.block_until_ready()
        r.shapes.warmed_up = True
        return done

    def _verify_shapes(self, num_rows: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The verify passes a decode shape of `num_rows` rows may need: (tokens, tree parents or
        None) for every token bucket, since drafts may come short (a request near max_tokens,
        prompt lookup). Empty without speculative decoding."""
        if not self.num_speculative_tokens:
            return []
        buckets = {bucket(n, 2, self.runner.max_prefill_chunk) for n in range(2, self.num_speculative_tokens + 2)}
        tree = self.runner.drafter is not None and self.runner.drafter.tree
        return [
            (np.zeros((num_rows, t), np.int32), chain_parents(num_rows, t) if tree else None) for t in sorted(buckets)
        ]

    def _precompile_decode(self, shapes: list[tuple[int, int, bool]], workers: int, progress: bool) -> None:
        """Compiles the calls of the warm-up `shapes` (rows, pages, greedy only) on `workers`
        threads: each shape's decode step (`decode_steps` with num_scheduler_steps > 1), its
        cache writes and, with speculative decoding, its verify passes and (DFlash) the
        drafting call and the draft's context writes."""
        r = self.runner
        records = []
        for num_rows, num_pages, greedy_only in shapes:
            common = dict(rows=num_rows, pages=num_pages, greedy=greedy_only)
            if r.num_scheduler_steps > 1:
                records.append(shape_record("steps", **common))
                continue
            records.append(shape_record("forward", **common, tokens=1, logits="none", taps=r.taps, shared_pages=0))
            if r.drafter is not None and greedy_only:  # drafting does not depend on sampling
                records.append(shape_record("draft", rows=num_rows, pages=num_pages))
            for tokens, _ in self._verify_shapes(num_rows):
                records.append(shape_record("verify", **common, tokens=tokens.shape[1], logits=False))
        self.precompile(records, workers=workers, progress=progress)

    def first_request_shapes(self, prompt_tokens: int = 64) -> list[dict[str, Any]]:
        """The step shapes of a first request of up to `prompt_tokens` prompt tokens and of a
        follow-up on its cached pages, greedy and sampled: the prefill of a fresh prompt at each
        token bucket, decode steps while it stays within its first page bucket, and with prefix
        caching the follow-up's prefill over cached pages (its sink refill and partial-page copy
        too; with the eviction advisor, the key summaries of the pages each step fills). With
        speculative decoding, the decode steps' verify passes and drafting call."""
        r = self.runner
        if not 1 <= prompt_tokens <= r.max_prefill_chunk:
            raise ValueError(f"prompt_tokens must be in [1, {r.max_prefill_chunk}], got {prompt_tokens}")
        tokens = sorted({bucket(n, MIN_TOKEN_BUCKET, r.max_prefill_chunk) for n in range(1, prompt_tokens + 1)})
        pages = r.pages_to_read(r.scheduler.pages_needed(2 * prompt_tokens + self.num_lookahead_tokens), 1)
        cached = r.scheduler.prefix_cache is not None
        records = []
        for greedy in (True, False):
            common = dict(rows=1, logits="none", greedy=greedy, taps=r.taps, shared_pages=0)
            records += [shape_record("forward", tokens=t, pages=0, **common) for t in tokens]
            if cached:
                records += [shape_record("forward", tokens=t, pages=pages, **common) for t in tokens]
            if r.num_scheduler_steps > 1:
                records.append(shape_record("steps", rows=1, pages=pages, greedy=greedy))
            else:
                records.append(shape_record("forward", tokens=1, pages=pages, **common))
            for verify, _ in self._verify_shapes(1):
                records.append(
                    shape_record("verify", rows=1, tokens=verify.shape[1], pages=pages, logits=False, greedy=greedy)
                )
        if r.drafter is not None:
            records.append(shape_record("draft", rows=1, pages=pages))
        if cached and r.cache.num_sinks:
            records.append(
                shape_record("sinks", rows=1, tokens=bucket(r.cache.num_sinks, MIN_TOKEN_BUCKET, MAX_SINK_TOKENS))
            )
        if cached:
            records.append(shape_record("copy", pages=4))  # one partial page, padded to the copy bucket
        if cached and r.scheduler.policy.graph is not None:  # the advisor's summaries of the pages a step fills
            buckets = {r.store.padded_size(n) for n in range(1, r.scheduler.pages_needed(2 * prompt_tokens) + 1)}
            records += [shape_record("summaries", pages=n, layer=r.mass_layers[0]) for n in sorted(buckets)]
        return records

    def precompile(self, shapes: Iterable[dict[str, Any]], *, workers: int | None = None, progress=False) -> int:
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
        r = self.runner
        workers = compile_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        records = [checked_shape(i, rec) for i, rec in enumerate(shapes)]
        usable = []
        for record in records:
            why = self.unfit(record)
            if why:
                log.warning("step shape %s skipped: %s", record, why)
            else:
                usable.append(record)
        compiled: set = set()  # the writes, samplers and verifications submitted
        outputs: dict[tuple, Any] = {}  # each program submitted (`program_key`): its outputs' shapes
        done = 0
        self.code_budget.release_if_over(self.scope)  # earlier shapes' code does not stop this one
        bar = tqdm(total=0, desc=f"compiling steps ({workers} threads)", disable=not progress)
        with ThreadPoolExecutor(workers, thread_name_prefix="aither-compile") as pool:
            futures = []

            def submit(lowered) -> None:
                bar.total += 1
                bar.refresh()
                futures.append(pool.submit(self.scope.run_in(lowered.compile)))  # counted as its code
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
                kind, rows = record["kind"], record.get("rows")
                if kind == "forward" and not record["greedy"] and ("sample", rows) not in compiled:
                    compiled.add(("sample", rows))
                    submit(self._lower_sampler(rows))
                key = program_key(record)
                if key not in outputs:  # else a twin's program (greedy or not, ...) is compiling
                    lowered, update, hidden = self._lower(record)
                    outputs[key] = lowered.out_info
                    submit(lowered)
                    if update is not None:
                        write = str(jax.tree.map(lambda a: (a.shape, a.dtype), update))
                        if write not in compiled:
                            compiled.add(write)
                            submit(write_step.lower(r.cache, update))
                    if hidden is not None and r.drafter is not None:  # the draft context write
                        write = f"draft {hidden.shape}"
                        if write not in compiled:
                            compiled.add(write)
                            submit(r.drafter.lower_write(hidden, r.cache.block_tables, rows))
                if kind == "verify" and shape_key(record) not in compiled:
                    compiled.add(shape_key(record))
                    submit(self._lower_accept(record, outputs[key]))
                r.shapes.add(record)
                done += 1
            for future in futures:
                future.result()
        bar.close()
        return done

    def unfit(self, record: dict[str, Any]) -> str | None:
        """Why this engine cannot run a (well-formed) shape record, or None if it can."""
        r = self.runner
        kind = record["kind"]
        rows = record.get("rows", 1)
        if rows != bucket(rows, 1, r.max_num_seqs):
            return f"rows must be a power of two (or max_num_seqs) up to max_num_seqs {r.max_num_seqs}"
        longest = MAX_SINK_TOKENS if kind == "sinks" else r.max_prefill_chunk
        if record.get("tokens", 1) > longest:
            return f"more than {longest} tokens per row"
        pages = record.get("pages", 0)
        if kind not in ("copy", "summaries") and pages + record.get("shared_pages", 0) > r.max_pages_per_seq:
            return f"more pages than a sequence holds ({r.max_pages_per_seq})"
        if kind in ("copy", "summaries") and pages > r.scheduler.num_usable_pages + 1:
            return f"more pages than the pool's ({r.scheduler.num_usable_pages})"
        if kind == "summaries" and record["layer"] >= r.cfg.num_layers:
            return f"layer {record['layer']} is not a layer of this model (0 to {r.cfg.num_layers - 1})"
        if kind == "summaries" and record["layer"] not in r.mass_layers:
            return "page key summaries are taken by the eviction advisor and bounded residency, at their layer"
        if kind == "steps" and r.num_scheduler_steps == 1:
            return "fused decode steps need num_scheduler_steps > 1"
        if kind == "verify" and not self.num_speculative_tokens:
            return "verify passes need speculative decoding"
        if kind == "draft" and r.drafter is None:
            return "drafting calls need a DFlash draft"
        if kind == "sinks" and not r.cache.num_sinks:
            return "the KV cache format keeps no sink tokens"
        if kind == "forward" and any(i >= r.cfg.num_layers for i in record["taps"]):
            return f"taps {record['taps']} are not layers of this model (0 to {r.cfg.num_layers - 1})"
        if kind == "forward" and record["shared_pages"] and not r.shared_prefix_attention:
            return "shared-prefix attention is off"
        return None

    def _lower(self, record: dict[str, Any]) -> tuple[Any, Any, Any]:
        """A shape record's call lowered on padding inputs (rows on out-of-range slots, so
        nothing is written): (the lowered call, the cache update it returns for `write_step`
        or None, the tapped hidden states it returns for the draft's context write or None)."""
        r = self.runner
        kind = record["kind"]
        if kind == "copy":
            return r.store.lower_copy(record["pages"]), None, None
        if kind == "summaries":
            return r.store.lower_summaries(record["pages"], record["layer"]), None, None
        if kind == "draft":
            return r.drafter.lower_propose(record["rows"], record["pages"]), None, None
        num_rows = record["rows"]
        tokens, batch, params = r.padding_rows(num_rows, record.get("greedy", True), record.get("tokens", 1))
        if kind == "sinks":
            lowered = refill_sinks.lower(
                r.weights, r.cache, tokens, batch, cfg=r.cfg, num_pages=0, attention=r.attention
            )
            return lowered, None, None
        if kind == "steps":
            limits = np.zeros(num_rows, np.int32)
            args, static = r.steps_args(tokens, batch, params, limits, record["pages"], record["greedy"])
            return decode_steps.lower(*args, **static), None, None
        if kind == "verify":
            parents = self._padding_parents(tokens)
            args, static = r.verify_args(tokens, batch, params, record["pages"], True, False, parents)
            for name in ("greedy_only", "return_logits", "parents"):  # `accept_step`'s (`_lower_accept`)
                del static[name]
            lowered = verify_forward.lower(*args[:4], parents, **static)
            return lowered, lowered.out_info[1], lowered.out_info[2]
        args, static = r.forward_args(
            tokens, batch, params, record["pages"], record["logits"], record["greedy"],
            taps=tuple(record["taps"]), shared_pages=record["shared_pages"],
        )  # fmt: skip
        static["all_logits"] = static.pop("return_logits") == "all"
        del static["greedy_only"]  # sampled rows draw in `sample_step` (`_lower_sampler`)
        lowered = forward_step.lower(*args[:4], **static)
        # Only a call with the draft's own taps writes the draft's context (`forward` with other
        # taps, for scoring or for a draft's training data, returns them and writes nothing).
        drafting = bool(r.taps) and tuple(record["taps"]) == tuple(r.taps)
        # `model_step` writes the update without the attention mass it hands back to the host.
        update = lowered.out_info[3].replace(attention_mass=None, query_summary=None)
        return lowered, update, lowered.out_info[4] if drafting else None

    def _lower_accept(self, record: dict[str, Any], forward_outputs) -> Any:
        """`accept_step` lowered for a verify record, on the outputs of its `verify_forward`."""
        r = self.runner
        tokens, batch, params = r.padding_rows(record["rows"], record["greedy"], record["tokens"])
        parents = self._padding_parents(tokens)
        logits, update, hidden = forward_outputs
        return accept_step.lower(
            logits, tokens, batch, params, update, hidden, parents, greedy_only=record["greedy"],
            return_logits=record["logits"],
        )  # fmt: skip

    def _padding_parents(self, tokens: np.ndarray) -> np.ndarray | None:
        """A verify call's tree parents on padding `tokens` (chains), or None without trees."""
        r = self.runner
        return chain_parents(*tokens.shape) if r.drafter is not None and r.drafter.tree else None

    def _lower_sampler(self, num_rows: int):
        """`sample_step` lowered for forward steps of `num_rows` rows with sampled rows."""
        _, batch, params = self.runner.padding_rows(num_rows, greedy_only=False)
        logits = jax.ShapeDtypeStruct((num_rows, self.runner.weights.lm_head.shape[0]), np.float32)
        return sample_step.lower(logits, params, batch.start)

    def _warm_speculative(self, batch: StepBatch, params: SamplingBatch, num_pages: int, greedy_only: bool) -> None:
        """Compiles the drafting call and the verify pass of one decode shape on padding rows."""
        r = self.runner
        num_rows = batch.slots.shape[0]
        if r.drafter is not None and greedy_only:  # drafting does not depend on sampling
            zeros = np.zeros(num_rows, np.int32)
            table = np.zeros((num_rows, num_pages), np.int32)
            if r.drafter.tree:
                r.drafter.propose_tree(table, zeros, zeros, [0] * num_rows)
            else:
                r.drafter.propose(table, zeros, zeros)
        for tokens, parents in self._verify_shapes(num_rows):
            r.verify(tokens, batch, params, num_pages, greedy_only, return_logits=False, parents=parents)
