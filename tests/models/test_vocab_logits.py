"""The LM head product (models.llama.vocab_logits) against a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import vocab_logits


@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (3, 4, 48), (2, 1, 48)])
def test_vocab_logits_matches_reference(shape):
    rng = np.random.default_rng(len(shape) * 10 + shape[0])
    head = rng.standard_normal((300, shape[-1])).astype(np.float32)  # [V, D]
    x = rng.standard_normal(shape).astype(np.float32)
    got = vocab_logits(jnp.asarray(x), jnp.asarray(head))
    assert got.shape == shape[:-1] + (300,)
    assert got.dtype == jnp.float32
    want = x.astype(np.float64) @ head.astype(np.float64).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_vocab_logits_bfloat16_head_accumulates_in_float32():
    rng = np.random.default_rng(7)
    head = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    got = vocab_logits(x, head)
    assert got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(head, np.float64).T
    # bf16 inputs are exact in float64; only the float32 accumulation rounds.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)
