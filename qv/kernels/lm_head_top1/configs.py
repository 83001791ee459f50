"""lm_head_top1's measured choices: the pass-1 tiles by rows and code width, and the shortlist lengths.

Re-measure (H200, 27B shapes): python bench/lm_head_top1.py --sweep. Under the CPU interpreter the tiles
are tiny so the tests cross vocabulary, row and word boundaries.
"""

from __future__ import annotations

from qv.kernels.triton_utils import interpreting, next_pow2

# Per vocabulary tile each row keeps its CAND best candidates, so two near-best tokens in one tile both
# survive; of those, the TOPK best overall are re-scored exactly. The miss rate (the exact best not on the
# shortlist) measured by bench/lm_head_top1.py at 27B shapes is in docs/VALIDATION.md.
CAND = 2
TOPK = {4: 64, 8: 32}


def rank_config(device, rows: int, bits: int | None) -> dict:
    """Pass-1 tiles: BLOCK_R rows of x and BLOCK_V vocabulary rows a program; BLOCK_W packed words (codes) or
    BLOCK_W weight columns (bits None: the dense weight) a step. One row: 4 warps, x needs no layout change.
    More rows: x reaches the codes' layout through shared memory, and one-warp programs do that without
    block barriers. Re-measure: python bench/lm_head_top1.py --sweep"""
    if interpreting(device):
        return dict(BLOCK_R=min(next_pow2(rows), 16), BLOCK_V=32, BLOCK_W=4, num_warps=1)
    if bits is None:
        return dict(BLOCK_R=min(next_pow2(rows), 4), BLOCK_V=16, BLOCK_W=256, num_warps=4)
    if rows == 1:
        return dict(BLOCK_R=1, BLOCK_V=64, BLOCK_W=64, num_warps=4)
    if rows <= 4:
        return dict(BLOCK_R=4, BLOCK_V=16, BLOCK_W=32, num_warps=1)
    return dict(BLOCK_R=8, BLOCK_V=8, BLOCK_W=32, num_warps=1)


def rescore_config(device) -> dict:
    """Pass 2: BLOCK_C shortlisted rows a program, BLOCK_H columns a step."""
    if interpreting(device):
        return dict(BLOCK_C=32, BLOCK_H=32, num_warps=1)
    return dict(BLOCK_C=1, BLOCK_H=8192, num_warps=4)  # one round of loads: its latency is the cost
