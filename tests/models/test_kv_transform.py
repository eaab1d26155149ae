"""The query-aware key transform of the -pc KV formats: its algebra, its fit, and that the model
reads keys through it without changing what attention computes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.kv_cache import init_cache
from models.kv_transform import fit_key_transforms, key_transform, load_key_transforms, score_error_ratio
from models.llama import _transform_query_key

TINY = ModelConfig("llama", 2, 64, 128, 4, 2, 16, 100, 64)


def random_cov(rng, d, spread):
    u, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (u * np.exp(rng.uniform(-spread, spread, d))) @ u.T


def test_transform_solves_the_geometric_mean_equation():
    """P = M^T M is the SPD solution of P A P = B (the geometric mean of A^-1 and B)."""
    rng = np.random.default_rng(0)
    a, b = random_cov(rng, 16, 2.0), random_cov(rng, 16, 2.0)
    m = key_transform(a, b)
    p = m.T @ m
    scale = np.trace(p @ a @ p) / np.trace(b)  # M is normalized to determinant 1
    np.testing.assert_allclose(p @ a @ p, scale * b, rtol=1e-4, atol=1e-5 * np.abs(b).max())
    assert np.linalg.det(m) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(m, m.T, atol=1e-10)


def test_predicted_error_falls_when_keys_and_queries_disagree():
    rng = np.random.default_rng(1)
    a, b = random_cov(rng, 16, 2.0), random_cov(rng, 16, 2.0)
    assert score_error_ratio(np.eye(16), a, b) == pytest.approx(1.0)
    assert score_error_ratio(key_transform(a, b), a, b) < 0.8
    # Isotropic queries: M^T M is A^-1/2 (halfway to whitening), and both whitening and a
    # random M do worse.
    m = key_transform(a, np.eye(16))
    w, u = np.linalg.eigh(a)
    half = (u * w**-0.5) @ u.T
    np.testing.assert_allclose(m.T @ m / np.trace(m.T @ m), half / np.trace(half), rtol=1e-4, atol=1e-6)
    whiten = (u * w**-0.5) @ u.T
    other = np.linalg.qr(rng.standard_normal((16, 16)))[0] @ np.diag(np.exp(rng.uniform(-1, 1, 16)))
    best = score_error_ratio(m, a, np.eye(16))
    assert best < score_error_ratio(whiten, a, np.eye(16)) and best < score_error_ratio(other, a, np.eye(16))


def test_fit_gives_one_transform_per_layer_and_kv_head():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, 200, 4, 8)) * np.linspace(0.2, 3, 8)
    k = rng.standard_normal((3, 200, 2, 8)) * np.linspace(3, 0.2, 8)
    m, ratios = fit_key_transforms(q, k, group=2)
    assert m.shape == (3, 2, 8, 8) and ratios.shape == (3, 2)
    assert (ratios < 0.9).all()  # opposite channel profiles: much to gain


def test_queries_and_keys_through_the_transform_keep_every_score():
    rng = np.random.default_rng(3)
    m = np.stack([key_transform(random_cov(rng, 16, 1.5), random_cov(rng, 16, 1.5)) for _ in range(2)])
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 5, 2, 16)), jnp.float32)
    qt, kt = _transform_query_key(
        q, k, jnp.asarray(np.linalg.inv(m), jnp.float32), jnp.asarray(np.swapaxes(m, -1, -2), jnp.float32)
    )
    scores = np.einsum("bthgd,bshd->bhgts", np.asarray(q).reshape(2, 5, 2, 2, 16), np.asarray(k))
    moved = np.einsum("bthgd,bshd->bhgts", np.asarray(qt).reshape(2, 5, 2, 2, 16), np.asarray(kt))
    np.testing.assert_allclose(moved, scores, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(kt) - np.asarray(k)).max() > 0.1  # the keys themselves did change


def test_cache_requires_the_transform_exactly_when_the_format_names_it():
    m = np.tile(np.eye(16, dtype=np.float32), (2, 2, 1, 1))
    kw = dict(num_pages=4, max_seqs=1, max_pages_per_seq=2, page_size=4)
    with pytest.raises(ValueError, match="needs the model's key transform"):
        init_cache(TINY, kv_cache_dtype="tq4-pc", **kw)
    with pytest.raises(ValueError, match="no -pc modifier"):
        init_cache(TINY, kv_cache_dtype="tq4", key_transform=m, **kw)
    with pytest.raises(ValueError, match="shape"):
        init_cache(TINY, kv_cache_dtype="tq4-pc", key_transform=m[:1], **kw)
    cache = init_cache(TINY, kv_cache_dtype="tq4-pc", key_transform=m, **kw)
    assert cache.key_transform.shape == cache.query_transform.shape == (2, 2, 16, 16)


def test_unfitted_models_get_a_clear_error():
    with pytest.raises(ValueError, match="has none"):
        load_key_transforms("no-such-model", 2, 2, 16)


def test_the_shipped_smollm2_transform_loads():
    m = load_key_transforms("smollm2-135m", 30, 3, 64)
    assert m.dtype == np.float32 and np.isfinite(m).all()
    np.testing.assert_allclose(np.linalg.det(m.astype(np.float64)), 1.0, rtol=1e-2)
