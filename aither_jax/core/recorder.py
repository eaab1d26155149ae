"""What the target computed while generating, kept per request: the training data of a DFlash
draft (`Engine.record`), made by generation itself rather than by a second pass over each
finished sequence."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from aither_jax.core.sequence import Sequence
from aither_jax.device.steps import top_log_probs
from models.config import ModelConfig

Rows = list[tuple[Sequence, list[int]]]


@dataclasses.dataclass
class TapRecord:
    """What was kept for one request: tapped hidden states [n, len(taps) * D] float16 by the
    position of their first token, and (top-k ids, log probabilities) by position."""

    hidden: dict[int, np.ndarray]
    top: dict[int, tuple[np.ndarray, np.ndarray]]


class TapRecorder:
    """Keeps, per request, the hidden states after the layers in `taps` at every position the
    model runs and, with `top_k`, the `top_k` most likely next tokens with their log
    probabilities at every position where a token is sampled (the last prompt position and
    every decode step; the top-k is chosen on the device).

    This is what a DFlash draft's training data needs, made by generation itself rather than
    by a second pass over each finished sequence. The engine refuses to record with
    speculative decoding, several decode steps per call, or a prefix cache (a cached page's
    positions are never run, so they would have no hidden states)."""

    def __init__(self, taps: tuple[int, ...], top_k: int, cfg: ModelConfig):
        if not taps or any(not 0 <= i < cfg.num_layers for i in taps):
            raise ValueError(f"taps must be layer indices in [0, {cfg.num_layers}), got {taps!r}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.taps, self.top_k, self.hidden_size = taps, top_k, cfg.hidden_size
        self.records: dict[int, TapRecord] = {}

    def keep(self, rows: Rows, hidden, logits) -> None:
        """Keeps one call's tapped hidden states and, for rows that sample, their top-k (called
        before the rows' new tokens are marked computed)."""
        top_k = self.top_k
        hidden, (ids, logp) = jax.device_get((hidden, top_log_probs(logits, top_k) if top_k else (None, None)))
        for i, (s, toks) in enumerate(rows):
            record = self.records.setdefault(s.seq_id, TapRecord({}, {}))
            if s.num_cached == 0:  # a first run, or a preempted request's recompute: its states replace any kept
                record.hidden.clear()
            record.hidden[s.num_cached] = hidden[i, : len(toks)].astype(np.float16)
            if top_k and s.num_pending == len(toks):  # this call runs its last pending token: it samples
                record.top[s.num_cached + len(toks) - 1] = (ids[i], logp[i])

    def take(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """What was kept for a finished request, dropped from the recorder: (the tapped
        hidden states [n, len(taps) * D] float16, the top-k ids [n, k] int32 and log
        probabilities [n, k] float32, or None without top_k) for its n = num_tokens positions.
        Its last token was sampled, never run: its hidden states are zeros. Positions where
        nothing was sampled (the prompt's but its last, and the last) hold id 0 and log
        probability -inf. Raises RuntimeError if any other position was never run."""
        record = self.records.pop(seq.seq_id, TapRecord({}, {}))
        n = seq.num_tokens
        hidden = np.full((n, len(self.taps) * self.hidden_size), np.nan, np.float16)
        for start, h in record.hidden.items():
            hidden[start : start + len(h)] = h
        hidden[n - 1] = 0
        missing = np.flatnonzero(np.isnan(hidden).any(axis=1))
        if missing.size:
            raise RuntimeError(f"request {seq.seq_id}: positions {missing[:5].tolist()} were never run")
        if not self.top_k:
            return hidden, None, None
        ids = np.zeros((n, self.top_k), np.int32)
        logp = np.full((n, self.top_k), -np.inf, np.float32)
        for pos, (i, lp) in record.top.items():
            ids[pos], logp[pos] = i, lp
        return hidden, ids, logp
