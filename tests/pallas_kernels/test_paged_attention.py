"""Paged attention reference vs dense attention written out in numpy, with NaN in every unused slot."""

from __future__ import annotations

from functools import partial

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
    merge_attention,
    paged_attention_reference,
    shared_prefix_attention,
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


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("context", [40, LONG_CONTEXT])
@pytest.mark.parametrize("rows", [1, 3, FEW_QUERY_ROWS, FEW_QUERY_ROWS + 1, 24])
def test_context_products_match_numpy(rows, context, heads_first):
    """Both forms of the context products (multiply-reduce for few query rows over a long
    context on CPU, matmul otherwise), in both context layouts, against float64 numpy."""
    rng = np.random.default_rng(rows)
    q = rng.standard_normal((2, 3, rows, 16)).astype(np.float32)
    k = rng.standard_normal((2, context, 3, 16)).astype(np.float32)
    p = rng.random((2, 3, rows, context)).astype(np.float32)
    hi = jax.lax.Precision.HIGHEST
    kk = np.ascontiguousarray(np.swapaxes(k, 1, 2)) if heads_first else k
    scores = np.asarray(jax.jit(partial(context_scores, heads_first=heads_first), static_argnums=2)(q, kk, hi))
    summed = np.asarray(jax.jit(partial(context_sum, heads_first=heads_first), static_argnums=2)(p, kk, hi))
    np.testing.assert_allclose(scores, np.einsum("bhqd,bshd->bhqs", q.astype(np.float64), k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(summed, np.einsum("bhqs,bshd->bhqd", p.astype(np.float64), k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t, num_new", [(1, [1, 1, 1, 0]), (3, [3, 1, 2, 0])])
def test_shared_prefix_then_merge_equals_attention_over_the_whole_context(t, num_new):
    """A prefix every row shares, attended once for the batch and merged with each row's
    attention over the rest of its context, gives attention over the whole context. The
    prefix buffer's tail past `length` and the rows' unused context hold NaN; the last row is
    padding (no new tokens, context shorter than the prefix)."""
    rng = np.random.default_rng(t)
    hkv, hq, d = 2, 6, 16
    prefix, pad = 24, 8  # valid shared positions, NaN positions after them
    ctx_lens = np.array([prefix, prefix + 5, prefix + 11, 0], np.int32)
    b, s = len(ctx_lens), 16
    k_sh = rng.standard_normal((prefix + pad, hkv, d)).astype(np.float32)
    v_sh = rng.standard_normal((prefix + pad, hkv, d)).astype(np.float32)
    k_sh[prefix:] = v_sh[prefix:] = np.nan
    k_own = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v_own = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    for r in range(b):
        k_own[r, max(ctx_lens[r] - prefix, 0) :] = v_own[r, max(ctx_lens[r] - prefix, 0) :] = np.nan
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    num_new = np.asarray(num_new, np.int32)

    @jax.jit
    def cascade(q, k_new, v_new, k_own, v_own, k_sh, v_sh):
        own = paged_attention_reference(q, k_new, v_new, k_own, v_own, ctx_lens - prefix, num_new, return_lse=True)
        return merge_attention([own, shared_prefix_attention(q, k_sh, v_sh, prefix)])

    out = np.asarray(cascade(q, k_new, v_new, k_own, v_own, k_sh, v_sh))
    whole_k = np.concatenate([np.broadcast_to(k_sh[:prefix], (b, prefix, hkv, d)), k_own], axis=1)
    whole_v = np.concatenate([np.broadcast_to(v_sh[:prefix], (b, prefix, hkv, d)), v_own], axis=1)
    assert np.isfinite(out).all()
    for r in range(b - 1):
        n = num_new[r]
        full_k = np.concatenate([whole_k[r, : ctx_lens[r]], k_new[r, :n]])
        full_v = np.concatenate([whole_v[r, : ctx_lens[r]], v_new[r, :n]])
        ref = dense_attention(q[r, :n], full_k, full_v, ctx_lens[r] + np.arange(n))
        np.testing.assert_allclose(out[r, :n], ref, rtol=1e-4, atol=1e-5)


def test_merge_attention_weights_parts_by_their_log_sum_exp():
    """Two halves of a context, merged, equal softmax attention over all of it; swapping
    the halves' log-sum-exps does not."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k = rng.standard_normal((12, 2, 8)).astype(np.float32) * 2
    v = rng.standard_normal((12, 2, 8)).astype(np.float32)
    halves = [shared_prefix_attention(q, k[i : i + 6], v[i : i + 6], 6) for i in (0, 6)]
    whole = shared_prefix_attention(q, k, v, 12)[0]
    np.testing.assert_allclose(np.asarray(merge_attention(halves)), np.asarray(whole), rtol=1e-5, atol=1e-6)
    swapped = [(halves[0][0], halves[1][1]), (halves[1][0], halves[0][1])]
    assert not np.allclose(np.asarray(merge_attention(swapped)), np.asarray(whole), atol=1e-3)


@pytest.mark.parametrize("window", [None, 6])
def test_page_attention_mass_is_the_softmax_weight_on_each_page(window):
    """Against the weights written out in numpy: per row, query and head, a softmax over the
    stored keys it sees and the new keys up to itself; summed per page, averaged over heads
    and the row's valid queries. Unused slots hold NaN."""
    from pallas_kernels.paged_attention import page_attention_mass

    rng = np.random.default_rng(3)
    b, t, hq, hkv, d, page, num_pages = 3, 4, 6, 2, 8, 4, 5
    ctx_lens, num_new = np.array([13, 0, 20]), np.array([3, 4, 0])
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k_new = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    k_ctx = rng.standard_normal((b, num_pages * page, hkv, d)).astype(np.float32)
    for r in range(b):
        k_ctx[r, ctx_lens[r] :] = np.nan
        k_new[r, num_new[r] :] = np.nan
    got = np.asarray(
        page_attention_mass(
            jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(k_ctx), jnp.asarray(ctx_lens), jnp.asarray(num_new), page,
            window=window,
        )
    )  # fmt: skip
    want = np.zeros((b, num_pages))
    for r in range(b):
        for i in range(num_new[r]):
            pos = ctx_lens[r] + i
            keys = [(j, k_ctx[r, j]) for j in range(ctx_lens[r])]
            keys += [(ctx_lens[r] + u, k_new[r, u]) for u in range(i + 1)]
            keys = [(p, kk) for p, kk in keys if window is None or pos - p < window]
            for h in range(hq):
                scores = np.array([q[r, i, h] @ kk[h // (hq // hkv)] for _, kk in keys]) / np.sqrt(d)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                for (p, _), wi in zip(keys, w, strict=True):
                    if p < ctx_lens[r]:
                        want[r, p // page] += wi / hq / num_new[r]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got[1].sum() == 0 and got[2].sum() == 0  # nothing stored; no new tokens
    assert 0 < got[0].sum() < 1  # the rest fell on the new tokens
