"""Attention over a paged KV cache: the plain-jnp reference that kernels must match.

The stored context arrives as the keys/values of the pages a row's block table lists, in
order; a kernel version reads the pages directly instead of taking them gathered.

Masking is strict: scores of keys at or past a row's KV length are replaced (not added to)
and their values zeroed before use, so garbage in unused or freed pages (NaN in tests) can
never reach the output, even multiplied by a zero weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# A finite "minus infinity": a query row with no visible key then gets uniform weights over
# zeroed values (output 0) instead of NaN from exp(-inf - -inf).
MASK_VALUE = -1e30


def dot_precision(dtype) -> jax.lax.Precision:
    """float32 runs ask for full-precision matmuls (GPUs otherwise use TF32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


# How a Pallas kernel multiplies two float32 tiles (`tile_dot`): "float32" exactly (on a GPU,
# Triton's FMA loop; no tensor cores), "bf16x3" as three bfloat16 tensor-core products (each
# operand split into a bfloat16 part and a bfloat16 remainder; the product of the remainders
# is left out, ~1e-5 relative), "bf16" as one product of operands rounded to bfloat16
# (float32 accumulation).
DOT_PRECISIONS = ("float32", "bf16x3", "bf16")


def tile_dot(a: jax.Array, b: jax.Array, contract: tuple[tuple[int], tuple[int]], precision: str) -> jax.Array:
    """A product of two float32 tiles in a kernel (every dimension >= 16, as Triton's dot
    wants), with a float32 result, computed as `precision` says (`DOT_PRECISIONS`). The
    bfloat16 splits are written out, not left to a dot algorithm, so that the interpreter
    computes what the tensor cores do (XLA's CPU backend computes bfloat16 dot algorithms in
    float32)."""

    def product(x, y):
        hi = jax.lax.Precision.HIGHEST
        return jax.lax.dot_general(x, y, (contract, ((), ())), precision=hi, preferred_element_type=jnp.float32)

    if precision == "float32":
        return product(a, b)
    a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    if precision == "bf16":
        return product(a_hi, b_hi)
    a_lo = (a - a_hi.astype(jnp.float32)).astype(jnp.bfloat16)
    b_lo = (b - b_hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return product(a_lo, b_hi) + product(a_hi, b_lo) + product(a_hi, b_hi)  # the small terms first


# XLA's CPU dot emitter wants both operands' contracted axis last, so a [S, Dh] block of
# keys or values becomes a transposed copy as large as the context before every product.
# With a handful of query rows per KV head (decode) over a long context, the same sums as
# broadcast multiply-reduce loops read the context once, in place: three times faster on a
# 2,048-token context. With more rows the matmul's reuse wins; on short contexts the copy is
# cheap and the matmul slightly faster.
FEW_QUERY_ROWS = 8
LONG_CONTEXT = 512


def few_query_rows(num_rows: int, context: int) -> bool:
    """Whether `context_scores` / `context_sum` take the multiply-reduce form (CPU only: GPU
    matmuls read their operands in place)."""
    return num_rows <= FEW_QUERY_ROWS and context >= LONG_CONTEXT and jax.default_backend() == "cpu"


def context_scores(q: jax.Array, k: jax.Array, precision=None, *, heads_first: bool = False) -> jax.Array:
    """q [B, H, Q, Dh] . k [B, S, H, Dh] (or [B, H, S, Dh] with `heads_first`) -> [B, H, Q, S] float32."""
    if few_query_rows(q.shape[2], k.shape[2 if heads_first else 1]):
        kf = k.astype(jnp.float32)
        if heads_first:
            return jnp.sum(q.astype(jnp.float32)[:, :, :, None] * kf[:, :, None], axis=-1)
        prod = q.astype(jnp.float32)[:, None] * kf[:, :, :, None]  # [B, S, H, Q, Dh]
        return jnp.moveaxis(jnp.sum(prod, axis=-1), 1, -1)
    spec = "bhqd,bhsd->bhqs" if heads_first else "bhqd,bshd->bhqs"
    return jnp.einsum(spec, q, k, preferred_element_type=jnp.float32, precision=precision)


def context_sum(p: jax.Array, v: jax.Array, precision=None, *, heads_first: bool = False) -> jax.Array:
    """Weights p [B, H, Q, S] times values v [B, S, H, Dh] (or [B, H, S, Dh] with
    `heads_first`) summed over S -> [B, H, Q, Dh] float32."""
    if few_query_rows(p.shape[2], v.shape[2 if heads_first else 1]):
        vf = v.astype(jnp.float32)
        if heads_first:
            return jnp.sum(p.astype(jnp.float32)[..., None] * vf[:, :, None], axis=3)
        prod = jnp.moveaxis(p.astype(jnp.float32), -1, 1)[..., None] * vf[:, :, :, None]
        return jnp.sum(prod, axis=1)  # [B, S, H, Q, Dh] -> [B, H, Q, Dh]
    spec = "bhqs,bhsd->bhqd" if heads_first else "bhqs,bshd->bhqd"
    return jnp.einsum(spec, p, v, preferred_element_type=jnp.float32, precision=precision)


def causal_mask(t: int) -> jax.Array:
    """[T(query), T(key)]: each new token sees itself and the new tokens before it."""
    return jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]


def paged_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh] queries of the new tokens (RoPE applied)
    k_new: jax.Array,  # [B, T, Hkv, Dh] keys of the new tokens
    v_new: jax.Array,  # [B, T, Hkv, Dh]
    k_ctx: jax.Array,  # [B, Sctx, Hkv, Dh] keys stored before this step, read from the row's pages
    v_ctx: jax.Array,  # [B, Sctx, Hkv, Dh]
    ctx_lens: jax.Array,  # [B] int32, tokens already stored per row (positions 0..ctx_len-1)
    num_new: jax.Array,  # [B] int32, valid new tokens per row (positions ctx_len..ctx_len+num_new-1)
    *,
    scale: float | None = None,
    return_lse: bool = False,
    new_mask: jax.Array | None = None,
    window: int | None = None,
    positions: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, T, Hq, Dh] (and [B, T, Hq] float32)
    """Causal grouped-query attention of the new tokens over the stored context plus themselves.

    New token t of row b sees every stored key j < ctx_lens[b] and new tokens u <= t with
    u < num_new[b]. Stored entries at or past ctx_lens[b] (unused or freed pages) are zeroed
    before use. With `return_lse` also returns the log of each query's softmax denominator
    (scaled scores), for `merge_attention`. `new_mask` [B, T(query), T(key)] replaces the
    causal mask among the new tokens (a draft tree: each node sees its ancestors and itself).
    With a sliding `window` (Gemma's local layers), a query at position p sees only keys at
    positions p - window + 1 .. p: stored key j sits at position j, and new token t at
    `positions[b, t]` (default ctx_lens[b] + t; a tree node's is its depth's).
    """
    b, t, hq, dh = q.shape
    hkv = k_new.shape[2]
    scale = dh**-0.5 if scale is None else scale
    prec = dot_precision(q.dtype)

    mask, kv_valid = _visible(ctx_lens, num_new, k_ctx.shape[1], t, new_mask, window, positions)
    # Masked scores are replaced below, NaN or not, so keys need no zeroing; values do, since
    # a zero weight times NaN is NaN.
    k = jnp.concatenate([k_ctx.astype(q.dtype), k_new], axis=1)
    v = jnp.where(kv_valid[:, :, None, None], jnp.concatenate([v_ctx.astype(q.dtype), v_new], axis=1), 0)

    g = hq // hkv
    qg = jnp.moveaxis(q.reshape(b, t, hkv, g, dh), 1, 3).reshape(b, hkv, g * t, dh)  # rows (g, t)
    s = context_scores(qg, k, prec).reshape(b, hkv, g, t, -1) * scale
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).reshape(b, hkv, g * t, -1)
    out = context_sum(p.astype(v.dtype), v, prec).reshape(b, hkv, g, t, dh)
    out = jnp.moveaxis(out, 3, 1).reshape(b, t, hq, dh).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hkv, G, T]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, t, hq)


def _visible(ctx_lens, num_new, num_ctx: int, t: int, new_mask, window, positions):
    """(mask [B, T, Sctx + T]: which keys each new token sees, kv_valid [B, Sctx + T]) for
    `paged_attention_reference`'s arguments."""
    b = ctx_lens.shape[0]
    ctx_valid = jnp.arange(num_ctx, dtype=jnp.int32)[None, :] < ctx_lens[:, None]  # [B, Sctx]
    new_valid = jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None]  # [B, T]
    kv_valid = jnp.concatenate([ctx_valid, new_valid], axis=1)  # [B, Sctx + T]
    among_new = causal_mask(t)[None] if new_mask is None else new_mask  # [B or 1, T, T]
    mask = jnp.concatenate(
        [jnp.broadcast_to(ctx_valid[:, None, :], (b, t, num_ctx)), among_new & new_valid[:, None, :]], axis=2
    )  # [B, T, Sctx + T]
    if window is not None:
        if positions is None:
            positions = ctx_lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        ctx_pos = jnp.broadcast_to(jnp.arange(num_ctx, dtype=jnp.int32)[None, :], (b, num_ctx))
        key_pos = jnp.concatenate([ctx_pos, positions], axis=1)  # [B, Sctx + T]
        mask &= positions[:, :, None] - key_pos[:, None, :] < window
    return mask, kv_valid


def page_attention_mass(
    q: jax.Array,  # [B, T, Hq, Dh] queries of the new tokens
    k_new: jax.Array,  # [B, T, Hkv, Dh] their keys
    k_ctx: jax.Array,  # [B, Sctx, Hkv, Dh] stored keys, Sctx a whole number of pages
    ctx_lens: jax.Array,  # [B]
    num_new: jax.Array,  # [B]
    page_size: int,
    *,
    scale: float | None = None,
    new_mask: jax.Array | None = None,
    window: int | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:  # [B, Sctx // page_size] float32
    """The softmax mass each row's new tokens put on each stored page: the attention weights
    of `paged_attention_reference` (same arguments, same masks) on the page's keys, summed over
    the page and averaged over the query heads and the row's valid new tokens, so a row's
    masses sum to its share of attention on stored keys (at most 1; the rest fell on the new
    tokens themselves). Rows with no new tokens get zeros."""
    b, t, hq, dh = q.shape
    hkv, num_ctx = k_new.shape[2], k_ctx.shape[1]
    scale = dh**-0.5 if scale is None else scale
    mask, _ = _visible(ctx_lens, num_new, num_ctx, t, new_mask, window, positions)
    k = jnp.concatenate([k_ctx.astype(jnp.float32), k_new.astype(jnp.float32)], axis=1)
    g = hq // hkv
    qg = q.astype(jnp.float32).reshape(b, t, hkv, g, dh)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)[..., :num_ctx]  # [B, Hkv, G, T, Sctx]
    per_page = p.reshape(b, hkv, g, t, num_ctx // page_size, page_size).sum(axis=(1, 2, 5)) / hq  # [B, T, NP]
    valid = (jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None]).astype(jnp.float32)
    return (per_page * valid[:, :, None]).sum(1) / jnp.maximum(num_new, 1)[:, None].astype(jnp.float32)


def shared_prefix_attention(
    q: jax.Array,  # [B, T, Hq, Dh] queries of every row (RoPE applied)
    k: jax.Array,  # [S, Hkv, Dh] keys of a prefix every row shares, stored once
    v: jax.Array,  # [S, Hkv, Dh]
    length: int,  # valid prefix positions (the rest of k/v is ignored)
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # [B, T, Hq, Dh], [B, T, Hq] float32
    """Every query of every row over one shared prefix; with the log-sum-exp for `merge_attention`.

    The queries of all rows become the new tokens of one row whose stored context is the
    prefix and which brings no keys of its own, so `paged_attention_reference` forms one
    product per KV head over the prefix: it is read once per step rather than once per row
    ("cascade" attention over a common system prompt).
    """
    b, t, hq, dh = q.shape
    none = jnp.zeros((1, b * t, *k.shape[1:]), q.dtype)
    one = jnp.ones((1,), jnp.int32)
    out, lse = paged_attention_reference(
        q.reshape(1, b * t, hq, dh), none, none, k[None], v[None], one * length, one * 0, scale=scale, return_lse=True
    )
    return out.reshape(b, t, hq, dh), lse.reshape(b, t, hq)


def merge_attention(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Combines attention outputs [B, T, Hq, Dh] over disjoint sets of keys, each with its
    log-sum-exp [B, T, Hq], into the attention over their union. A part that saw no valid key
    (log-sum-exp near MASK_VALUE) gets weight zero."""
    # Elementwise over the parts rather than reductions over a stacked axis, which XLA's CPU
    # backend runs as library calls costing more than the attention they merge.
    top = functools.reduce(jnp.maximum, [lse for _, lse in parts])  # [B, T, Hq]
    w = [jnp.exp(lse - top) for _, lse in parts]
    total = sum(w)
    out = sum((wi / total)[..., None] * o.astype(jnp.float32) for wi, (o, _) in zip(w, parts, strict=True))
    return out.astype(parts[0][0].dtype)
