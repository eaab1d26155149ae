"""The layer products in both residual-stream layouts (models.llama.linear, rms_norm) against
float64 numpy references."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import _attention_inputs, _attention_output, _mlp_block, linear, rms_norm, rope_tables
from models.weights import LayerWeights

CFG = ModelConfig("llama", 1, 64, 128, 4, 2, 16, 100, 64)  # one small llama layer


def _random_layer(dtype, rows: int) -> tuple[LayerWeights, jax.Array]:
    """Random weights of one CFG layer and a transposed stream [D, rows] of one token per row."""
    rng = np.random.default_rng(0)
    d, out = CFG.hidden_size, CFG.q_size + 2 * CFG.kv_size

    def param(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    lw = LayerWeights(
        param(d), param(out, d), param(d, CFG.q_size), param(d), param(2 * CFG.ffn_size, d), param(d, CFG.ffn_size)
    )
    return lw, param(d, rows)


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


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_linear_bfloat16_matches_reference_in_both_layouts(rows, transposed):
    """bf16 products on CPU pad their activations by one row; the padding must not show."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((48, 256)), jnp.bfloat16)  # [out, in]
    h = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)  # [N, in]
    got = jax.jit(linear, static_argnames="transposed")(h.T if transposed else h, w, transposed=transposed)
    assert got.shape == ((48, rows) if transposed else (rows, 48)) and got.dtype == jnp.bfloat16
    want = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(got.T if transposed else got, np.float64), want, rtol=1e-2, atol=0.1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the padding is for XLA's CPU backend")
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_bfloat16_layer_keeps_its_weights_in_bfloat16(rows):
    """A bf16 layer on the transposed stream must multiply its bf16 weights as they are. XLA's
    CPU backend otherwise converts a weight to float32 on every call (an f32[out, in] value in
    the optimized HLO) where an activation is a single row or laid out column-major, which made
    8-row bf16 decode steps slower than float32 ones."""
    lw, x = _random_layer(jnp.bfloat16, rows)
    cos, sin = rope_tables(jnp.zeros((rows, 1), jnp.int32), CFG.head_dim, CFG.rope_base)

    def layer(x, lw):
        q, _, _ = _attention_inputs(x, lw, CFG, cos, sin, rows, True)
        return _mlp_block(_attention_output(x, q, lw, CFG, True), lw, CFG, True)

    hlo = jax.jit(layer).lower(x, lw).compile().as_text()
    shapes = {w.shape for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)}
    converted = [m for m in re.findall(r"= f32\[(\d+),(\d+)\]", hlo) if tuple(map(int, m)) in shapes]
    assert converted == [], hlo


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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the transposed stream is CPU-only")
def test_qkv_product_keeps_the_transposed_layout():
    """On the transposed stream the query/key/value product must come out [out, N], the layout
    XLA's CPU matmul library takes. Left to itself, XLA folds the transpose back to rows into
    the product, making it an [N, out] product that falls back to a generic loop several times
    slower (docs/BENCHMARKS.md, decode section)."""
    cfg = CFG
    d, out = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    lw, x = _random_layer(jnp.float32, 4)
    cos, sin = rope_tables(jnp.zeros((4, 1), jnp.int32), cfg.head_dim, cfg.rope_base)
    fn = jax.jit(lambda x, lw: _attention_inputs(x, lw, cfg, cos, sin, 4, True))
    hlo = fn.lower(x, lw).compile().as_text()
    entry = hlo.split("\nENTRY")[1]
    weight = re.search(rf"%([\w.\-]+) = f32\[{out},{d}\]\{{1,0\}} parameter", entry).group(1)
    products = re.findall(rf"= f32\[(\d+),(\d+)\]\{{1,0\}} \w+\([^)]*%{re.escape(weight)}\b", entry)
    assert products == [(str(out), "4")], entry
    # and the layout change costs nothing in value
    q, k, v = fn(x, lw)
    qkv = (
        np.asarray(lw.wqkv, np.float64) @ np.asarray(rms_norm(x, lw.attn_norm, cfg.rms_norm_eps, axis=0), np.float64)
    ).T
    np.testing.assert_allclose(np.asarray(v).reshape(4, -1), qkv[:, cfg.q_size + cfg.kv_size :], rtol=1e-5, atol=1e-5)
