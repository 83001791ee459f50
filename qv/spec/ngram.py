"""Prompt-lookup drafts: find the longest recent suffix of the sequence that occurred before, and
propose the k tokens that followed its latest occurrence. Always exactly k tokens or nothing
(a shorter draft would break the uniform k+1 verification rows).

The search runs in numba: it scans back from the end and stops at the latest occurrence, so a
step costs what the match costs rather than a pass over the whole window per suffix length."""

from __future__ import annotations

import numba
import numpy as np

WINDOW = 8192  # tokens searched back from the end of the sequence


@numba.njit(cache=True, nogil=True)
def _latest_match(seq: np.ndarray, k: int, min_n: int, max_n: int) -> int:
    """Start of the k tokens after the latest earlier occurrence of the longest suffix, or -1."""
    length = seq.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for i in range(length - n - k, -1, -1):  # occurrence seq[i:i+n], its k followers inside the sequence
            j = 0
            while j < n and seq[i + j] == seq[length - n + j]:
                j += 1
            if j == n:
                return i + n
    return -1


def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int = 2, max_n: int = 8,
                  window: int = WINDOW) -> list[int] | None:
    seq = np.ascontiguousarray(tokens[-window:], dtype=np.int64)
    start = _latest_match(seq, k, min_n, max_n)
    return None if start < 0 else seq[start:start + k].tolist()
