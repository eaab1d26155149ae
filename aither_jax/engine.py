"""The engine: sequences in cache slots, chunked prefill and batched decode, one step at a time.

Each `step()` runs at most one prefill call (a chunk of every sequence still reading its
prompt) and one decode call (every sequence that is generating). Sequences join when a slot
and enough pages are free and leave as soon as they finish, so the batch changes between
steps without recompiling: every call is padded to a bucket (powers of two) of rows, tokens
per row and pages read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math

import jax
import numpy as np
from tqdm.auto import tqdm

from aither_jax.page_allocator import PageAllocator
from aither_jax.sampling import SamplingBatch, SamplingParams
from aither_jax.steps import CompileCounter, model_step
from models.config import ModelConfig
from models.kv_cache import NULL_PAGE, init_cache
from models.llama import ATTENTION_IMPLS, StepBatch
from models.tokenizer import Tokenizer
from models.weights import ModelWeights

log = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
MIN_PAGE_BUCKET = 8


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n, clamped to [minimum, maximum]."""
    return max(minimum, min(maximum, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state on the host."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # params.max_tokens clipped to the context left
    stop_ids: frozenset[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the cache
    text: str = ""
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Owns the device cache and schedules sequences over it."""

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
        kv_cache_dtype: str = "bf16",
        attention: str = "reference",
        cache_fill_value: float = 0.0,
        seed: int = 0,
    ):
        for name, value, low in (
            ("max_num_seqs", max_num_seqs, 1),
            ("max_model_len", max_model_len, 1),
            ("num_pages", num_pages, 2),
            ("page_size", page_size, 1),
            ("max_prefill_chunk", max_prefill_chunk, 1),
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
        self.cache = init_cache(
            cfg,
            num_pages=num_pages,
            max_seqs=max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
            page_size=page_size,
            kv_cache_dtype=kv_cache_dtype,
            fill_value=cache_fill_value,
        )
        self.allocator = PageAllocator(num_pages)
        self.block_tables = np.full((max_num_seqs, self.max_pages_per_seq), NULL_PAGE, np.int32)
        self._tables_dirty = False
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._rng = np.random.default_rng(seed)
        self._next_id = 0
        self._seen_shapes: set[tuple] = set()
        self.warmed_up = False

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queues a tokenized prompt. Raises ValueError if it can never fit."""
        params.validate(self.cfg.vocab_size)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the maximum context length is {self.max_model_len} "
                "tokens and at least one must be left to generate"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        if self._pages_needed(len(prompt_ids) + max_tokens) > self.allocator.num_pages - 1:
            raise ValueError(
                f"the request needs {self._pages_needed(len(prompt_ids) + max_tokens)} KV pages but the cache "
                f"has {self.allocator.num_pages - 1}; lower max_tokens or raise num_pages"
            )
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.stop_token_ids)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        seq = Sequence(self._next_id, [int(t) for t in prompt_ids], params, seed, max_tokens, frozenset(stop_ids))
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            need = self._pages_needed(len(seq.prompt_ids) + seq.max_tokens)
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            self._assign(seq, need)
            self.running.append(seq)

    def _assign(self, seq: Sequence, num_pages: int) -> None:
        """Gives a sequence a free slot and `num_pages` pages, recorded in its block-table row."""
        seq.pages = self.allocator.allocate(num_pages)
        seq.slot = self._free_slots.pop()
        self.block_tables[seq.slot] = NULL_PAGE
        self.block_tables[seq.slot, : len(seq.pages)] = seq.pages
        self._tables_dirty = True

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        self.block_tables[seq.slot] = NULL_PAGE
        self._tables_dirty = True
        self._free_slots.append(seq.slot)
        seq.slot = -1

    def abort(self, seq: Sequence) -> None:
        """Stops a request and returns its slot and pages."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Admits, runs one prefill chunk and one decode step; returns sequences that finished."""
        self._admit()
        prefill = [s for s in self.running if s.prefilling]
        decode = [s for s in self.running if not s.prefilling and not s.finished]
        if prefill:
            rows = []
            for s in prefill:
                n = min(len(s.prompt_ids) - s.num_cached, self.max_prefill_chunk)
                rows.append((s, s.prompt_ids[s.num_cached : s.num_cached + n]))
            next_tokens, _ = self._run(rows, all_logits=False)
            for (s, chunk), tok in zip(rows, next_tokens, strict=True):
                s.num_cached += len(chunk)
                if not s.prefilling:
                    self._append(s, int(tok))
        if decode:
            rows = [(s, [s.output_ids[-1]]) for s in decode]
            next_tokens, _ = self._run(rows, all_logits=False)
            for s, tok in zip(decode, next_tokens, strict=True):
                s.num_cached += 1
                self._append(s, int(tok))
        finished = [s for s in self.running if s.finished]
        for s in finished:
            self.running.remove(s)
            self._release(s)
        return finished

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
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

    def _run(self, rows: list[tuple[Sequence, list[int]]], *, all_logits: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """One padded call of the jitted step over (sequence, new tokens) rows."""
        if self._tables_dirty:
            self.cache = self.cache.replace(block_tables=jax.device_put(self.block_tables))
            self._tables_dirty = False
        num_rows = bucket(len(rows), 1, self.max_num_seqs)
        longest = max(len(toks) for _, toks in rows)
        num_tokens = 1 if longest == 1 and not all_logits else bucket(longest, MIN_TOKEN_BUCKET, self.max_prefill_chunk)
        end = max(s.num_cached + len(toks) for s, toks in rows)
        num_pages = bucket(self._pages_needed(end), MIN_PAGE_BUCKET, self.max_pages_per_seq)
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
        greedy_only = bool(np.all(temperature == 0))
        next_tokens, logits = self._dispatch(tokens, batch, sampling, num_pages, all_logits, greedy_only)
        return np.asarray(next_tokens)[: len(rows)], logits

    def _dispatch(self, tokens, batch, sampling, num_pages: int, all_logits: bool, greedy_only: bool):
        num_rows, num_tokens = tokens.shape
        key = (num_rows, num_tokens, num_pages, all_logits, greedy_only)
        if key not in self._seen_shapes:
            if self.warmed_up and num_tokens == 1 and not all_logits:
                log.warning("decode shape %s was not compiled during warm-up: this step compiles", key)
            self._seen_shapes.add(key)
        next_tokens, logits, self.cache = model_step(
            self.weights,
            self.cache,
            tokens,
            batch,
            sampling,
            cfg=self.cfg,
            num_pages=num_pages,
            all_logits=all_logits,
            greedy_only=greedy_only,
            attention=self.attention,
        )
        return next_tokens, logits

    def warmup(self, max_len: int | None = None, *, sampling: bool = True, progress: bool = False) -> int:
        """Compiles every decode shape for sequences up to `max_len` tokens.

        Covers each batch bucket (1, 2, 4, .. max_num_seqs) times each page bucket up to
        `max_len` (default max_model_len), greedy and, with `sampling`, sampled. The calls run
        on padding rows only, which write to the null page and change nothing. Afterwards a
        decode step with a shape outside this set logs a warning. Returns the number of shapes.
        """
        max_len = self.max_model_len if max_len is None else max_len
        if not 1 <= max_len <= self.max_model_len:
            raise ValueError(f"max_len must be in [1, {self.max_model_len}], got {max_len}")
        rows = sorted({bucket(n, 1, self.max_num_seqs) for n in range(1, self.max_num_seqs + 1)})
        pages = sorted(
            {bucket(n, MIN_PAGE_BUCKET, self.max_pages_per_seq) for n in range(1, self._pages_needed(max_len) + 1)}
        )
        shapes = [(r, p, g) for r in rows for p in pages for g in ((True, False) if sampling else (True,))]
        for num_rows, num_pages, greedy_only in tqdm(shapes, desc="compiling decode steps", disable=not progress):
            zeros = np.zeros(num_rows, np.int32)
            batch = StepBatch(np.full(num_rows, self.max_num_seqs, np.int32), zeros, zeros)
            temperature = np.full(num_rows, 0.0 if greedy_only else 1.0, np.float32)
            params = SamplingBatch(temperature, zeros, np.ones(num_rows, np.float32), zeros.astype(np.uint32))
            tokens = np.zeros((num_rows, 1), np.int32)
            tokens, _ = self._dispatch(tokens, batch, params, num_pages, False, greedy_only)
        if shapes:
            tokens.block_until_ready()
        self.warmed_up = True
        return len(shapes)

    # -- scoring ----------------------------------------------------------------------------

    def score(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), V] float32 for every position, computed through the paged cache."""
        if not ids:
            raise ValueError("ids is empty")
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the maximum context length of {self.max_model_len} tokens")
        if not self._free_slots or not self.allocator.can_allocate(self._pages_needed(len(ids))):
            raise RuntimeError("no free cache slot or pages to score with; wait for running requests")
        seq = Sequence(-1, list(ids), SamplingParams(max_tokens=1, temperature=0.0), 0, 1, frozenset())
        self._assign(seq, self._pages_needed(len(ids)))
        chunks = []
        try:
            while seq.prefilling:
                n = min(len(ids) - seq.num_cached, self.max_prefill_chunk)
                _, logits = self._run([(seq, seq.prompt_ids[seq.num_cached : seq.num_cached + n])], all_logits=True)
                chunks.append(np.asarray(logits[0, :n]))
                seq.num_cached += n
        finally:
            self._release(seq)
        return np.concatenate(chunks, axis=0)

    @property
    def num_compiles(self) -> int:
        """XLA compilations so far in this process."""
        return CompileCounter.count()
