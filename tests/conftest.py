"""Shared fixtures: the real default model (ours and the HF reference on the same GGUF)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os

import jax
import numpy as np
import pytest

import aither_jax as aj
from aither_jax.compile.code_maps import CodeMapBudget
from models.registry import resolve_model, shipped_key_transform

MODEL = "smollm2-135m"
# Compiled code is dropped between tests from this share of the mapping limit up, well below
# the engine's own threshold (aither_jax/code_maps.py), so that clearing never happens inside
# a test that counts compilations or warnings. One pytest process compiles hundreds of shapes.
TEST_HIGH_WATER = 0.4
# And when the process holds more memory than this: every engine's compiled steps stay cached
# in the process (jax's caches) after the engine is gone, several GiB over a test file; what is
# needed again loads from the persistent compilation cache.
TEST_MAX_RSS_BYTES = 5 << 30
TEST_RSS_GROWTH_BYTES = 2 << 30


def _give_back_freed_memory() -> None:
    """Returns the heap's freed pages to the system (glibc's malloc_trim), so the process's
    resident memory after a release is what it still holds, not the high-water mark of every
    buffer it ever freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_released_at = [0]  # the process's RSS after the last release


@pytest.fixture(autouse=True)
def _compiled_code_headroom():
    # Freed memory does not always go back to the system, so a release is worth it only once
    # the process has grown well past where the last one left it.
    if CodeMapBudget(high_water=TEST_HIGH_WATER).release_if_over():
        _give_back_freed_memory()
        _released_at[0] = _rss_bytes()
    elif _rss_bytes() > max(TEST_MAX_RSS_BYTES, _released_at[0] + TEST_RSS_GROWTH_BYTES):
        jax.clear_caches()
        gc.collect()
        _give_back_freed_memory()
        _released_at[0] = _rss_bytes()
    yield


@pytest.fixture(scope="session")
def model_path() -> str:
    return resolve_model(MODEL)


# float32 weights and KV; unused KV pages hold NaN, so a stray read poisons the output.
F32 = dict(
    dtype="float32",
    kv_cache_dtype="fp32",
    max_model_len=640,
    max_num_seqs=8,
    num_pages=200,
    max_prefill_chunk=64,
    progress=False,
    _cache_fill_value=float("nan"),
)
# A stand-in of the default model for tests whose point is the engine rather than the model's
# output: two blocks of its width with random weights, its vocabulary and tokenizer
# (models.registry.load_model); it compiles and runs in a fraction of the time.
TINY = {"_num_layers": 2}


def give_key_transform(monkeypatch, stand_in, directory) -> None:
    """Gives a stand-in (`models.registry.load_model(..., num_layers=N)`, which ships no key
    transform) the first N layers of its real model's fitted transform, for one test: formats
    with -pc then build on it."""
    layers = stand_in.config.num_layers
    path = directory / "key_transform.npz"
    with np.load(shipped_key_transform(MODEL)) as f:
        np.savez(path, key_transform=f["key_transform"][:layers])
    monkeypatch.setattr(stand_in, "key_transform", path)


@pytest.fixture(scope="session")
def stand_in_draft(tmp_path_factory) -> str:
    """The path of a DFlash draft with random weights made for the two-block stand-in
    (tests/aither_jax/speculative/common.py: STAND_IN), for tests that run drafting paths."""
    from tests.aither_jax.speculative.common import write_stand_in_draft

    return write_stand_in_draft(tmp_path_factory.mktemp("draft") / "stand-in-dflash.npz")


@pytest.fixture(scope="session")
def llm_f32() -> aj.LLM:
    return aj.LLM(MODEL, **F32)


@pytest.fixture(scope="session")
def tiny_f32() -> aj.LLM:
    """`llm_f32`'s settings on the two-block stand-in."""
    return aj.LLM(MODEL, **F32, **TINY)


_HF_READER: dict[str, object] = {}  # the last GGUF file HF parsed: {path: its GGUFReader}


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within the block, HF transformers' GGUF loading parses each file's metadata once: it
    builds a `gguf.GGUFReader` for the config, again for the weights and again for the
    tokenizer (about 30 s each for Gemma-3's 262,144-entry vocabulary on 2 cores). The reader
    of the last file is kept for the next load of the same file (a model's tokenizer and
    weights load in neighbouring tests)."""
    import gguf

    original = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = os.path.realpath(path)
        if key not in _HF_READER:
            _HF_READER.clear()
            _HF_READER[key] = original(path, *args, **kwargs)
        return _HF_READER[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def hf_causal_lm(path: str):
    """HF transformers' model loaded from the GGUF at `path`, dequantized to dense float32 on CPU."""
    # Imported here, not at the top, so tests that never touch the reference skip the cost; they
    # are test extras (pyproject.toml), so a missing one fails the parity tests instead of skipping.
    import torch
    import transformers

    with _gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path),
            gguf_file=os.path.basename(path),
            quantization_config=transformers.GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
    model.eval()
    return model


def hf_gguf_tokenizer(path: str):
    """HF transformers' tokenizer built from the GGUF at `path`."""
    import transformers

    with _gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="session")
def hf_model(model_path):
    """HF transformers' llama loaded from the same GGUF, dequantized to dense float32 on CPU."""
    return hf_causal_lm(model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    return hf_gguf_tokenizer(model_path)
