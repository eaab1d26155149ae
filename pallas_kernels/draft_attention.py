"""The draft's attention: a block of queries over [paged context ; the block itself], non-causal.

Row r's block of T positions sees every stored context key j < ctx_lens[r] (read from its
pages through the block table) and every key of its own block, in both directions (the
block mask of a block-diffusion draft). Context entries at or past ctx_lens[r] are replaced,
not added to, so garbage in unused pages never reaches the output.

`draft_attention_dense` is the core on a dense context (training); `draft_attention_reference`
gathers pages and calls it; `draft_attention` is the Pallas kernel with the reference's
signature, reading pages straight from the pools with an online softmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_attention import MASK_VALUE, dot_precision, tile_dot


def draft_attention_dense(
    q: jax.Array,  # [R, T, Hq, Dh] block queries (RoPE applied)
    k_blk: jax.Array,  # [R, T, Hkv, Dh]
    v_blk: jax.Array,  # [R, T, Hkv, Dh]
    k_ctx: jax.Array,  # [R, S, Hkv, Dh] context keys
    v_ctx: jax.Array,  # [R, S, Hkv, Dh]
    ctx_lens: jax.Array,  # [R] int32 visible context entries per row
    *,
    scale: float | None = None,
) -> jax.Array:  # [R, T, Hq, Dh]
    r, t, hq, dh = q.shape
    hkv = k_blk.shape[2]
    scale = dh**-0.5 if scale is None else scale
    prec = dot_precision(q.dtype)
    ctx_valid = jnp.arange(k_ctx.shape[1], dtype=jnp.int32)[None, :] < ctx_lens[:, None]  # [R, S]
    valid = jnp.concatenate([ctx_valid, jnp.ones((r, t), bool)], axis=1)  # [R, S + T]
    k = jnp.concatenate([k_ctx.astype(q.dtype), k_blk.astype(q.dtype)], axis=1)
    v = jnp.where(valid[:, :, None, None], jnp.concatenate([v_ctx.astype(q.dtype), v_blk.astype(q.dtype)], axis=1), 0)
    qg = q.reshape(r, t, hkv, hq // hkv, dh)
    s = jnp.einsum("rtkgd,rskd->rkgts", qg, k, preferred_element_type=jnp.float32, precision=prec) * scale
    s = jnp.where(valid[:, None, None, None, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("rkgts,rskd->rtkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return out.reshape(r, t, hq, dh).astype(q.dtype)


def _check(q, k_blk, v_blk, k_pool, v_pool, block_table, ctx_lens) -> None:
    if q.ndim != 4 or k_blk.ndim != 4 or k_pool.ndim != 4:
        raise ValueError("q, k_blk must be [R, T, H, Dh] and k_pool [P, page_size, Hkv, Dh]")
    r, t, hq, dh = q.shape
    if k_blk.shape != v_blk.shape or k_blk.shape[:2] != (r, t) or k_blk.shape[3] != dh:
        raise ValueError(f"block keys/values {k_blk.shape}/{v_blk.shape} do not match queries {q.shape}")
    if k_pool.shape != v_pool.shape or k_pool.shape[2:] != k_blk.shape[2:]:
        raise ValueError(f"pools {k_pool.shape}/{v_pool.shape} do not match block keys {k_blk.shape}")
    if hq % k_blk.shape[2]:
        raise ValueError(f"{hq} query heads are not a multiple of {k_blk.shape[2]} KV heads")
    if block_table.ndim != 2 or block_table.shape[0] != r or ctx_lens.shape != (r,):
        raise ValueError(f"block_table {block_table.shape} and ctx_lens {ctx_lens.shape} must have {r} rows")


def draft_attention_reference(
    q: jax.Array,  # [R, T, Hq, Dh]
    k_blk: jax.Array,  # [R, T, Hkv, Dh]
    v_blk: jax.Array,
    k_pool: jax.Array,  # [P, page_size, Hkv, Dh] one draft layer's context pages
    v_pool: jax.Array,
    block_table: jax.Array,  # [R, NP] int32 pages of each row, in order
    ctx_lens: jax.Array,  # [R] int32
    *,
    scale: float | None = None,
    interpret: bool = False,  # accepted for signature parity with the kernel
) -> jax.Array:
    """Gathers each row's pages and runs `draft_attention_dense`."""
    _check(q, k_blk, v_blk, k_pool, v_pool, block_table, ctx_lens)
    r, np_ = block_table.shape
    page = k_pool.shape[1]
    k_ctx = k_pool[block_table].reshape(r, np_ * page, *k_pool.shape[2:])
    v_ctx = v_pool[block_table].reshape(r, np_ * page, *v_pool.shape[2:])
    return draft_attention_dense(q, k_blk, v_blk, k_ctx, v_ctx, ctx_lens, scale=scale)


def _kernel(table_ref, lens_ref, q_ref, kb_ref, vb_ref, kp_ref, vp_ref, o_ref, *, scale, page, num_pages, block, prec):
    """One (row, KV head): queries [T*G, Dh] over the row's pages, then over the block's first
    `block` keys (the rest pad the block to a power of two, as the query rows are padded)."""
    row = pl.program_id(0)
    ctx_len = lens_ref[row]
    q = q_ref[...].astype(jnp.float32) * scale  # [TG, Dh]
    tg, dh = q.shape

    def attend(carry, k, v, valid):
        m, l_, acc = carry
        s = tile_dot(q, k, ((1,), (1,)), prec)  # [TG, N]
        s = jnp.where(valid[None, :], s, MASK_VALUE)
        v = jnp.where(valid[:, None], v, 0.0)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return m_new, alpha * l_ + p.sum(axis=1), alpha[:, None] * acc + tile_dot(p, v, ((1,), (0,)), prec)

    def body(i, carry):
        pid = table_ref[row, i]
        k = kp_ref[pid].astype(jnp.float32)  # [page, Dh]
        v = vp_ref[pid].astype(jnp.float32)
        valid = i * page + jnp.arange(page) < ctx_len
        return attend(carry, k, v, valid)

    init = (jnp.full((tg,), MASK_VALUE, jnp.float32), jnp.zeros((tg,), jnp.float32), jnp.zeros((tg, dh), jnp.float32))
    # Every page slot is visited (no data-dependent trip count); invalid ones are masked.
    carry = jax.lax.fori_loop(0, num_pages, body, init)
    kb = kb_ref[...].astype(jnp.float32)  # [T, Dh]
    vb = vb_ref[...].astype(jnp.float32)
    m, l_, acc = attend(carry, kb, vb, jnp.arange(kb.shape[0]) < block)
    o_ref[...] = (acc / l_[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def draft_attention(
    q: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_table: jax.Array,
    ctx_lens: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Pallas kernel twin of `draft_attention_reference`: one program per (row, KV head),
    pages read in place through the block table, online softmax, no gathered buffer. Built
    with Triton on a GPU, whose tiles are powers of two: the group's T*G query rows and the
    block's T keys are padded to the next one (at least 16) and the padding masked or cut."""
    _check(q, k_blk, v_blk, k_pool, v_pool, block_table, ctx_lens)
    r, t, hq, dh = q.shape
    hkv = k_blk.shape[2]
    g = hq // hkv
    page = k_pool.shape[1]
    num_pages = block_table.shape[1]
    scale = dh**-0.5 if scale is None else scale
    # Queries of one KV head's group laid out as [T*G, Dh]; pools as [Hkv, P, page, Dh].
    rows, keys = (max(16, pl.next_power_of_2(n)) for n in (t * g, t))
    qh = q.reshape(r, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(r, hkv, t * g, dh)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    kb = jnp.pad(k_blk.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, keys - t), (0, 0)))  # [R, Hkv, Tp, Dh]
    vb = jnp.pad(v_blk.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, keys - t), (0, 0)))
    kp = k_pool.transpose(2, 0, 1, 3)  # [Hkv, P, page, Dh]
    vp = v_pool.transpose(2, 0, 1, 3)
    # float32 inputs: three tensor-core passes (~1e-5 relative; one float32 FMA program spilled
    # when built for sm_90); bfloat16 inputs: one, as the reference's bfloat16 products.
    prec = "bf16x3" if q.dtype == jnp.float32 else "bf16"
    kernel = functools.partial(_kernel, scale=scale, page=page, num_pages=num_pages, block=t, prec=prec)
    full = lambda *shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(r, hkv),
        in_specs=[
            full(r, num_pages),
            full(r),
            pl.BlockSpec((None, None, rows, dh), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((None, None, keys, dh), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((None, None, keys, dh), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((None, *kp.shape[1:]), lambda i, h: (h, 0, 0, 0)),
            pl.BlockSpec((None, *vp.shape[1:]), lambda i, h: (h, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, dh), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((r, hkv, rows, dh), q.dtype),
        interpret=interpret,
        # Triton parameters select the Triton lowering: Mosaic GPU, the default on GPU, copies
        # each block whole into shared memory, and a block here is a KV head's whole pool.
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
    )(block_table.astype(jnp.int32), ctx_lens.astype(jnp.int32), qh, kb, vb, kp, vp)
    return out[:, :, : t * g].reshape(r, hkv, t, g, dh).transpose(0, 2, 1, 3, 4).reshape(r, t, hq, dh)
