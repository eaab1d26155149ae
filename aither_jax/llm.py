"""`LLM`: the public, vLLM-style entry point for notebooks and scripts."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import weakref
from collections.abc import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from aither_jax.context.prompt import Prompt, chat_prompt, text_prompt
from aither_jax.context.sections import Context, ContextError
from aither_jax.core.bounded import ResidencyConfig
from aither_jax.core.engine import Engine
from aither_jax.core.output import TextStream
from aither_jax.device.sampling import SamplingParams
from aither_jax.kv.tiers import TierConfig
from models.config import ModelConfig
from models.kv_spec import KVSpec, parse_kv_spec
from models.registry import DEFAULT_MODEL, default_sampling, load_model, resolve_kv_cache_dtype
from models.weights import DTYPES

DEFAULT_KV_CACHE_BYTES = 1 << 30


# The configs' field names in their messages, as `LLM`'s arguments are called.
TIER_ARGUMENTS = {
    "host_gib": "kv_offloading_size", "disk_gib": "kv_disk_size", "high_watermark": "kv_high_watermark",
    "low_watermark": "kv_low_watermark",
}  # fmt: skip
RESIDENCY_ARGUMENTS = {
    "residency max_tokens": "max_resident_tokens", "residency tau": "residency_tau",
    "residency scorer": "residency_scorer",
}  # fmt: skip


@contextlib.contextmanager
def _arguments_named(names: dict[str, str]):
    """Re-raises a config's ValueError with its field names as the arguments that set them."""
    try:
        yield
    except ValueError as e:
        message = str(e)
        for field, argument in names.items():
            message = message.replace(field, argument)
        raise ValueError(message) from None


def as_prompt_list(prompts):
    """`generate`'s prompts as a list: one prompt (text, a `Prompt`, token ids, a 1-D NumPy
    array of ids) becomes a list of one; a 2-D NumPy array, a row per prompt."""
    if isinstance(prompts, np.ndarray) and prompts.ndim in (1, 2) and np.issubdtype(prompts.dtype, np.integer):
        prompts = prompts.tolist()
    if isinstance(prompts, str | Prompt) or (
        isinstance(prompts, Sequence) and prompts and all(isinstance(t, int | np.integer) for t in prompts)
    ):
        return [prompts]
    return prompts


def resolve_dtype(dtype: str) -> str:
    """ "auto" -> float32 on CPU (bfloat16 is faster only on CPUs with bf16 instructions), bfloat16 elsewhere."""
    if dtype != "auto":
        return dtype
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve_attention(attention: str) -> str:
    """ "auto" -> the Pallas kernels on GPU, the same rotated-domain algorithm in jnp elsewhere
    (on CPU the kernels only run in the Pallas interpreter, which is for tests)."""
    if attention != "auto":
        return attention
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "xla"


def default_num_pages(spec: KVSpec, cfg: ModelConfig, *, max_num_seqs: int, max_model_len: int, page_size: int) -> int:
    """Pages for max_num_seqs full-length sequences (+ the null page), capped at 1 GiB of KV."""
    full = max_num_seqs * -(-max_model_len // page_size) + 1
    return max(2, min(full, DEFAULT_KV_CACHE_BYTES // (spec.bytes_per_token(cfg) * page_size)))


@dataclasses.dataclass
class RequestOutput:
    """One finished request."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (stop token or string) or "length"
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed and accepted for this request
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # verify passes that carried drafts
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (any tier)
    time_to_first_token: float | None = None  # seconds from being queued to the first token
    model: str | None = None  # the model that served it (set by `aj.Fleet`)
    # With SamplingParams(logprobs=k): per generated token, {token id: log-probability} of the
    # token itself (first) and of the k most likely tokens at its position, most likely first.
    logprobs: list[dict[int, float]] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the generated tokens' log-probabilities (with `logprobs` requested)."""
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs, strict=True)))


def output_logprobs(seq) -> list[dict[int, float]] | None:
    """RequestOutput.logprobs from what the engine recorded for `seq` (None if not asked)."""
    if seq.num_logprobs is None:
        return None
    return [
        {token: own} | {t: lp for t, lp in top if t != token}
        for token, (own, top) in zip(seq.output_ids, seq.logprobs, strict=True)
    ]


class LLM:
    """A model loaded from GGUF with its tokenizer and a paged KV cache.

    Args:
        model: a registered name (`smollm2-135m`) or a path to a `.gguf` file.
        dtype: weight and activation dtype: "auto" (the default: float32 on CPU, where
            bfloat16 is faster only on CPUs with bf16 instructions such as AMX, bfloat16
            elsewhere), "bfloat16" or "float32".
        kv_cache_dtype: KV cache format: "auto" (the default: the most compact format that keeps
            85% of the model's greedy chat replies identical to an unquantized cache's, bf16 for
            SmolLM2 and tq-k8v6 for Gemma-3, see models/registry.py; bf16 for unregistered GGUF
            files), "turboquant" (the model's measured per-layer TurboQuant format), "bf16",
            "fp32", or a TurboQuant format such as "tq4" or "tq-k6v4" (docs/USAGE.md: KV cache
            formats).
        max_model_len: longest prompt + completion (default: the model's context length).
        max_num_seqs: sequences decoded together.
        num_pages: KV pages in the pool (default: as many as fit in 1 GiB, at most enough for
            max_num_seqs full-length sequences).
        page_size: tokens per KV page.
        max_prefill_chunk: longest prefill chunk per call.
        max_num_batched_tokens: tokens per step over all sequences (decode rows count one
            each, prefill chunks share the rest; the prefill call padded to its row and token
            buckets stays within it too); default max(max_prefill_chunk, max_num_seqs).
        enable_prefix_caching: keep computed pages named by their tokens and start later
            prompts from the longest cached prefix (off by default here; None: on, which the
            server uses).
        max_pinned_fraction: most of the page pool that pinned prefixes may hold.
        eviction_policy: which idle cached pages leave the device first: "advisor" (the graph
            eviction advisor, aither_jax/eviction/policy.py: pages of system messages and of
            protected sections stay, the conversation due back latest goes first) or "lru"
            (least recently used). None (the default): the advisor, with prefix caching.
        max_protected_fraction: with the advisor, most of the page pool that idle protected
            pages may hold (beyond it the least recently used of them may go too). None (the
            default): 0.25, lowered (with a warning) where the pool must keep room for one
            request at full length, or at max_resident_tokens, beside the pinned and
            protected pages; a share given that leaves no such room is refused.
        advisor_weights: the advisor's score weights that differ from the defaults, as a dict
            (or JSON object) of `aither_jax.eviction.policy.AdvisorWeights` fields, such as
            {"age": 1.0}.
        kv_offloading_size: GiB of host memory for KV pages evicted from the device pool (the
            warm tier; vLLM's --kv-offloading-size): a later prompt that starts with them gets
            them back instead of recomputing them. 0 (the default) drops evicted pages.
        kv_cache_dir: a directory for the disk tier: pages leaving the host tier (or the device
            pool, without one) are written there, checksummed, and found again after a restart;
            `persist()` writes the pages still cached above it (the server does at a clean stop).
        kv_disk_size: GiB the disk tier may hold (default 4 with kv_cache_dir), pages of other
            configurations no open store holds included (they go first). The tiers need
            prefix caching (enable_prefix_caching True or None).
        kv_high_watermark: with the tiers, idle cached pages beyond this share of the device
            pool are demoted between steps, ahead of need.
        kv_low_watermark: with the tiers, while less than this share of the device pool is in
            use, the pages of requests waiting for a slot are promoted from host or disk ahead
            of their admission (default 0.5, or kv_high_watermark if lower; 0 turns it off).
        attention: "auto" (Pallas kernels on GPU, their rotated-domain algorithm in jnp on
            CPU), "pallas", "xla" or "reference"; the reference decodes quantized pages into a
            buffer. "invariant" is what `batch_invariant` runs.
        batch_invariant: every request's greedy tokens are the same whatever shares its batch,
            however its prompt was chunked and whether speculation verified them, with every KV
            format (`models.llama_invariant`): each token's keys, values and logits are computed
            by programs of fixed shapes. Costs speed (docs/BENCHMARKS.md, "Batch invariance"); turns off
            `shared_prefix_attention`.
        seed: seeds requests that bring no seed of their own.
        speculative: speculative decoding: None (off), "dflash" (the draft shipped for the
            model), "ngram" (prompt lookup), or a dict / JSON string of
            `aither_jax.speculative.config.SpeculativeConfig` fields, such as
            {"method": "dflash", "num_speculative_tokens": 7, "steps": 2}. Output is lossless:
            the target's own greedy tokens, or its own sampling distribution.
        shared_prefix_attention: decode steps whose rows all hold the same cached prefix pages
            (512 tokens or more, with prefix caching) read those pages once for the batch
            instead of once per row, and merge (vLLM's "cascade attention").
        num_scheduler_steps: decode steps per device call when only decoding is left to do
            (no prompt being read, no request waiting for a slot): each row feeds back its own
            sampled token inside the call, so the host syncs once per `num_scheduler_steps`
            tokens (vLLM's multi-step scheduling). The tokens are those of single steps; a row
            that stops early has computed up to num_scheduler_steps - 1 tokens for nothing. On
            2 CPU cores 8 gains 7-18% at one row and 0-7% at 8 (the host's share of a step is
            small there); it is meant for accelerators. Not with `speculative`.
        max_resident_tokens: bounded residency (aither_jax/core/bounded.py): each sequence keeps
            at most this many tokens' KV pages on the device (its sink pages, protected system
            and identity pages, a tail window and the best-scored rest) and the rest on the
            host, byte-exact, so contexts may be longer than the device pool. None: off.
        residency_tau: with max_resident_tokens, reselect the resident set every this many
            tokens (at least history / 45).
        residency_scorer: which pages stay resident: "attention" (their recent attention mass plus
            the newest query's estimate), "qk" (the newest query's estimated attention share from
            each page's mean key), "lru" (most recently written first) or "window" (sinks and the
            newest pages, no protection).
        chat_template: jinja2 source that replaces the model's chat template for this `LLM`
            (`chat`, `context`) only; other `LLM`s of the model keep theirs.
        progress: show progress bars while loading and generating.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "auto",
        *,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        num_pages: int | None = None,
        page_size: int = 16,
        max_prefill_chunk: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = False,
        max_pinned_fraction: float = 0.5,
        eviction_policy: str | None = None,
        max_protected_fraction: float | None = None,
        advisor_weights: dict | str | None = None,
        kv_offloading_size: float = 0.0,
        kv_cache_dir: str | os.PathLike | None = None,
        kv_disk_size: float | None = None,
        kv_high_watermark: float = 0.8,
        kv_low_watermark: float | None = None,
        attention: str = "auto",
        batch_invariant: bool = False,
        seed: int = 0,
        speculative: str | dict | None = None,
        shared_prefix_attention: bool = True,
        num_scheduler_steps: int = 1,
        max_resident_tokens: int | None = None,
        residency_tau: int = 64,
        residency_scorer: str = "attention",
        chat_template: str | None = None,
        progress: bool = True,
        _cache_fill_value: float = 0.0,
        _num_layers: int | None = None,
    ):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        for name, flag in (
            ("batch_invariant", batch_invariant), ("shared_prefix_attention", shared_prefix_attention),
            ("progress", progress), ("enable_prefix_caching", enable_prefix_caching),
        ):  # fmt: skip
            if not isinstance(flag, bool) and not (flag is None and name == "enable_prefix_caching"):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        for name, value, low, high in (("page_size", page_size, 1, 1 << 16), ("seed", seed, 0, 1 << 63)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}), got {value!r}")
        dtype = resolve_dtype(dtype)
        if batch_invariant:
            if attention not in ("auto", "invariant"):
                raise ValueError(f"batch_invariant runs its own attention; leave attention 'auto', got {attention!r}")
            attention = "invariant"
        # `_num_layers` (tests): the first blocks only (`load_model`).
        self.model = load_model(model, dtype, progress=progress, num_layers=_num_layers)
        self.model_path, self.model_name, self.dtype = self.model.path, model, dtype
        self.config, self.tokenizer = self.model.config, self.model.tokenizer
        if chat_template is not None:  # the loaded model's tokenizer is shared: change a copy
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.set_chat_template(chat_template)
        self.load_seconds = self.model.load_seconds
        self.sampling_defaults = default_sampling(model)  # what `sampling_params=None` samples with
        max_model_len = self.config.max_context if max_model_len is None else max_model_len
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.model.name)
        self.kv_spec = parse_kv_spec(kv_cache_dtype)
        residency = None
        if max_resident_tokens is not None:
            residency = ResidencyConfig(max_resident_tokens, tau=residency_tau, scorer=residency_scorer)
            with _arguments_named(RESIDENCY_ARGUMENTS):
                residency.check()
        if num_pages is None:
            per_seq = max_model_len if residency is None else min(max_model_len, max_resident_tokens)
            num_pages = default_num_pages(
                self.kv_spec, self.config, max_num_seqs=max_num_seqs, max_model_len=per_seq, page_size=page_size
            )
        self.progress = progress
        # Called once a batch's requests are queued, before its steps run (a fleet's balloon).
        self.before_steps: Callable[[], object] | None = None
        with _arguments_named(TIER_ARGUMENTS):
            tiers = TierConfig(
                host_gib=kv_offloading_size,
                disk_dir=None if kv_cache_dir is None else os.fspath(kv_cache_dir),
                disk_gib=kv_disk_size,
                high_watermark=kv_high_watermark,
                low_watermark=kv_low_watermark,
            )
        if tiers.enabled and enable_prefix_caching is False:
            raise ValueError("kv_offloading_size and kv_cache_dir need prefix caching: enable_prefix_caching=True")
        if eviction_policy not in (None, "lru") and enable_prefix_caching is False:
            raise ValueError(f"eviction_policy {eviction_policy!r} needs prefix caching: enable_prefix_caching=True")
        self.engine = Engine(
            self.model,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_pages=num_pages,
            page_size=page_size,
            max_prefill_chunk=max_prefill_chunk,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            max_pinned_fraction=max_pinned_fraction,
            eviction_policy=eviction_policy,
            max_protected_fraction=max_protected_fraction,
            advisor_weights=advisor_weights,
            kv_cache_dtype=kv_cache_dtype,
            attention=resolve_attention(attention),
            cache_fill_value=_cache_fill_value,
            seed=seed,
            speculative=speculative,
            shared_prefix_attention=shared_prefix_attention,
            num_scheduler_steps=num_scheduler_steps,
            tiers=tiers,
            residency=residency,
        )

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Completes each prompt (text, a list of token ids, or a `Prompt`, such as a `Context`
        assembles); outputs keep the input order."""
        prompts = as_prompt_list(prompts)
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        assembled = [
            self._completion_prompt(p, f"prompt {i}", "a string or a list of token ids") for i, p in enumerate(prompts)
        ]
        return self._run(assembled, sampling_params, use_tqdm)

    def _completion_prompt(self, prompt, name: str, allowed: str) -> Prompt:
        """A `Prompt` as given, or text or token ids encoded; else ValueError "<name> must be <allowed>"."""
        if isinstance(prompt, Prompt):
            return prompt
        try:
            return text_prompt(self.tokenizer, prompt)
        except ValueError:
            raise ValueError(f"{name} must be {allowed}") from None

    def _default_params(self) -> SamplingParams:
        """What `sampling_params=None` samples with: the model's recommended sampling (its card),
        else the API's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Like `generate` for conversations rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        return self._run([chat_prompt(self.tokenizer, c) for c in conversations], sampling_params, use_tqdm)

    def context(self, *, context_budget: int | None = None, prefill_budget: int | None = None) -> Context:
        """A context pipeline for this model (aither_jax/context/sections.py): assembles tagged
        sections within `context_budget` prompt tokens (default: max_model_len less 256 for the
        answer) and `prefill_budget` new tokens per request; `generate` takes what it assembles.
        Its stable prefix is pinned once seen when prefix caching is on, and what of it the
        engine holds cached costs no prefill (its budget cascades downstream)."""
        max_len = self.engine.max_model_len
        if isinstance(context_budget, int) and not isinstance(context_budget, bool) and context_budget > max_len:
            raise ContextError(f"context_budget {context_budget} exceeds the model's max_model_len {max_len}")
        budget = max(1, max_len - 256) if context_budget is None else context_budget
        ctx = Context(
            self.tokenizer, context_budget=budget, prefill_budget=prefill_budget,
            cached_tokens=self.engine.cached_prefix_tokens,
        )  # fmt: skip
        # A context dropped by its caller (and its prompts) gives its pin back.
        weakref.finalize(ctx.pin_owner, self.engine.release_pin, ctx.pin_owner.key)
        return ctx

    def warmup(self, max_len: int | None = None, *, sampling: bool = True, workers: int | None = None) -> int:
        """Compiles every decode shape up to `max_len` tokens (default: max_model_len) now,
        so decoding never compiles later; returns the number of shapes compiled. `workers`:
        threads compiling at once (default: the CPU cores, at most 8)."""
        return self.engine.warmup(max_len, sampling=sampling, progress=self.progress, workers=workers)

    def persist(self) -> int:
        """Writes every cached KV page still on the device or in host memory to the disk tier
        (`kv_cache_dir`), so a later process finds them; returns how many. Without a disk tier
        there is nowhere to write: ValueError."""
        if self.engine.tiers is None or self.engine.tiers.disk is None:
            raise ValueError("persist() writes to the disk tier: create the LLM with kv_cache_dir")
        return self.engine.persist()

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] float32 at every position, through the paged-cache path."""
        return self.engine.score([int(t) for t in ids])

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self._default_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        seqs = []
        try:
            for p, params in zip(prompts, sampling_params, strict=True):
                seqs.append(
                    self.engine.add_request(
                        p.ids, params, pin_tokens=p.num_pinned, sections=p.sections, pin_key=p.pin_key
                    )
                )
            if self.before_steps is not None:
                self.before_steps()
            show = self.progress if use_tqdm is None else use_tqdm
            with tqdm(total=len(seqs), desc="generating", unit="req", disable=not show) as bar:
                while self.engine.has_unfinished():
                    bar.update(len(self.engine.step()))
        except BaseException:
            for s in seqs:
                self.engine.abort(s)
            raise
        return [request_output(p, s) for p, s in zip(prompts, seqs, strict=True)]

    def stream(
        self, prompt: str | Sequence[int] | Sequence[dict] | Prompt, sampling_params: SamplingParams | None = None
    ) -> StreamedOutput:
        """One completion as it is decoded: iterate the result for pieces of its text (never
        taken back: a possible stop string or an incomplete character is held until settled);
        its `output` is the RequestOutput once the iteration ends. `prompt`: text, token ids,
        a `Prompt`, or a conversation (a list of messages, through the chat template)."""
        if is_conversation(prompt):
            assembled = chat_prompt(self.tokenizer, prompt)
        else:
            assembled = self._completion_prompt(prompt, "prompt", "a string, a list of token ids or a list of messages")
        params = self._default_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        return StreamedOutput(self, assembled, params)


def is_conversation(prompt) -> bool:
    """A list of message dicts (as opposed to text, token ids or a `Prompt`)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and bool(prompt)
        and all(isinstance(m, dict) for m in prompt)
    )


def request_output(prompt: Prompt, seq) -> RequestOutput:
    return RequestOutput(
        prompt.text,
        seq.prompt_ids,
        seq.text,
        seq.output_ids,
        seq.finish_reason,
        seq.num_draft_tokens,
        seq.num_accepted_tokens,
        seq.num_spec_steps,
        seq.num_cached_prompt,
        None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
        logprobs=output_logprobs(seq),
    )


class StreamedOutput:
    """`LLM.stream`'s completion: iterating it decodes, yielding text pieces as they settle;
    `output` holds the RequestOutput once it is done. Leaving the loop early (or an error)
    aborts the request and frees its pages."""

    def __init__(self, llm: LLM, prompt: Prompt, params: SamplingParams):
        self._llm, self._prompt, self._params = llm, prompt, params
        self.output: RequestOutput | None = None
        self.model: str | None = None  # the model that serves it (set by `aj.Fleet`)
        self._started = False

    def __iter__(self):
        if self._started:
            raise RuntimeError("a streamed output can be iterated once")
        self._started = True
        engine, prompt = self._llm.engine, self._prompt
        # Queued only once iterated: a stream never read holds no pages. A prompt the engine
        # refuses (too long for the model) raises ValueError here.
        seq = engine.add_request(
            prompt.ids, self._params, pin_tokens=prompt.num_pinned, sections=prompt.sections, pin_key=prompt.pin_key
        )
        text = TextStream(self._llm.tokenizer, self._params.stop_strings)
        try:
            if self._llm.before_steps is not None:
                self._llm.before_steps()
            while not seq.finished:
                engine.step()
                if not seq.finished:
                    piece = text.delta(seq.output_ids)
                    if piece:
                        yield piece
            # The rest, held back until now; also what other streams' steps decoded for it
            # while this one waited at a yield (they step the same engine).
            piece = text.finish(seq.text)
            if piece:
                yield piece
        finally:
            if not seq.finished:
                engine.abort(seq)
        self.output = request_output(prompt, seq)
        self.output.model = self.model
