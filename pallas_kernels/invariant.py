"""Batch-invariant computation: each token's result is the same bits whatever else shares the
call (other rows, padding rows, a longer context bucket, more tokens per row).

XLA picks how to compute an operation from its shapes: its CPU backend multiplies a single
row as a matrix-vector product and splits the inner dimension differently from 48 rows up,
hands large elementwise ops (exp among them) and multiply-reduces to a library with its own
polynomials and orders, and fuses differently, which decides where a multiply and an add
become one rounding (FMA). GPU libraries pick kernels and split-K schemes by shape. The
results differ in the last bit, and a quantized KV cache turns such a bit into another code
at a codebook boundary: a request's greedy tokens then depended on its batch companions, on
how its prompt was chunked, and on whether a speculative verify pass or plain decoding
computed its keys.

So here every computation runs as one compiled program of fixed shapes, applied to one unit
of work after another (`jax.lax.map`, `jax.lax.fori_loop`): a tile of ROW_TILE tokens for
everything a token does alone (norms, projections, RoPE, quantization, the MLP, logits; a
tile of keys for decoding the cache), and for attention a tile of PAIR_TILE queries against
one block of KEY_BLOCK keys of each query's row at a time. The same program on the same
inputs gives the same bits, and a row-wise program never mixes the rows of its tile.

Attention takes each row's keys and values by position, the step's new ones placed after
the stored ones as if written first and then read (plain decoding reads every earlier token
from the cache). An online softmax walks the blocks that hold keys some query of the tile
can see; a block where a query sees nothing leaves its state unchanged exactly (weight
exp(0) = 1 on what it has, zeros added) or, before its first visible key, is wiped exactly
(weight 0), so the blocks a tile walks for its other queries change no query's result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Tokens per program tile: a decode step of one row pays for ROW_TILE (on a GPU a small
# matmul costs the same for 1 and 16 rows; the CPU cost is in docs/BENCHMARKS.md, "Batch invariance").
ROW_TILE = 16
# (row, query) pairs per attention tile: one decode step's rows, or a prefill chunk's queries.
# On 2 CPU cores 4 decodes one stream ~14% faster than 16 and 16 streams ~5% faster; prefill
# is the same.
PAIR_TILE = 4
# Keys per attention block, aligned to positions.
KEY_BLOCK = 64
MASK_VALUE = -1e30


def row_tiled(fn: Callable[..., Any], *xs: Any, tile: int = ROW_TILE) -> Any:
    """fn applied to the rows of pytrees `xs` (leaves [N, ...]) ROW_TILE rows at a time, one
    tile after another (zero rows pad the last). fn maps tiles [tile, ...] to a pytree of
    [tile, ...] arrays, each row depending on its own rows only. Returns leaves [N, ...]."""
    n = jax.tree.leaves(xs)[0].shape[0]
    padded = -(-n // tile) * tile

    def split(a):
        a = jnp.pad(a, [(0, padded - n)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(padded // tile, tile, *a.shape[1:])

    out = jax.lax.map(lambda t: fn(*t), jax.tree.map(split, xs))
    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:n], out)


def invariant_attention(
    q: jax.Array,  # [B, T, Hq, Dh] queries of the new tokens (RoPE applied)
    k_new: jax.Array,  # [B, T, Hkv, Dh] keys of the new tokens, as stored
    v_new: jax.Array,  # [B, T, Hkv, Dh]
    k_ctx: jax.Array,  # [B, Sctx, Hkv, Dh] keys stored before this step, by position
    v_ctx: jax.Array,  # [B, Sctx, Hkv, Dh]
    ctx_lens: jax.Array,  # [B] int32 tokens stored per row before this step
    num_new: jax.Array,  # [B] int32 valid new tokens per row
    *,
    scale: float | None = None,
    new_mask: jax.Array | None = None,
    window: int | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:  # [B, T, Hq, Dh]
    """`paged_attention_reference` (same arguments and masks: `new_mask` a draft tree's
    ancestors among the new tokens, `positions` their positions, a sliding `window`) with each
    query's output a function of the keys it sees only (module docstring). Stored entries at or
    past a row's length may hold anything (NaN included).

    Each query sees its keys laid out at their positions: the stored ones, then the new tokens
    on its own path (for a chain, every new token up to itself; for a tree node, its ancestors
    at their depths), as plain decoding would read them back once written. The program's unit
    is PAIR_TILE (row, query) pairs, each reading its own keys, so one decode step's rows share
    units and a prefill chunk's queries fill units of their own.
    """
    b, t, hq, dh = q.shape
    hkv = k_new.shape[2]
    scale = dh**-0.5 if scale is None else scale
    if positions is None:
        positions = ctx_lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    size = -(-max(k_ctx.shape[1], t) // KEY_BLOCK) * KEY_BLOCK  # whole blocks past every key position
    pad = [(0, 0), (0, size - k_ctx.shape[1]), (0, 0), (0, 0)]
    k_ctx, v_ctx = jnp.pad(k_ctx.astype(jnp.float32), pad), jnp.pad(v_ctx.astype(jnp.float32), pad)
    k_new, v_new = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
    depth = positions - ctx_lens[:, None]  # [B, T] each new token's depth past the stored ones
    if new_mask is None:  # a chain: the token at depth d is new token d
        path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t, t))
    else:  # path[b, q, d]: the ancestor of node q at depth d
        at_depth = new_mask[:, :, None, :] & (depth[:, None, None, :] == jnp.arange(t)[None, None, :, None])
        path = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)  # [B, T(q), T(d)]

    def pairs(a):  # [B, T, ...] -> [B T, ...]
        return a.reshape(b * t, *a.shape[2:])

    row = pairs(jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)))
    valid = pairs(jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None])

    def unit(q_u, row_u, pos_u, depth_u, valid_u, path_u):  # [RT, Hkv, G, Dh], [RT] x4, [RT, T]
        ctx_u = ctx_lens[row_u]
        # Blocks holding keys some query of the unit sees: up to each query's own position,
        # from (with a window) the earliest query's window start.
        end = jnp.max(jnp.where(valid_u, pos_u + 1, 0))
        first = 0
        if window is not None:
            earliest = jnp.min(jnp.where(valid_u, pos_u, jnp.iinfo(jnp.int32).max))
            first = jnp.clip((earliest - window + 1) // KEY_BLOCK, 0, size // KEY_BLOCK)

        def block(j, state):
            m, denom, acc = state
            start = j * KEY_BLOCK
            kpos = start + jnp.arange(KEY_BLOCK, dtype=jnp.int32)[None, :]  # [1, KB] positions
            stored = kpos < ctx_u[:, None]  # [RT, KB]
            d = kpos - ctx_u[:, None]
            on_path = (d >= 0) & (d <= depth_u[:, None])
            node = jnp.take_along_axis(path_u, jnp.clip(d, 0, t - 1), axis=1)  # [RT, KB] new token there
            here = (stored | on_path)[:, :, None, None]

            def keys(ctx, new):  # [RT, KB, Hkv, Dh]: stored, else the path's new token, else 0
                held = jnp.take(jax.lax.dynamic_slice_in_dim(ctx, start, KEY_BLOCK, axis=1), row_u, axis=0)
                fresh = new[row_u[:, None], node]
                return jnp.where(here, jnp.where(stored[:, :, None, None], held, fresh), 0.0)  # free pages: NaN

            kb, vb = keys(k_ctx, k_new), keys(v_ctx, v_new)
            visible = stored | on_path
            if window is not None:
                visible &= pos_u[:, None] - kpos < window
            hi = jax.lax.Precision.HIGHEST
            s = jnp.einsum("rhgd,rkhd->rhgk", q_u, kb, precision=hi) * scale  # [RT, Hkv, G, KB]
            seen = visible[:, None, None, :]
            s = jnp.where(seen, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[..., None] + jnp.einsum("rhgk,rkhd->rhgd", p, vb, precision=hi)
            return m_new, denom * alpha + jnp.sum(p, axis=-1), acc

        heads = (PAIR_TILE, hkv, hq // hkv)
        init = (
            jnp.full(heads, MASK_VALUE, jnp.float32),
            jnp.zeros(heads, jnp.float32),
            jnp.zeros((*heads, dh), jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(first, -(-end // KEY_BLOCK), block, init)
        return acc / jnp.maximum(denom, 1e-30)[..., None]

    grouped = q.astype(jnp.float32).reshape(b * t, hkv, hq // hkv, dh)
    args = (grouped, row, pairs(positions), pairs(depth), valid, pairs(path))
    out = row_tiled(unit, *args, tile=PAIR_TILE)
    return out.reshape(b, t, hq, dh).astype(q.dtype)
