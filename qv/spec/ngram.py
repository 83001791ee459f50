"""Prompt-lookup drafts: find the longest recent suffix of the sequence that occurred before, and
propose the k tokens that followed its latest occurrence. Always exactly k tokens or nothing
(a shorter draft would break the uniform k+1 verification rows)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int = 2, max_n: int = 8,
                  window: int = 8192) -> list[int] | None:
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # candidate starts i with seq[i:i+n] == suffix and k tokens after it inside the known sequence
        last_start = length - n - k
        if last_start < 0:
            continue
        windows = sliding_window_view(seq[:last_start + n], n)  # [last_start + 1, n]
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            return seq[i:i + k].tolist()
    return None
