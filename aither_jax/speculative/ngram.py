"""Prompt lookup: drafts copied from the context after the latest earlier match of its last n-gram."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

# -- proposers ------------------------------------------------------------------------------


def ngram_propose(tokens: Seq[int], k: int, *, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the
    longest suffix n-gram (n from max_n down to min_n); [] when nothing matches."""
    arr = np.asarray(tokens, np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)  # starts 0 .. size-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < size]  # a match must be followed by at least one token
        if hits.size:
            begin = int(hits[-1]) + n
            return [int(x) for x in arr[begin : begin + k]]
    return []
