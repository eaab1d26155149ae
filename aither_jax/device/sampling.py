"""Sampling parameters (validated on the host) and the in-step token sampler (jnp)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's and vLLM's default limit)


def _number(x) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop, in the vocabulary vLLM users know.

    Args:
        max_tokens: most tokens to generate (clipped to the model's remaining context).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches top_p (1 = off).
        top_k: keep the k most likely tokens (0 or -1 = off).
        seed: per-request seed; the same seed gives the same tokens whatever the batch.
        stop: strings that end generation; the output text stops before them.
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep going past the model's end-of-sequence tokens.
        logprobs: None for no log-probabilities; k (0 to MAX_LOGPROBS) to record each
            generated token's log-probability and the k most likely tokens at its position.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first bad field and what is allowed."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer below 2**31, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32
        ):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.stop is not None and not isinstance(self.stop, str | list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
        if any(len(s) > MAX_STOP_STRING_LEN for s in stops):
            raise ValueError(f"each stop string must be at most {MAX_STOP_STRING_LEN} characters")
        ids = self.stop_token_ids or ()
        if isinstance(ids, str | bytes) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if vocab_size is not None and any(i >= vocab_size for i in ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab_size}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@struct.dataclass
class SamplingBatch:
    """Per-row sampling settings as device arrays."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, <= 0 = off
    top_p: jax.Array  # [B] float32
    seeds: jax.Array  # [B] uint32


# Top-k / top-p thresholds come from a row's largest logits (lax.top_k) whenever the kept set
# lies inside them: first the 256 largest, then the 4,096 largest for rows whose kept set is
# wider, and a full sort only past that. XLA's CPU sort is slow: sorting 8 x 49,152 logits
# takes ~59 ms against ~1.1 ms for their top 256 and ~9.5 ms for their top 4,096 (2-core AMD
# EPYC); sampling used to sort every row of every sampled step (10 ms a row, more than the
# model's step).
WINDOWS = (256, 4096)


def filtered_logits(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """The logits [N, V] a sampled row draws from (tempered, top-k/top-p dropped to -inf), in
    vocabulary order; softmax of them is the distribution `sample_tokens` samples.

    top-k keeps the k largest logits; top-p then keeps tokens, largest first, while the
    probability mass (renormalized over the top-k set) strictly before them is below top_p,
    so the largest always stays. Both become a threshold on the row's logits, and a token
    whose logit equals the threshold is kept (tokens tied at the boundary all stay). Each row
    takes its threshold from the first of WINDOWS that holds its kept set, or from a full sort;
    a wider stage runs only when some row of the batch needs it, and which stage decides a
    row depends on that row alone, so a row's tokens do not depend on what shares the batch.
    """
    vocab = logits.shape[-1]
    temp = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    scaled = logits / temp[:, None]
    k = jnp.where((sampling.top_k > 0) & (sampling.top_k < vocab), sampling.top_k, vocab)
    top_p = sampling.top_p[:, None]
    vocab_norm = jax.nn.logsumexp(scaled, axis=-1)  # the top-k set's normalizer when top-k is off

    def stage(width: int) -> tuple[jax.Array, jax.Array]:
        """(the smallest kept logit [N], whether the kept set lies in the `width` largest [N])."""
        desc = jax.lax.top_k(scaled, width)[0] if width < vocab else -jnp.sort(-scaled, axis=-1)
        in_k = jnp.arange(width)[None, :] < k[:, None]
        norm = jnp.where(k <= width, jax.nn.logsumexp(jnp.where(in_k, desc, -jnp.inf), axis=-1), vocab_norm)
        probs = jnp.where(in_k, jnp.exp(desc - norm[:, None]), 0.0)
        before = jnp.cumsum(probs, axis=-1) - probs
        count = jnp.maximum(jnp.sum(in_k & (before < top_p), axis=-1), 1)
        fits = (k <= width) | ((k == vocab) & (before[:, -1] + probs[:, -1] >= top_p[:, 0]))
        return jnp.take_along_axis(desc, count[:, None] - 1, axis=-1)[:, 0], fits

    widths = [w for w in WINDOWS if w < vocab] + [vocab]
    need = (k < vocab) | (sampling.top_p < 1.0)  # rows that filter at all
    thr = jnp.full(k.shape, -jnp.inf, scaled.dtype)
    for width in widths:  # each stage runs only if a row still needs it (none at top-k 0, top-p 1)
        skip = (thr, jnp.zeros_like(need))
        t, fits = jax.lax.cond(jnp.any(need), lambda w=width: stage(w), lambda s=skip: s)
        thr = jnp.where(need & fits, t, thr)
        need &= ~fits
    return jnp.where(scaled >= thr[:, None], scaled, -jnp.inf)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The index of the largest logit along the last axis (the first, on ties), int32: the same
    tokens as `jnp.argmax`. Written as a max and then the smallest index that reaches it, two
    plain reductions that XLA's CPU backend vectorizes (0.34 ms against 0.93 for argmax's
    paired value/index reduction over 8 x 49,152 logits on a 2-core AMD EPYC). A row holding
    NaN, where the two forms part, gets the last index instead of an out-of-range one. Other
    backends run argmax as one reduction already and keep it."""
    if jax.default_backend() != "cpu":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    vocab = logits.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(logits == top, index, vocab), axis=-1), vocab - 1)


def sample_tokens(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array, *, greedy_only: bool) -> jax.Array:
    """Picks one token per row from logits [B, V] (float32); returns [B] int32.

    The random key of a row depends only on its seed and the position being sampled, so a
    seeded request gives the same tokens whatever else shares the batch.
    """
    greedy = greedy_tokens(logits)
    if greedy_only:
        return greedy
    return jnp.where(sampling.temperature > 0, draw_tokens(logits, sampling, positions), greedy)


def draw_tokens(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> jax.Array:
    """The sampled token of every row [N] (whatever its temperature): `blocked_gumbel_max` of
    `filtered_logits` with the key of (seed, position). A row's draw depends on its own key,
    logits and settings only; the speculative verifier draws with the same keys, so it emits
    the tokens plain decoding would."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(sampling.seeds, positions)
    return blocked_gumbel_max(filtered_logits(logits, sampling), keys)


GUMBEL_BLOCK = 128  # tokens per block in `blocked_gumbel_max`


def blocked_gumbel_max(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """A token per row of logits [N, V], distributed as softmax(logits), int32 [N].

    Gumbel-max in two levels over fixed blocks of GUMBEL_BLOCK consecutive token ids: a block
    by Gumbel-max over the blocks' log masses (log-sum-exp), then a token inside it by
    Gumbel-max over its logits. P(token) = P(block) P(token | block) = softmax(logits), and a
    row takes V / 128 + 128 random numbers (~500 for 49,152 tokens) where plain Gumbel-max
    takes V: threefry costs ~11 ns a number on a 2-core AMD EPYC, 70 ms for the 128 rows of an
    8-row, 16-token verify pass. Like plain Gumbel-max, and unlike an inverse CDF (whose
    choice moves with rounding in the sum of every earlier probability), a draw changes under
    a last-bit change of the logits only where two perturbed values nearly tie, so plain
    decoding and a speculative verify pass, which compute the logits in different shapes,
    draw the same tokens. Tokens at -inf are never drawn while the row has a finite logit; a
    row of all -inf or NaN gets a valid id.
    """
    n, v = logits.shape
    blocks = -(-v // GUMBEL_BLOCK)
    x = jnp.pad(logits, ((0, 0), (0, blocks * GUMBEL_BLOCK - v)), constant_values=-jnp.inf)
    x = x.reshape(n, blocks, GUMBEL_BLOCK)
    top = jnp.max(x, axis=(1, 2), keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    log_mass = jnp.log(jnp.sum(jnp.exp(x - top), axis=-1))  # [N, blocks], -inf for empty blocks
    block_keys, token_keys = (jax.vmap(lambda k, i=i: jax.random.fold_in(k, i))(keys) for i in (0, 1))
    gumbel = lambda ks, size: jax.vmap(lambda k: jax.random.gumbel(k, (size,), jnp.float32))(ks)  # noqa: E731
    block = greedy_tokens(log_mass + gumbel(block_keys, blocks))
    inside = jnp.take_along_axis(x, block[:, None, None], axis=1)[:, 0]  # [N, GUMBEL_BLOCK]
    token = block * GUMBEL_BLOCK + greedy_tokens(inside + gumbel(token_keys, GUMBEL_BLOCK))
    return jnp.minimum(token, v - 1)  # a row without a finite logit may land in the padding
