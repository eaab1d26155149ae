"""Draft kernels against their jnp references (Pallas interpreter on CPU), the unmasking rule
and its schedule, and the draft file format."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.draft import MASK, DraftConfig, init_params, unmask_schedule
from models.draft_io import load_draft, save_draft
from pallas_kernels.draft_attention import draft_attention, draft_attention_dense, draft_attention_reference
from pallas_kernels.unmask import confidence_unmask, confidence_unmask_reference

ON_GPU = jax.default_backend() == "gpu"


def _pools(rng, num_pages, page, hkv, dh, dtype):
    k = rng.standard_normal((num_pages, page, hkv, dh)).astype(np.float32)
    v = rng.standard_normal((num_pages, page, hkv, dh)).astype(np.float32)
    k[0] = np.nan  # the null page holds garbage: it must never reach an output
    v[0] = np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize(
    ("rows", "t", "hq", "hkv", "dh", "page", "np_"),
    [(2, 16, 9, 3, 64, 16, 4), (3, 4, 4, 1, 32, 8, 5), (1, 8, 8, 2, 16, 4, 2), (2, 12, 6, 2, 64, 16, 3)],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_draft_attention_kernel_matches_reference(rows, t, hq, hkv, dh, page, np_, dtype):
    rng = np.random.default_rng(rows * 100 + t)
    num_pages = rows * np_ + 1
    k_pool, v_pool = _pools(rng, num_pages, page, hkv, dh, dtype)
    perm = rng.permutation(np.arange(1, num_pages))[: rows * np_].reshape(rows, np_)
    lens = rng.integers(0, np_ * page + 1, rows).astype(np.int32)
    lens[0] = 0  # a row with no context attends only to its block
    table = np.where(np.arange(np_)[None, :] * page < lens[:, None], perm, 0).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((rows, t, hq, dh)), dtype)
    kb = jnp.asarray(rng.standard_normal((rows, t, hkv, dh)), dtype)
    vb = jnp.asarray(rng.standard_normal((rows, t, hkv, dh)), dtype)
    ref = draft_attention_reference(q, kb, vb, k_pool, v_pool, table, lens)
    out = draft_attention(q, kb, vb, k_pool, v_pool, table, lens, interpret=not ON_GPU)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2  # float32 inputs: bf16x3 products (~1e-5 relative)
    assert np.isfinite(np.asarray(ref, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


def test_draft_attention_reference_is_non_causal_and_masks_context():
    """Against a direct softmax: every block position sees the whole block and only the
    first ctx_len context keys."""
    rng = np.random.default_rng(0)
    r, t, s, h, dh = 1, 4, 6, 1, 8
    q, kb, vb = (jnp.asarray(rng.standard_normal((r, t, h, dh)), jnp.float32) for _ in range(3))
    kc, vc = (jnp.asarray(rng.standard_normal((r, s, h, dh)), jnp.float32) for _ in range(2))
    out = np.asarray(draft_attention_dense(q, kb, vb, kc, vc, jnp.asarray([3])))
    keys = np.concatenate([np.asarray(kc)[0, :3, 0], np.asarray(kb)[0, :, 0]])
    vals = np.concatenate([np.asarray(vc)[0, :3, 0], np.asarray(vb)[0, :, 0]])
    for i in range(t):
        w = np.exp(keys @ np.asarray(q)[0, i, 0] / np.sqrt(dh))
        np.testing.assert_allclose(out[0, i, 0], (w / w.sum()) @ vals, rtol=1e-5, atol=1e-5)


def test_draft_attention_rejects_bad_shapes():
    q = jnp.zeros((2, 4, 3, 8))
    kb = jnp.zeros((2, 4, 2, 8))
    pool = jnp.zeros((3, 4, 2, 8))
    with pytest.raises(ValueError, match="multiple"):
        draft_attention_reference(q, kb, kb, pool, pool, jnp.zeros((2, 1), jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="rows"):
        draft_attention(
            jnp.zeros((2, 4, 4, 8)), kb, kb, pool, pool, jnp.zeros((3, 1), jnp.int32), jnp.zeros(2, jnp.int32)
        )


def test_unmask_schedule():
    assert unmask_schedule(16, 4) == (6, 5, 3, 2)
    assert unmask_schedule(15, 1) == (15,)
    for n in range(1, 20):
        for s in range(1, n + 1):
            counts = unmask_schedule(n, s)
            assert sum(counts) == n and len(counts) == s and min(counts) >= 1
            assert list(counts) == sorted(counts, reverse=True)
    with pytest.raises(ValueError):
        unmask_schedule(4, 5)


@pytest.mark.parametrize("t", [16, 12])  # a block of 12 is padded to 16 in the kernel
@pytest.mark.parametrize("count", [0, 1, 3, 7, 15])
def test_unmask_kernel_matches_reference_and_rule(count, t):
    rng = np.random.default_rng(count)
    b = 5
    tokens = np.full((b, t), MASK, np.int32)
    tokens[:, 0] = 7
    tokens[1, 3:6] = [11, 12, 13]  # already revealed positions stay
    pred = rng.integers(0, 100, (b, t)).astype(np.int32)
    conf = rng.random((b, t)).astype(np.float32)
    conf[2, 4] = conf[2, 9] = 2.0  # a tie goes to the earlier position
    ref = np.asarray(confidence_unmask_reference(tokens, pred, conf, count))
    out = np.asarray(confidence_unmask(tokens, pred, conf, count, interpret=not ON_GPU))
    np.testing.assert_array_equal(out, ref)
    for row in range(b):
        masked = np.flatnonzero(tokens[row] == MASK)
        order = sorted(masked, key=lambda j: (-conf[row, j], j))
        expect = tokens[row].copy()
        expect[order[:count]] = pred[row, order[:count]]
        np.testing.assert_array_equal(ref[row], expect)


def test_draft_file_round_trip_and_errors(tmp_path):
    cfg = DraftConfig(
        vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
        intermediate_size=24, target_layers=(0, 2), target_num_layers=3, block_size=4,
    )  # fmt: skip
    params = init_params(cfg, jax.random.PRNGKey(1))
    path = tmp_path / "d.npz"
    save_draft(path, cfg, params, {"note": "x"})
    cfg2, params2, meta, vocab = load_draft(path)
    assert vocab is None
    assert cfg2 == cfg and meta == {"note": "x"}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-3)  # float16 on disk
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a draft file"):
        load_draft(tmp_path / "junk.npz")
    z = dict(np.load(path))
    z["fc"] = z["fc"][:3]
    np.savez(tmp_path / "bad.npz", **z)
    with pytest.raises(ValueError, match="fc has shape"):
        load_draft(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="target_layers"):
        DraftConfig(**{**cfg.__dict__, "target_layers": (5,)})
