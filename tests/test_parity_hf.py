"""Our model against HF transformers loaded from the same GGUF: logits and greedy tokens (float32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aither_jax as aj
from models.llama import TRANSPOSED_MAX_TOKENS

# Both sides compute in float32 from identical dequantized weights; differences come only from
# summation order. Measured max |diff| is ~1e-4 on logits of magnitude ~30.
LOGIT_ATOL = 2e-3

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Café au lait, naïve façade — 日本語のテキスト 🤖🎉 and emoji.",
    # Longer than the 64-token prefill chunk and several 16-token pages.
    " ".join(f"Sentence number {i} talks about the weather in city {i * 7 % 13}." for i in range(20)),
]


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("text", TEXTS, ids=["prose", "code", "unicode", "long"])
def test_logits_match_hf(llm_f32, hf_model, text):
    ids = llm_f32.tokenizer.encode(text)
    ours = llm_f32.logits(ids)
    ref = hf_logits(hf_model, ids)
    assert ours.shape == ref.shape == (len(ids), llm_f32.config.vocab_size)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert np.abs(ours - ref).max() < LOGIT_ATOL


def test_logits_match_hf_in_one_large_chunk(llm_f32, hf_model):
    """Calls over more than TRANSPOSED_MAX_TOKENS tokens run the layers on [N, D] rows, smaller
    ones (the test above, 64-token chunks) on the transposed stream: both layouts match HF."""
    llm = aj.LLM(
        llm_f32.model_name,
        dtype="float32",
        kv_cache_dtype="fp32",
        max_model_len=640,
        max_prefill_chunk=256,
        progress=False,
    )
    ids = llm.tokenizer.encode(TEXTS[-1])[:200]
    assert TRANSPOSED_MAX_TOKENS < len(ids) <= 256
    ours = llm.logits(ids)
    ref = hf_logits(hf_model, ids)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert np.abs(ours - ref).max() < LOGIT_ATOL


# Both sides run past end-of-sequence, so every prompt is compared over exactly this many tokens.
GREEDY_TOKENS = 32
GREEDY = aj.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)


def hf_greedy(hf_model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF greedy continuations of exactly n tokens (EOS ignored), all prompts in one left-padded batch."""
    pad = hf_model.generation_config.pad_token_id
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
    return out[:, width:].tolist()


# "The end." emits EOS after ten tokens; the rest of the comparison runs past it.
PROMPTS = ["Once upon a time", "The three primary colors are", "import numpy as np\n", "The end."]
CHATS = [
    # The answer ends with EOS after eight tokens.
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three fruits 🍎."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
]


def test_greedy_raw_prompts_match_hf(llm_f32, hf_model):
    outs = llm_f32.generate(PROMPTS, GREEDY)
    expected = hf_greedy(hf_model, [out.prompt_token_ids for out in outs], GREEDY_TOKENS)
    for out, ref in zip(outs, expected, strict=True):
        assert len(out.token_ids) == GREEDY_TOKENS
        assert out.token_ids == ref


def test_greedy_chat_matches_hf(llm_f32, hf_model, hf_tokenizer):
    outs = llm_f32.chat(CHATS, GREEDY)
    expected = hf_greedy(hf_model, [out.prompt_token_ids for out in outs], GREEDY_TOKENS)
    for conv, out, ref in zip(CHATS, outs, expected, strict=True):
        ref_prompt = hf_tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
        ref_prompt = ref_prompt["input_ids"] if hasattr(ref_prompt, "keys") else ref_prompt
        assert out.prompt_token_ids == list(ref_prompt)
        assert len(out.token_ids) == GREEDY_TOKENS
        assert out.token_ids == ref
        assert out.text == hf_tokenizer.decode(ref, skip_special_tokens=True)
