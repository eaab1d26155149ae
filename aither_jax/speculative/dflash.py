"""DFlash: a block-diffusion draft that proposes a whole block of tokens in one pass over the
target's tapped hidden states (its context cache shares the target's page ids), as a chain or
as a tree of the most probable paths."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aither_jax.compile.step_jit import step_jit
from aither_jax.device.sampling import greedy_tokens
from aither_jax.speculative.config import SpeculativeConfig
from models.config import ModelConfig
from models.draft import MASK, DraftConfig, DraftParams, block_forward, cast_params, context_features, context_kv
from models.draft_io import load_draft
from models.kv_cache import NULL_PAGE
from models.llama import vocab_logits
from pallas_kernels.draft_attention import draft_attention, draft_attention_reference
from pallas_kernels.unmask import confidence_unmask, confidence_unmask_reference


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
        draft: str | pathlib.Path | None,
        model_name: str,
        embed: jax.Array,
        lm_head: jax.Array,  # [V, D] the target's
        num_pages: int,
        page_size: int,
        kernels: bool,
    ):
        if draft is None:
            raise ValueError(
                f"no DFlash draft ships for {model_name!r}; train one (python -m aither_jax.train_draft) "
                "and pass its file as the speculative config's model"
            )
        if not pathlib.Path(draft).is_file():
            raise ValueError(f"DFlash draft file not found: {draft}")
        self.cfg, params, self.meta, vocab = load_draft(draft)
        # Names the draft's context bytes in the lower KV tiers (kv/store.py).
        self.fingerprint = hashlib.sha256(pathlib.Path(draft).read_bytes()).hexdigest()
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
