"""Paged attention reference vs dense attention written out in numpy, with NaN in every unused slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.kv_cache import init_cache
from pallas_kernels.paged_attention import (
    FEW_QUERY_ROWS,
    LONG_CONTEXT,
    context_scores,
    context_sum,
    paged_attention_reference,
)

CFG = ModelConfig(
    "llama",
    num_layers=2,
    hidden_size=64,
    ffn_size=64,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=32,
    max_context=256,
)


def dense_attention(q, k, v, q_pos):
    """q [T, Hq, D]; k, v [N, Hkv, D] for positions 0..N-1; causal by absolute position."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(hq):
        kh, vh = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
        for i in range(t):
            n = q_pos[i] + 1
            s = kh[:n] @ q[i, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh[:n]
    return out


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("ctx_lens, num_new", [([0, 5], [7, 3]), ([9, 30], [1, 1]), ([17, 0], [4, 0])])
def test_reference_matches_dense(page_size, ctx_lens, num_new):
    rng = np.random.default_rng(0)
    b, t = len(ctx_lens), max(max(num_new), 1)
    hkv, hq, d = CFG.num_kv_heads, CFG.num_heads, CFG.head_dim
    num_pages_pool, np_read = 40, 12
    cache = init_cache(
        CFG,
        num_pages=num_pages_pool,
        max_seqs=b,
        max_pages_per_seq=np_read,
        page_size=page_size,
        kv_cache_dtype="fp32",
        fill_value=float("nan"),
    )
    # Each row owns a random, non-contiguous set of pages; the rest of its table points at page 0 (NaN).
    perm = rng.permutation(np.arange(1, num_pages_pool))
    table = np.zeros((b, np_read), np.int32)
    full_k = rng.standard_normal((b, np_read * page_size, hkv, d)).astype(np.float32)
    full_v = rng.standard_normal((b, np_read * page_size, hkv, d)).astype(np.float32)
    layer = 1
    k_pool, v_pool = np.asarray(cache.k[0]).copy(), np.asarray(cache.v[0]).copy()
    for r in range(b):
        used = -(-ctx_lens[r] // page_size)
        table[r, :used] = perm[r * np_read : r * np_read + used]
        for j in range(ctx_lens[r]):
            k_pool[table[r, j // page_size], layer, j % page_size] = full_k[r, j]
            v_pool[table[r, j // page_size], layer, j % page_size] = full_v[r, j]
    cache = cache.replace(k=(jnp.asarray(k_pool),), v=(jnp.asarray(v_pool),))
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k_new = np.stack([full_k[r, ctx_lens[r] : ctx_lens[r] + t] for r in range(b)])
    v_new = np.stack([full_v[r, ctx_lens[r] : ctx_lens[r] + t] for r in range(b)])
    k_ctx, v_ctx = cache.read(jnp.asarray(table), layer)
    out = jax.jit(paged_attention_reference)(
        jnp.asarray(q),
        jnp.asarray(k_new),
        jnp.asarray(v_new),
        k_ctx,
        v_ctx,
        jnp.asarray(ctx_lens, jnp.int32),
        jnp.asarray(num_new, jnp.int32),
    )
    out = np.asarray(out)
    for r in range(b):
        n = num_new[r]
        if n == 0:
            assert np.isfinite(out[r]).all()  # padding rows: harmless zeros, never NaN
            continue
        q_pos = ctx_lens[r] + np.arange(n)
        ref = dense_attention(q[r, :n], full_k[r], full_v[r], q_pos)
        np.testing.assert_allclose(out[r, :n], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", [40, LONG_CONTEXT])
@pytest.mark.parametrize("rows", [1, 3, FEW_QUERY_ROWS, FEW_QUERY_ROWS + 1, 24])
def test_context_products_match_numpy(rows, context):
    """Both forms of the context products (multiply-reduce for few query rows over a long
    context on CPU, matmul otherwise) against float64 numpy."""
    rng = np.random.default_rng(rows)
    q = rng.standard_normal((2, 3, rows, 16)).astype(np.float32)
    k = rng.standard_normal((2, context, 3, 16)).astype(np.float32)
    p = rng.random((2, 3, rows, context)).astype(np.float32)
    hi = jax.lax.Precision.HIGHEST
    scores = np.asarray(jax.jit(context_scores, static_argnums=2)(q, k, hi))
    summed = np.asarray(jax.jit(context_sum, static_argnums=2)(p, k, hi))
    np.testing.assert_allclose(scores, np.einsum("bhqd,bshd->bhqs", q.astype(np.float64), k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(summed, np.einsum("bhqs,bshd->bhqd", p.astype(np.float64), k), rtol=1e-5, atol=1e-5)
