"""The layer products in both residual-stream layouts (models.llama.linear, rms_norm) against
float64 numpy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import linear, rms_norm


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_linear_matches_reference(rows, transposed):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((40, 24)).astype(np.float32)  # [out, in]
    h = rng.standard_normal((rows, 24)).astype(np.float32)
    got = np.asarray(linear(jnp.asarray(h.T if transposed else h), jnp.asarray(w), transposed=transposed))
    want = h.astype(np.float64) @ w.astype(np.float64).T  # [N, out]
    assert got.shape == ((40, rows) if transposed else (rows, 40))
    np.testing.assert_allclose(got.T if transposed else got, want, rtol=1e-5, atol=1e-5)


def test_linear_bfloat16_keeps_dtype_and_accumulates_in_float32():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((512, 4)), jnp.bfloat16)  # transposed stream [in, N]
    got = linear(h, w, transposed=True)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(w, np.float64) @ np.asarray(h, np.float64)
    # One bf16 rounding of the float32 sum (8 bits of mantissa), not 512 of them.
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=0.1)


def test_rms_norm_over_a_transposed_stream_matches_rows():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 32)).astype(np.float32)  # [N, D]
    weight = rng.standard_normal(32).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * weight
    rows = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(weight), 1e-5))
    cols = np.asarray(rms_norm(jnp.asarray(x.T), jnp.asarray(weight), 1e-5, axis=0))
    np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cols.T, want, rtol=1e-5, atol=1e-6)
