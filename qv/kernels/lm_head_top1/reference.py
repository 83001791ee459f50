"""Exact fp32 argmax of x @ W^T over the vocabulary, ties to the lowest index: the oracle of lm_head_top1
(arguments as in __init__.py; the ranking copy is not used). The logits are built CHUNK rows of the vocabulary at
a time (a row-int8 weight dequantized chunk by chunk), so the fp32 copy of a 27B lm_head never exists whole."""

from __future__ import annotations

import torch

from qv.kernels.lm_head_top1 import weight_rows

CHUNK = 32768


def lm_head_top1(x, weight, ranking=None):
    xf = x.float()
    best_v = torch.full((x.shape[0],), float("-inf"), device=x.device)
    best_i = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    for v0 in range(0, weight.shape[0], CHUNK):
        logits = xf @ weight_rows(weight, v0, v0 + CHUNK).T
        i = logits.argmax(-1)  # the first of equal maxima
        v = logits.gather(1, i[:, None])[:, 0]
        better = v > best_v  # an earlier chunk keeps a tie
        best_v = torch.where(better, v, best_v)
        best_i = torch.where(better, i + v0, best_i)
    return best_i
