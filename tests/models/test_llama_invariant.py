"""The batch-invariant forward pass (models/llama_invariant.py) computes what the reference
forward pass computes: logits at every position of a prompt read in chunks, on stand-ins of
both models (Gemma's first layers slide a 512-token window, with per-layer RoPE bases and
query/key norms)."""

from __future__ import annotations

import numpy as np
import pytest

import aither_jax as aj
from tests.conftest import MODEL
from tests.models.test_gemma3 import MODEL as GEMMA

TEXT = (
    "The lighthouse keeper climbed the stairs each evening, counting the steps as his father had, "
    "and lit the lamp before the fog rolled in from the grey water beyond the harbour wall. "
)


def logits(model: str, kv: str, attention: str, length: int) -> np.ndarray:
    llm = aj.LLM(
        model, dtype="float32", kv_cache_dtype=kv, max_model_len=1024, max_num_seqs=1, num_pages=72,
        max_prefill_chunk=256, attention=attention, progress=False, _cache_fill_value=float("nan"), _num_layers=2,
    )  # fmt: skip
    ids = llm.tokenizer.encode(TEXT * 40)[:length]
    return llm.logits(ids)


@pytest.mark.parametrize(
    "model, kv, length",
    [(MODEL, "fp32", 300), (MODEL, "tq-k8v8-s2", 300), (GEMMA, "bf16", 560)],
)
def test_logits_match_the_reference_forward_pass(model, kv, length):
    got, want = (logits(model, kv, attention, length) for attention in ("invariant", "reference"))
    assert np.isfinite(got).all()
    # float32 throughout; the paths differ in summation order (and TurboQuant's codes where
    # a coordinate sits on a boundary).
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 2e-3 * scale
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99
