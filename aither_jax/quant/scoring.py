"""Scoring KV formats on a text: perplexity, KL divergence and top-1 agreement against bf16 KV
(`FormatScorer`), shared by `python -m aither_jax.eval perplexity` and the bit allocation."""

from __future__ import annotations

import os
import time

import numpy as np

from aither_jax.context.prompt import text_prompt
from models.kv_spec import KVSpec, parse_kv_spec


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def quality_metrics(logits: np.ndarray, reference: np.ndarray, ids: list[int]) -> dict:
    """Next-token quality of `logits` [N, V] against the reference run's, on token ids [N].

    Position i predicts ids[i + 1]; the last position has no target.
    """
    lp, ref = log_softmax(logits[:-1].astype(np.float64)), log_softmax(reference[:-1].astype(np.float64))
    targets = np.asarray(ids[1:])
    nll = -lp[np.arange(len(targets)), targets].mean()
    nll_ref = -ref[np.arange(len(targets)), targets].mean()
    kl = (np.exp(ref) * (ref - lp)).sum(-1).mean()  # KL(reference || quantized)
    return {
        "perplexity": float(np.exp(nll)),
        "perplexity_bf16": float(np.exp(nll_ref)),
        "perplexity_change_pct": float((np.exp(nll - nll_ref) - 1) * 100),
        "kl_divergence": float(kl),
        "top1_agreement": float((lp.argmax(-1) == ref.argmax(-1)).mean()),
    }


class FormatScorer:
    """Scores KV formats on one text against bf16 KV: one model load, one reference run, then
    an engine per format that shares the weights."""

    def __init__(
        self, model: str, dtype: str, text_file: str, max_tokens: int, chunk: int, attention: str = "reference"
    ):
        import aither_jax as aj  # heavy import after argument checks
        from aither_jax.llm import resolve_attention, resolve_dtype

        with open(text_file, encoding="utf-8") as f:
            text = f.read()
        self.model, self.text_file, self.chunk = model, os.path.abspath(text_file), chunk
        self.dtype = resolve_dtype(dtype)
        # How quantized layers are read: "reference" decodes the pages (the measurements in
        # docs/BENCHMARKS.md), "xla" / "pallas" read them in the rotated domain as LLM does.
        self.attention = resolve_attention(attention)
        self.max_tokens = max_tokens
        self.llm = aj.LLM(model, dtype=self.dtype, kv_cache_dtype="bf16", max_num_seqs=1, max_model_len=max_tokens + 1)
        self.ids = text_prompt(self.llm.tokenizer, text).ids[:max_tokens]
        if len(self.ids) < 2:
            raise ValueError(f"{text_file} has fewer than 2 tokens")
        self.reference, _, _ = self.logits("bf16")
        self.bf16_bytes = parse_kv_spec("bf16").bytes_per_token(self.llm.config)

    def logits(self, kv: str) -> tuple[np.ndarray, float, str]:
        from aither_jax.core.engine import Engine

        engine = Engine(
            self.llm.model,
            max_num_seqs=1,
            max_model_len=self.max_tokens + 1,
            num_pages=-(-len(self.ids) // 16) + 1,
            max_prefill_chunk=self.chunk,
            kv_cache_dtype=kv,
            attention=self.attention,
        )
        t0 = time.perf_counter()
        out = engine.score(self.ids)
        return out, time.perf_counter() - t0, engine.cache.fingerprint

    def score(self, spec: KVSpec) -> dict:
        """One format's row: bytes per token, compression, and the quality metrics."""
        logits, seconds, fingerprint = self.logits(spec.name)
        per_token = spec.bytes_per_token(self.llm.config)
        return {
            "model": self.model,
            "kv_cache_dtype": spec.name,
            "bytes_per_token": per_token,
            "compression_vs_bf16": round(self.bf16_bytes / per_token, 3),
            **quality_metrics(logits, self.reference, self.ids),
            "num_tokens": len(self.ids),
            "text_file": self.text_file,
            "weights_dtype": self.dtype,
            "chunk": self.chunk,
            "attention": self.attention,
            "format_fingerprint": fingerprint,  # rotations, codebooks and key transform (PagedKVCache)
            "seconds": round(seconds, 3),
        }
