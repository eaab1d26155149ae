"""Scoring: a token sequence run through the paged cache in one pass, outside the request
queues, for its logits (perplexity, KV format quality) or tapped hidden states."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from aither_jax.core.runner import ModelRunner
from aither_jax.core.sequence import Sequence
from aither_jax.device.sampling import SamplingParams
from aither_jax.device.steps import top_log_probs


def forward_ids(
    runner: ModelRunner, ids: list[int], max_model_len: int, *, taps=(), logits=True, top_k=0, positions=None
) -> tuple[Any, np.ndarray | None]:
    """Runs `ids` through a temporary slot in one pass: (every position's logits [len(ids), V]
    float32 or None without `logits`, the hidden states after the layers in `taps`
    concatenated [len(ids), len(taps) * D] or None without taps).

    With `top_k` > 0 (and `logits`) the logits stay on the device, and the first result is
    instead the `top_k` most likely next tokens at every position with their log
    probabilities: ([len(ids), k] int32, [len(ids), k] float32), most likely first.

    `positions` (sorted indices into `ids`, or None for all) keeps the logits of those
    positions only (long texts with large vocabularies: each chunk's others are dropped as it
    comes). With bounded residency the text runs in chunks of the bound's prefill size,
    paging out as it goes.
    """
    cfg, scheduler = runner.cfg, runner.scheduler
    taps = tuple(taps)
    if any(not 0 <= i < cfg.num_layers for i in taps):
        raise ValueError(f"taps must be layer indices in [0, {cfg.num_layers}), got {taps!r}")
    if not taps and not logits:
        raise ValueError("nothing to return: ask for logits, taps or both")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not ids:
        raise ValueError("ids is empty")
    bad = [t for t in ids if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {cfg.vocab_size}): {bad[:5]}")
    if len(ids) > max_model_len:
        raise ValueError(f"{len(ids)} tokens exceed the maximum context length of {max_model_len} tokens")
    bounded = scheduler.bounded
    num_pages = scheduler.pages_needed(len(ids))
    if bounded is not None:  # pages are taken chunk by chunk, the lowest-scored paged out
        num_pages = 0
    if not scheduler.can_take_slot(num_pages):
        raise RuntimeError("no free cache slot or pages to score with; wait for running requests")
    seq = Sequence(-1, list(ids), SamplingParams(max_tokens=1, temperature=0.0), 0, 1, frozenset())
    scheduler.take_slot(seq, num_pages)
    chunks, hidden = [], []
    positions = None if positions is None else np.asarray(positions)
    try:
        while seq.num_cached < len(ids):
            n = min(len(ids) - seq.num_cached, runner.max_prefill_chunk)
            if bounded is not None:
                n = min(n, bounded.chunk_tokens)
                need = bounded.grow(seq, seq.num_cached + n)
                if need:
                    scheduler.add_pages(seq, need)
            rows = [(seq, seq.prompt_ids[seq.num_cached : seq.num_cached + n])]
            _, out, h, _, mass = runner.run(
                rows, return_logits="all" if logits else "none", taps=taps, host_logits=not top_k
            )
            if taps:
                hidden.append(np.asarray(h[0, :n], np.float32))
            if logits:
                # Top-k over the whole padded call (bucketed shapes compile once), then the row's part.
                parts = jax.device_get(top_log_probs(out, top_k)) if top_k else (out,)
                first = seq.num_cached
                keep = (
                    slice(None)
                    if positions is None
                    else positions[(positions >= first) & (positions < first + n)] - first
                )
                chunks.append([a[0, :n][keep] for a in parts])
            seq.num_cached += n
            if bounded is not None:
                if mass is not None:
                    bounded.observe(rows, *mass)
                bounded.reselect_due([seq])
    finally:
        scheduler.release(seq)
    hidden = np.concatenate(hidden) if taps else None
    if not logits:
        return None, hidden
    joined = tuple(np.concatenate(parts) for parts in zip(*chunks, strict=True))
    return (joined if top_k else joined[0]), hidden
