"""Attention over a paged KV cache: the plain-jnp reference that kernels must match.

Pools are page-major, [num_pages, num_layers, page_size, num_kv_heads, head_dim], so one
page's bytes for every layer are contiguous (cheap to move between device and host). A
sequence's keys are the pages its block-table row lists, in order.

Masking is strict: keys at or past a row's KV length are zeroed before use, so garbage in
unused or freed pages (NaN in tests) can never reach the output, even multiplied by zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": a query row with no visible key then gets uniform weights over
# zeroed values (output 0) instead of NaN from exp(-inf - -inf).
MASK_VALUE = -1e30


def dot_precision(dtype) -> jax.lax.Precision:
    """float32 runs ask for full-precision matmuls (GPUs otherwise use TF32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def paged_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh] queries (RoPE applied)
    k_pool: jax.Array,  # [P, L, S, Hkv, Dh]
    v_pool: jax.Array,  # [P, L, S, Hkv, Dh]
    layer: jax.Array,  # [] int32, which layer of the pools to read
    page_table: jax.Array,  # [B, NP] int32, the first NP pages of each row's block table
    q_positions: jax.Array,  # [B, T] int32, absolute position of each query
    kv_lens: jax.Array,  # [B] int32, number of valid keys per row (positions 0..kv_len-1)
    *,
    scale: float | None = None,
) -> jax.Array:  # [B, T, Hq, Dh]
    """Causal grouped-query attention of `q` against the keys/values stored in the pages.

    Query t of row b sees key j iff j <= q_positions[b, t] and j < kv_lens[b].
    """
    b, t, hq, dh = q.shape
    _, _, page_size, hkv, _ = k_pool.shape
    num_pages = page_table.shape[1]
    scale = dh**-0.5 if scale is None else scale
    prec = dot_precision(q.dtype)

    k = k_pool[page_table, layer].reshape(b, num_pages * page_size, hkv, dh)  # [B, Skv, Hkv, Dh]
    v = v_pool[page_table, layer].reshape(b, num_pages * page_size, hkv, dh)
    kpos = jnp.arange(num_pages * page_size, dtype=jnp.int32)
    kv_valid = kpos[None, :] < kv_lens[:, None]  # [B, Skv]
    k = jnp.where(kv_valid[:, :, None, None], k, 0).astype(q.dtype)
    v = jnp.where(kv_valid[:, :, None, None], v, 0).astype(q.dtype)

    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=prec) * scale
    mask = (kpos[None, None, :] <= q_positions[:, :, None]) & kv_valid[:, None, :]  # [B, T, Skv]
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return out.reshape(b, t, hq, dh).astype(q.dtype)
