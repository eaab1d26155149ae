"""Shared fixtures: the real default model (ours and the HF reference on the same GGUF)."""

from __future__ import annotations

import os

import pytest

import aither_jax as aj
from models.registry import resolve_model

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def model_path() -> str:
    return resolve_model(MODEL)


@pytest.fixture(scope="session")
def llm_f32() -> aj.LLM:
    """float32 model whose unused KV pages hold NaN, so a stray read poisons the output."""
    return aj.LLM(
        MODEL,
        dtype="float32",
        kv_cache_dtype="fp32",
        max_model_len=640,
        max_num_seqs=8,
        num_pages=200,
        max_prefill_chunk=64,
        progress=False,
        _cache_fill_value=float("nan"),
    )


@pytest.fixture(scope="session")
def hf_model(model_path):
    """HF transformers' llama loaded from the same GGUF, dequantized to dense float32 on CPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path),
        gguf_file=os.path.basename(model_path),
        quantization_config=transformers.GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path)
    )
