"""Output processing: sampled tokens become a request's output, with stop tokens, stop strings,
the length limit, detokenizing and log probabilities."""

from __future__ import annotations

import time

import numpy as np

from aither_jax.core.sequence import Sequence
from models.tokenizer import Tokenizer


class OutputProcessor:
    """Appends sampled tokens to sequences and decides when each one finishes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def append_tokens(self, seq: Sequence, tokens: list[int], logits: np.ndarray | None = None) -> int:
        """Appends `tokens` (with logits [len, V] for log probabilities) until `seq` finishes;
        returns how many it took."""
        for j, token in enumerate(tokens):
            self.append(seq, int(token), None if logits is None else logits[j])
            if seq.finished:
                return j + 1
        return len(tokens)

    def append(self, seq: Sequence, token: int, logits: np.ndarray | None) -> None:
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.num_logprobs is not None and logits is not None:
            seq.logprobs.append(top_logprobs(logits, token, seq.num_logprobs))
        stops = seq.params.stop_strings
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
        elif stops:
            text = self.tokenizer.decode(seq.output_ids)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                seq.text = text[: min(hits)]
                seq.finish_reason = "stop"
                return
        if seq.finish_reason is None and len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            seq.text = self.tokenizer.decode(seq.output_ids)


def top_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the k most likely (token, log-probability)) from raw logits [V]."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    top = np.argpartition(-logp, k)[:k] if 0 < k < logp.size else np.arange(logp.size if k else 0)
    top = top[np.argsort(-logp[top], kind="stable")]
    return float(logp[token]), [(int(t), float(logp[t])) for t in top]


class TextStream:
    """Turns a growing list of token ids into text deltas that are never taken back: the tail
    that could still become a stop string, or an incomplete UTF-8 character, is held back."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def delta(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids)
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":  # an incomplete character (one U+FFFD per byte)
            end -= 1
        return self._advance(text[: max(end - self.holdback, 0)])

    def finish(self, final_text: str) -> str:
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        out, self.sent = text[len(self.sent) :], text
        return out
