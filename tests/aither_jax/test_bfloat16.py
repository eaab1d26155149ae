"""bfloat16 weights and cache (the default) against the float32 model on the same prompts.

bf16 rounds weights and activations, so tokens may differ from float32 where the top two
logits nearly tie. The check (SPEC section 5's rule for bf16): at every greedy step, the
token bf16 chose is float32's top choice or within a small log-probability gap of it, given
the same prefix.
"""

from __future__ import annotations

import numpy as np
import pytest

import aither_jax as aj

PROMPTS = ["Once upon a time", "The three primary colors are", "def add(a, b):\n"]
LOGPROB_GAP = 0.5  # nats; bf16 logits differ from float32 by ~0.1-0.3 on this model


@pytest.fixture(scope="module")
def llm_bf16() -> aj.LLM:
    return aj.LLM(
        "smollm2-135m",
        dtype="bfloat16",
        kv_cache_dtype="bf16",
        max_model_len=256,
        max_num_seqs=4,
        num_pages=80,
        max_prefill_chunk=64,
        progress=False,
        _cache_fill_value=float("nan"),
    )


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_bf16_cache_is_stored_as_bits(llm_bf16):
    assert llm_bf16.engine.cache.spec.name == "bf16"
    assert [str(pool.dtype) for pool in llm_bf16.engine.cache.k] == ["uint16"]


def test_bf16_logits_close_to_float32(llm_bf16, llm_f32):
    ids = llm_f32.tokenizer.encode(" ".join(f"Line {i}: the river bends north near town {i}." for i in range(8)))
    ours, ref = llm_bf16.logits(ids), llm_f32.logits(ids)
    assert np.isfinite(ours).all()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    gap = np.abs(log_softmax(ours) - log_softmax(ref))
    probs = np.exp(log_softmax(ref))
    assert (gap * probs).sum(-1).max() < 0.1  # expected |log p| error under the float32 distribution


def test_bf16_greedy_tokens_are_float32_choices_up_to_near_ties(llm_bf16, llm_f32):
    outs = llm_bf16.generate(PROMPTS, aj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        ref = log_softmax(llm_f32.logits(ids[:-1]))[len(out.prompt_token_ids) - 1 :]
        chosen = ref[np.arange(len(out.token_ids)), out.token_ids]
        assert (ref.max(-1) - chosen).max() < LOGPROB_GAP
        assert out.token_ids[:4] == list(ref.argmax(-1)[:4])
