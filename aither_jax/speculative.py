"""Speculative decoding: proposers (DFlash block drafts, prompt lookup) and lossless verification.

A decoding step runs the target once over [last token, d_1 .. d_k] for every row and keeps
the longest accepted prefix of the drafts plus one token of the target's own (the bonus
token). Rejected positions are rolled back by the length pointer: the sequence's cached
length (`Sequence.num_cached`) only counts accepted tokens, so whatever the verify pass wrote
past it is overwritten by the next step and never read (attention masks by that length). The
draft's context cache follows the same pointer.

Verification (`verify`):
- greedy rows accept d_j while it equals the target's argmax after d_1 .. d_{j-1}; the bonus
  token is the argmax at the first mismatch (or after the last draft);
- sampled rows use the rule for a deterministic proposal (every proposer here is a
  deterministic function of the context, a DFlash draft that unmasks out of order included):
  accept d_j with probability p_j(d_j), where p_j is the distribution the target samples from
  (temperature, top-k, top-p applied); on rejection sample from p_j with d_j removed and
  renormalized; after the last accepted draft sample from p. Each emitted token is then
  distributed exactly as p_j: p(x) [accepted] + (1 - p(x)) p(y)/(1 - p(x)) [y != x].
  Min(1, p/q) with the draft's per-position marginals q is not exact for out-of-order drafts.
  The rule is run as a coupling: the target draws y_j from p_j with the key plain decoding
  uses at that position (seed, position), and d_j is accepted when y_j == d_j, else y_j is
  the next token. That has exactly the probabilities above, and every emitted token is the
  token plain decoding with the same seed samples from the same logits, whatever was drafted
  and however many drafts a step carries.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import pathlib
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aither_jax.sampling import SamplingBatch, draw_tokens, greedy_tokens
from aither_jax.step_jit import step_jit
from models.config import ModelConfig
from models.draft import MASK, DraftConfig, DraftParams, block_forward, cast_params, context_features, context_kv
from models.draft_io import load_draft
from models.kv_cache import NULL_PAGE
from models.llama import vocab_logits
from pallas_kernels.draft_attention import draft_attention, draft_attention_reference
from pallas_kernels.unmask import confidence_unmask, confidence_unmask_reference

METHODS = ("dflash", "ngram")
DRAFTS_DIR = pathlib.Path(__file__).parent / "drafts"
SHIPPED_DRAFTS = {"smollm2-135m": DRAFTS_DIR / "smollm2-135m-dflash.npz"}
CPU_TREE = 3  # drafted nodes of a default dflash config on CPU (SpeculativeConfig.tree)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate, in vLLM's `--speculative-config` vocabulary.

    Args:
        method: "dflash" (block-diffusion draft) or "ngram" (prompt lookup).
        num_speculative_tokens: drafts per step (dflash: at most block_size - 1, the default;
            ngram: default 8).
        model: the dflash draft file (.npz); default: the draft shipped for the target.
        steps: dflash denoising steps (1 = one forward pass; more unmask the most confident
            positions first on a cosine schedule).
        prompt_lookup: dflash only, on by default: a row whose context has an n-gram match
            (prompt lookup, below) takes the lookup's drafts for that step, the others the
            draft model's. The two are right in different places: lookup where the text
            repeats earlier text (code, lists, names), the draft elsewhere. The draft model is
            not run in a step where every row has a match. False: the draft model alone.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths to match (longest first).
        tree: dflash only: draft a tree of this many nodes per row instead of a chain (the
            most probable paths under the draft's per-position distributions, `draft_tree`),
            verified in one target pass (`verify_tree`). 0: a chain. Needs steps = 1; not
            with adaptive. Prompt-lookup rows still verify their chain. None (the default):
            `CPU_TREE` nodes on CPU when steps, drafts per step and adaptive are left at
            their defaults, a chain otherwise. On CPU a verify pass costs in proportion to
            the tokens it carries, and a tree of 3 measured ~1.4x the speed of a chain of 15
            (docs/DFLASH.md, "The default on CPU"); a GPU verifies 16 tokens for about the
            price of one, and its default stays the chain until trees are timed there.
        draft_kernels: run the draft's attention and unmasking with the Pallas kernels
            (pallas_kernels/draft_attention.py, unmask.py) instead of their jnp twins. Off by
            default until the kernels have been checked on a GPU.
        adaptive: choose the drafts of each step (0, 1, 3, 7, .. up to
            num_speculative_tokens) from measured acceptance and step times
            (aither_jax/draft_length.py); the output does not change, only the speed.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    steps: int = 1
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_kernels: bool = False
    adaptive: bool = False
    prompt_lookup: bool | None = None  # None: on for dflash
    tree: int | None = None  # None: `CPU_TREE` on CPU for a default dflash config, else 0

    def __post_init__(self):
        if self.prompt_lookup is None:
            object.__setattr__(self, "prompt_lookup", self.method == "dflash")
        if self.tree is None:  # a tree only for a dflash config left at its defaults, on CPU
            chain_set = self.num_speculative_tokens is not None or self.steps != 1 or self.adaptive
            on_cpu = jax.default_backend() == "cpu"
            object.__setattr__(self, "tree", CPU_TREE if self.method == "dflash" and not chain_set and on_cpu else 0)
        for name in ("draft_kernels", "adaptive", "prompt_lookup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.prompt_lookup and self.method != "dflash":
            raise ValueError(
                "prompt_lookup joins prompt lookup to a dflash draft; method 'ngram' is prompt lookup alone"
            )
        n = self.num_speculative_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 63):
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 63], got {n!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")
        if isinstance(self.tree, bool) or not isinstance(self.tree, int) or not 0 <= self.tree <= 63:
            raise ValueError(f"tree must be an integer in [0, 63] (drafted nodes; 0: a chain), got {self.tree!r}")
        if self.tree and (self.method != "dflash" or self.steps != 1 or self.adaptive):
            raise ValueError("tree drafts need method dflash with steps 1 and without adaptive")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got {lo}, {hi}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Accepts None, a method name, a dict or a JSON object string."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("{"):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"speculative config is not valid JSON: {e}") from e
            else:
                value = {"method": value}
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a method name or an object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative config needs a method, one of {METHODS}")
        return cls(**value)


# -- verification ---------------------------------------------------------------------------


def verify(
    logits: jax.Array,  # [B, T, V] float32, the target at [last, d_1 .. d_{T-1}]
    drafts: jax.Array,  # [B, T-1] int32
    num_drafts: jax.Array,  # [B] int32 valid drafts per row
    sampling: SamplingBatch,
    start: jax.Array,  # [B] int32 position of each row's last committed token
    *,
    greedy_only: bool,
) -> tuple[jax.Array, jax.Array]:
    """Returns (accepted drafts [B] int32, the token after them [B] int32)."""
    t = logits.shape[1]
    j = jnp.arange(t - 1)[None, :]
    valid = j < num_drafts[:, None]
    target = greedy_tokens(logits)  # [B, T]
    greedy_ok = (drafts == target[:, :-1]) & valid
    greedy_acc = jnp.cumprod(greedy_ok, axis=1).sum(axis=1).astype(jnp.int32)
    greedy_next = jnp.take_along_axis(target, greedy_acc[:, None], axis=1)[:, 0]
    if greedy_only:
        return greedy_acc, greedy_next

    # Sampled rows: the target's own draw at every position, with the key plain decoding uses
    # there (seed, position); d_j is accepted while it equals that draw, and the draw at the
    # first mismatch is the next token. So d_j is accepted with probability p_j(d_j), and on
    # rejection the token comes from p_j without d_j, renormalized: the deterministic-proposal
    # rule, and every emitted token is the one plain decoding with that seed would sample.
    drawn = _draws(logits, sampling, start[:, None] + 1 + jnp.arange(t)[None, :])
    acc = jnp.cumprod((drafts == drawn[:, :-1]) & valid, axis=1).sum(axis=1).astype(jnp.int32)
    sampled_next = jnp.take_along_axis(drawn, acc[:, None], axis=1)[:, 0]
    is_sampled = sampling.temperature > 0
    return jnp.where(is_sampled, acc, greedy_acc), jnp.where(is_sampled, sampled_next, greedy_next)


def _draws(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> jax.Array:
    """The target's sampled token [B, T] at every entry of logits [B, T, V], each with plain
    decoding's key for the position [B, T] of the token it chooses."""
    b, t, v = logits.shape
    rep = lambda x: jnp.repeat(x, t, axis=0)  # noqa: E731  per-row settings for every entry
    flat = SamplingBatch(rep(sampling.temperature), rep(sampling.top_k), rep(sampling.top_p), rep(sampling.seeds))
    return draw_tokens(logits.reshape(b * t, v), flat, positions.reshape(-1)).reshape(b, t)


def verify_tree(
    logits: jax.Array,  # [B, T, V] float32, the target at every node of each row's tree
    tokens: jax.Array,  # [B, T] int32 node tokens; node 0 is the last committed token
    parents: jax.Array,  # [B, T] int32 parent of each node (-1 for node 0)
    depth: jax.Array,  # [B, T] int32 each node's depth (node 0: 0)
    num_new: jax.Array,  # [B] int32 valid nodes per row
    sampling: SamplingBatch,
    start: jax.Array,  # [B] int32 position of each row's last committed token
    *,
    greedy_only: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verifies a tree of drafts per row: from node 0, the target's choice at the current node
    (its argmax, or for sampled rows its draw with plain decoding's key for that position, as
    in `verify`) is accepted if a child of the node carries it, and the walk moves there; the
    choice where no child matches is the next token. Along the accepted path this is `verify`
    on that path's chain, so the emitted tokens are the ones plain decoding gives.

    Returns (accepted drafts [B], the token after them [B], path [B, T]: the node at each depth
    of the accepted path, then index j at depths j past its end)."""
    b, t = tokens.shape
    node = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = (node < num_new[:, None]) & (node > 0)
    choice = greedy_tokens(logits)  # [B, T]
    if not greedy_only:
        drawn = _draws(logits, sampling, start[:, None] + 1 + depth)
        choice = jnp.where((sampling.temperature > 0)[:, None], drawn, choice)
    cur = jnp.zeros(b, jnp.int32)
    alive = jnp.ones(b, bool)
    accepted = jnp.zeros(b, jnp.int32)
    path = [cur]
    for j in range(1, t):
        want = jnp.take_along_axis(choice, cur[:, None], axis=1)  # [B, 1]
        match = valid & (parents == cur[:, None]) & (tokens == want)
        alive &= match.any(axis=1)
        cur = jnp.where(alive, jnp.argmax(match, axis=1).astype(jnp.int32), cur)
        accepted += alive
        path.append(jnp.where(alive, cur, j))
    next_tokens = jnp.take_along_axis(choice, cur[:, None], axis=1)[:, 0]
    return accepted, next_tokens, jnp.stack(path, axis=1)


verify_jit = step_jit(verify, static_argnames=("greedy_only",))


# -- proposers ------------------------------------------------------------------------------


def ngram_propose(tokens: Seq[int], k: int, *, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the
    longest suffix n-gram (n from max_n down to min_n); [] when nothing matches."""
    arr = np.asarray(tokens, np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)  # starts 0 .. size-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < size]  # a match must be followed by at least one token
        if hits.size:
            begin = int(hits[-1]) + n
            return [int(x) for x in arr[begin : begin + k]]
    return []


@dataclasses.dataclass
class DraftPools:
    """The draft's context keys/values, paged like the target cache (same page ids)."""

    k: jax.Array  # [L, P, page_size, Hkv, Dh]
    v: jax.Array


jax.tree_util.register_dataclass(DraftPools, data_fields=["k", "v"], meta_fields=[])


@step_jit(static_argnames=("cfg",), donate_argnames=("pools",))
def write_context(
    params: DraftParams,
    pools: DraftPools,
    hidden: jax.Array,  # [B, T, taps * D] tapped target hidden states of the new tokens
    block_tables: jax.Array,  # [max_seqs, MP] int32 the target cache's block tables
    slots: jax.Array,  # [B] int32 each row's slot (padding rows: any, with num_new 0)
    start: jax.Array,  # [B] int32
    num_new: jax.Array,  # [B] int32
    *,
    cfg: DraftConfig,
) -> DraftPools:
    """Projects new tokens' target hidden states into every draft layer's context keys/values
    and stores them at their positions (padding goes to the null page)."""
    b, t, _ = hidden.shape
    page_size = pools.k.shape[2]
    table = block_tables[jnp.minimum(slots, block_tables.shape[0] - 1)]
    positions = start[:, None] + jnp.arange(t)[None, :]
    feats = context_features(params, cfg, hidden.astype(pools.k.dtype))
    k, v = context_kv(params, cfg, feats, positions)  # [L, B, T, Hkv, Dh]
    col = jnp.minimum(positions // page_size, table.shape[1] - 1)
    page = jnp.where(jnp.arange(t)[None, :] < num_new[:, None], jnp.take_along_axis(table, col, axis=1), NULL_PAGE)
    off = positions % page_size
    layers = jnp.arange(cfg.num_layers)[:, None, None]
    return DraftPools(
        pools.k.at[layers, page[None], off[None]].set(k.astype(pools.k.dtype)),
        pools.v.at[layers, page[None], off[None]].set(v.astype(pools.v.dtype)),
    )


def _masked_block(last: jax.Array, ctx_lens: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """A block [last, MASK ..] per row and its positions, both [B, size]."""
    tokens = jnp.concatenate([last[:, None], jnp.full((last.shape[0], size - 1), MASK, jnp.int32)], axis=1)
    return tokens, ctx_lens[:, None] + jnp.arange(size)[None, :]


def _block_attention(pools: DraftPools, table: jax.Array, ctx_lens: jax.Array, kernels: bool):
    """The draft layers' attention over their paged context plus the block (`block_forward`'s
    `attend`): the Pallas kernel (interpreted on CPU) or its jnp twin."""
    fn = (
        functools.partial(draft_attention, interpret=jax.default_backend() == "cpu")
        if kernels
        else draft_attention_reference
    )

    def attend(i, q, k, v):
        return fn(q, k, v, pools.k[i], pools.v[i], table, ctx_lens)

    return attend


@step_jit(static_argnames=("cfg", "schedule", "kernels"))
def propose_block(
    params: DraftParams,
    embed: jax.Array,  # [V, D]
    lm_head: jax.Array,  # [V, D]
    pools: DraftPools,
    table: jax.Array,  # [B, NP] int32 pages to read
    ctx_lens: jax.Array,  # [B] int32 context tokens in the draft cache (= the target's cached length)
    last: jax.Array,  # [B] int32 the last committed token (block position 0)
    vocab: jax.Array | None,  # [Vd] int32 token ids of lm_head's rows; None: all, in order
    *,
    cfg: DraftConfig,
    schedule: tuple[int, ...],  # masked positions revealed per denoising step
    kernels: bool,
) -> jax.Array:
    """Fills a block [last, MASK ..] in len(schedule) denoising steps; returns the drafts
    [B, block_size - 1] (the argmax at each position, most confident revealed first)."""
    tokens, positions = _masked_block(last, ctx_lens, cfg.block_size)
    attend = _block_attention(pools, table, ctx_lens, kernels)
    unmask = (
        functools.partial(confidence_unmask, interpret=jax.default_backend() == "cpu")
        if kernels
        else confidence_unmask_reference
    )
    for count in schedule:
        h = block_forward(params, cfg, embed, tokens, positions, attend)
        logits = vocab_logits(h, lm_head)  # [B, size, V]
        conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
        pred = greedy_tokens(logits)
        if vocab is not None:
            pred = vocab[pred]
        tokens = unmask(tokens, pred, conf, count)
    return tokens[:, 1:]


TREE_WIDTH = 8  # guesses per block position a tree may branch into


@step_jit(static_argnames=("cfg", "width", "kernels"))
def block_top_k(params, embed, lm_head, pools, table, ctx_lens, last, vocab, *, cfg, width, kernels):
    """One draft pass over [last, MASK ..]: the `width` likeliest tokens at each masked
    position and their log-probabilities, ([B, block_size - 1, width] int32, float32)."""
    tokens, positions = _masked_block(last, ctx_lens, cfg.block_size)
    attend = _block_attention(pools, table, ctx_lens, kernels)
    h = block_forward(params, cfg, embed, tokens, positions, attend)[:, 1:]
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(vocab_logits(h, lm_head), axis=-1), width)
    return (ids if vocab is None else vocab[ids]).astype(jnp.int32), logp


def best_prefixes(top_logp: np.ndarray, size: int) -> list[tuple[int, ...]]:
    """The `size` most probable rank paths (r_1, .. r_d) under independent positions, where
    top_logp [P, K] holds each position's log-probabilities sorted high to low; in the order
    found, so a path's prefixes come before it (a prefix is at least as probable)."""
    depth, width = top_logp.shape
    heap = [(-float(top_logp[0, 0]), (0,))]
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < size:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        d, r = len(path), path[-1]
        if r + 1 < width:  # the next sibling: same parent, next rank at this position
            heapq.heappush(heap, (neg + float(top_logp[d - 1, r] - top_logp[d - 1, r + 1]), path[:-1] + (r + 1,)))
        if d < depth:  # the best child
            heapq.heappush(heap, (neg - float(top_logp[d, 0]), path + (0,)))
    return chosen


def draft_tree(ids: np.ndarray, logp: np.ndarray, size: int) -> tuple[list[int], list[int]]:
    """The `size` most probable paths of guesses ids/logp [P, K] (per block position, most
    likely first) as a tree: (node tokens, parent of each node), where parent 0 is the row's
    last committed token and node i is index i + 1 (so a parent always comes first)."""
    paths = best_prefixes(logp, size) if size else []
    index = {(): 0}
    tokens, parents = [], []
    for path in paths:
        index[path] = len(tokens) + 1
        tokens.append(int(ids[len(path) - 1, path[-1]]))
        parents.append(index[path[:-1]])
    return tokens, parents


class DFlashProposer:
    """Owns the draft's parameters and its paged context cache beside the target's."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        target: ModelConfig,
        *,
        model_name: str,
        embed: jax.Array,
        lm_head: jax.Array,  # [V, D] the target's
        num_pages: int,
        page_size: int,
        kernels: bool,
    ):
        path = spec.model or SHIPPED_DRAFTS.get(model_name)
        if path is None:
            raise ValueError(
                f"no DFlash draft ships for {model_name!r}; train one (python -m aither_jax.train_draft) "
                "and pass its file as the speculative config's model"
            )
        if not pathlib.Path(path).is_file():
            raise ValueError(f"DFlash draft file not found: {path}")
        self.cfg, params, self.meta, vocab = load_draft(path)
        self.cfg.check_target(target)
        k = spec.num_speculative_tokens or self.cfg.block_size - 1
        if k > self.cfg.block_size - 1:
            raise ValueError(f"num_speculative_tokens {k} exceeds the draft's block of {self.cfg.block_size} - 1")
        # A tree's nodes take the positions a chain's drafts would; its depth stays within k.
        self.num_speculative_tokens = spec.tree or k
        self.depth = k
        self.tree = spec.tree
        self.schedule = self._schedule(spec.steps)
        self.params = cast_params(params, embed.dtype)
        self.embed = embed
        # The draft's head: the target's LM head restricted to the draft's token list.
        self.vocab = None if vocab is None else jnp.asarray(vocab)
        self.lm_head = lm_head if vocab is None else jnp.asarray(lm_head[vocab])
        self.kernels = kernels
        shape = (self.cfg.num_layers, num_pages, page_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.pools = DraftPools(jnp.zeros(shape, embed.dtype), jnp.zeros(shape, embed.dtype))

    def _schedule(self, steps: int) -> tuple[int, ...]:
        from models.draft import unmask_schedule

        masked = self.cfg.block_size - 1
        if steps > masked:
            raise ValueError(f"steps {steps} exceeds the {masked} masked positions of the draft's block")
        return unmask_schedule(masked, steps)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    def write(self, hidden, block_tables, slots, start, num_new) -> None:
        """Stores the draft context of a target call's new tokens (rows as in its StepBatch)."""
        self.pools = write_context(self.params, self.pools, hidden, block_tables, slots, start, num_new, cfg=self.cfg)

    def _propose_call(self, table, ctx_lens, last, tree: bool) -> tuple[Any, tuple, dict]:
        """The drafting call (`block_top_k` for trees, else `propose_block`) and its arguments."""
        args = (self.params, self.embed, self.lm_head, self.pools, table, ctx_lens, last, self.vocab)
        if tree:
            return block_top_k, args, dict(cfg=self.cfg, width=min(self.tree, TREE_WIDTH), kernels=self.kernels)
        return propose_block, args, dict(cfg=self.cfg, schedule=self.schedule, kernels=self.kernels)

    def lower_propose(self, num_rows: int, num_pages: int):
        """The drafting call over [num_rows, num_pages] page tables, lowered (for
        `Engine.precompile`; the same shapes and types as `propose` / `propose_tree` pass)."""
        zeros = np.zeros(num_rows, np.int32)
        table = np.zeros((num_rows, num_pages), np.int32)
        fn, args, static = self._propose_call(table, zeros, zeros, tree=bool(self.tree))
        return fn.lower(*args, **static)

    def lower_write(self, hidden, block_tables, batch_rows: int):
        """`write` of tapped hidden states `hidden` (an abstract value) for a batch of
        `batch_rows` rows, lowered."""
        zeros = np.zeros(batch_rows, np.int32)
        return write_context.lower(self.params, self.pools, hidden, block_tables, zeros, zeros, zeros, cfg=self.cfg)

    def propose(self, table: np.ndarray, ctx_lens: np.ndarray, last: np.ndarray) -> np.ndarray:
        fn, args, static = self._propose_call(table, ctx_lens, last, tree=False)
        drafts = fn(*args, **static)
        return np.asarray(drafts)[:, : self.num_speculative_tokens]

    def propose_tree(
        self, table: np.ndarray, ctx_lens: np.ndarray, last: np.ndarray, limits: list[int]
    ) -> list[tuple[list[int], list[int]]]:
        """A tree of at most min(tree, limit) nodes per row (one entry per row of `limits`):
        (node tokens, parent of each node: 0 is the row's last token, node i is i + 1)."""
        fn, args, static = self._propose_call(table, ctx_lens, last, tree=True)
        ids, logp = (np.asarray(a) for a in fn(*args, **static))
        return [
            draft_tree(ids[i, : self.depth], logp[i, : self.depth], min(self.tree, k)) for i, k in enumerate(limits)
        ]

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.pools = _copy_draft_pages(self.pools, src, dst)


@step_jit(donate_argnames=("pools",))
def _copy_draft_pages(pools: DraftPools, src: jax.Array, dst: jax.Array) -> DraftPools:
    return DraftPools(pools.k.at[:, dst].set(pools.k[:, src]), pools.v.at[:, dst].set(pools.v[:, src]))
