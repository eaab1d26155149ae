"""Batch-invariant products and attention (pallas_kernels/invariant.py): each row's result is
the same bits whatever shares the call, and matches the plain reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant import invariant_attention, row_tiled
from pallas_kernels.paged_attention import paged_attention_reference

HQ, HKV, DH = 6, 2, 64
LENGTH = 150  # the tracked query sits at this position


@pytest.fixture(scope="module")
def sequence():
    """Queries, keys and values [LENGTH + 1, heads, Dh] of one sequence."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((LENGTH + 1, HQ, DH)).astype(np.float32)
    k = rng.standard_normal((LENGTH + 1, HKV, DH)).astype(np.float32)
    v = rng.standard_normal((LENGTH + 1, HKV, DH)).astype(np.float32)
    return q, k, v


attend = jax.jit(invariant_attention, static_argnames=("window",))


def place(sequence, rows: int, t: int, pages: int, row: int, seed: int):
    """A batch of `rows` random rows whose row `row` holds the sequence's last t tokens as new
    tokens over the rest as stored context; stored entries past each row's length are NaN."""
    q_seq, k_seq, v_seq = sequence
    rng = np.random.default_rng(seed)
    s = pages * 16
    ctx = LENGTH + 1 - t

    def random(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k_new, v_new = random(rows, t, HQ, DH), random(rows, t, HKV, DH), random(rows, t, HKV, DH)
    k_ctx, v_ctx = random(rows, s, HKV, DH), random(rows, s, HKV, DH)
    ctx_lens = rng.integers(0, s - t + 1, rows).astype(np.int32)
    num_new = rng.integers(1, t + 1, rows).astype(np.int32)
    q[row], k_new[row], v_new[row] = q_seq[ctx:], k_seq[ctx:], v_seq[ctx:]
    k_ctx[row, :ctx], v_ctx[row, :ctx] = k_seq[:ctx], v_seq[:ctx]
    ctx_lens[row], num_new[row] = ctx, t
    for i in range(rows):
        k_ctx[i, ctx_lens[i] :] = np.nan
        v_ctx[i, ctx_lens[i] :] = np.nan
    return q, k_new, v_new, k_ctx, v_ctx, jnp.asarray(ctx_lens), jnp.asarray(num_new)


# (rows, new tokens per row, pages read, the tracked row): one row decoding alone, beside
# others, with a longer page bucket, as the last token of prefill chunks of several sizes
# (one tile, tiles past the first, the whole sequence in one chunk).
LAYOUTS = [(1, 1, 10), (4, 1, 10, 2), (8, 1, 32, 5), (1, 8, 10), (3, 16, 16, 1), (2, 21, 13, 1), (1, 151, 16)]


@pytest.mark.parametrize("window", [None, 40])
def test_each_query_is_the_same_bits_whatever_shares_the_call(sequence, window):
    results = []
    for rows, t, pages, *row in LAYOUTS:
        row = row[0] if row else 0
        args = place(sequence, rows, t, pages, row, seed=rows * 100 + t)
        out = np.asarray(attend(*args, window=window))
        ref = np.asarray(paged_attention_reference(*[jnp.nan_to_num(a) for a in args[:5]], *args[5:], window=window))
        valid = np.arange(t)[None, :] < np.asarray(args[6])[:, None]  # every row's valid new tokens
        np.testing.assert_allclose(out[valid], ref[valid], atol=2e-6)
        results.append(out[row, -1])
    for layout, got in zip(LAYOUTS[1:], results[1:], strict=True):
        assert np.array_equal(got, results[0]), layout


def test_tree_masks_match_the_reference(sequence):
    """Among the new tokens a draft tree's mask replaces the causal one."""
    q, k_new, v_new, k_ctx, v_ctx, ctx_lens, num_new = place(sequence, 2, 5, 12, 0, seed=7)
    parents = np.array([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    mask = jnp.asarray(_ancestors(parents))
    for window in (None, 40):
        depth = mask.sum(-1) - 1  # a node's depth: its ancestors
        positions = ctx_lens[:, None] + depth
        args = (q, k_new, v_new, k_ctx, v_ctx, ctx_lens, num_new)
        out = attend(*args, new_mask=mask, window=window, positions=positions)
        k_ctx, v_ctx = np.nan_to_num(k_ctx), np.nan_to_num(v_ctx)
        ref = paged_attention_reference(
            q, k_new, v_new, k_ctx, v_ctx, ctx_lens, num_new, new_mask=mask, window=window, positions=positions
        )
        valid = np.arange(5)[None, :] < np.asarray(num_new)[:, None]
        np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=2e-6)
        # Row 0's node 4 (path 0 -> 2 -> 4) is the same bits as the last token of that path
        # verified as a chain, or decoded alone after the path's first two tokens were stored.
        path = [0, 2, 4]
        chain = attend(q[:1, path], k_new[:1, path], v_new[:1, path], k_ctx[:1], v_ctx[:1], ctx_lens[:1],
                       jnp.asarray([3]), window=window)  # fmt: skip
        assert np.array_equal(np.asarray(chain)[0, 2], np.asarray(out)[0, 4])
        stored_k, stored_v, n = k_ctx[:1].copy(), v_ctx[:1].copy(), int(ctx_lens[0])
        stored_k[0, n : n + 2], stored_v[0, n : n + 2] = k_new[0, path[:2]], v_new[0, path[:2]]
        alone = attend(q[:1, 4:5], k_new[:1, 4:5], v_new[:1, 4:5], stored_k, stored_v, ctx_lens[:1] + 2,
                       jnp.asarray([1]), window=window)  # fmt: skip
        assert np.array_equal(np.asarray(alone)[0, 0], np.asarray(out)[0, 4])


def _ancestors(parents: np.ndarray) -> np.ndarray:
    b, t = parents.shape
    mask = np.zeros((b, t, t), bool)
    for r in range(b):
        for i in range(t):
            j = i
            while j >= 0:
                mask[r, i, j] = True
                j = parents[r, j]
    return mask


def test_row_tiled_products_are_the_same_bits_for_any_row_count():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((576, 1536)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((100, 576)).astype(np.float32))
    product = jax.jit(lambda x: row_tiled(lambda t: t @ w, x))
    alone = np.asarray(product(x[:1]))[0]
    for n in (2, 17, 48, 100):
        got = np.asarray(product(x[:n]))
        assert np.array_equal(got[0], alone), n
        np.testing.assert_allclose(got, x[:n] @ w, rtol=1e-5, atol=1e-4)
    moved = np.asarray(product(jnp.concatenate([x[1:40], x[:1]])))[39]  # another place in a tile
    assert np.array_equal(moved, alone)
