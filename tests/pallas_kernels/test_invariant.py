"""Batch-invariant products and attention (pallas_kernels/invariant.py): each row's result is
the same bits whatever shares the call, and matches the plain reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant import by_position, invariant_attention, padded_length, row_tiled
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


@jax.jit(static_argnames=("window",))
def attend(q, k_new, v_new, k_ctx, v_ctx, ctx_lens, num_new, window=None):
    size = padded_length(k_ctx.shape[1], q.shape[1])
    k_rows = by_position(k_ctx, k_new, ctx_lens, num_new, size)
    v_rows = by_position(v_ctx, v_new, ctx_lens, num_new, size)
    return invariant_attention(q, k_rows, v_rows, ctx_lens, num_new, window=window)


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
    size = padded_length(k_ctx.shape[1], 5)
    rows = [by_position(a, b, ctx_lens, num_new, size) for a, b in ((k_ctx, k_new), (v_ctx, v_new))]
    for window in (None, 40):
        depth = mask.sum(-1) - 1  # a node's depth: its ancestors
        positions = ctx_lens[:, None] + depth
        out = invariant_attention(q, *rows, ctx_lens, num_new, new_mask=mask, window=window, positions=positions)
        k_ctx, v_ctx = np.nan_to_num(k_ctx), np.nan_to_num(v_ctx)
        ref = paged_attention_reference(
            q, k_new, v_new, k_ctx, v_ctx, ctx_lens, num_new, new_mask=mask, window=window, positions=positions
        )
        valid = np.arange(5)[None, :] < np.asarray(num_new)[:, None]
        np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=2e-6)


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
