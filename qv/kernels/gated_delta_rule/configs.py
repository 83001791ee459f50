"""The gated delta rule's measured choices: tiles of the token-by-token kernel, of the chunked scan and
output kernels and of the WY prep, and the variants the sweep ranks. Every setting was the fastest on the
H200 at the Qwen3.5-27B shapes (48 value heads, dk = dv = 128); the line above each names the bench command
that re-measures it. Under the CPU interpreter the tiles are tiny so the tests cross tile boundaries.
"""

from __future__ import annotations

import triton

from qv.kernels.triton_utils import interpreting, next_pow2, num_sms

# The longest query the token-by-token kernel takes (decode, verification, short queries); longer queries
# run chunked. A choice, not a measurement: the chunked kernels pay their prep for at least one chunk.
RECURRENT_MAX_LEN = 16


def recurrent_tile(device, n_seq, hv, dk, dv, int16, bv=None):
    """(value columns, warps) of a gdn_recurrent_kernel program: 64 columns where that fills the GPU; below
    one program per SM (batch 1 at 27B) 16-column programs. bv: the caller's column count (warps follow).
    Re-measure: python bench/kernels.py --sweep step"""
    if bv:
        return bv, 4 if dk * bv >= 2048 else 2
    bv = min(next_pow2(dv), 8 if interpreting(device) else 64)
    warps = 4 if dk * bv >= 2048 else 2
    if not interpreting(device) and n_seq * hv * triton.cdiv(dv, 64) < num_sms(device):
        bv, warps = 16, 2 if int16 else 1
    return bv, warps


# The chunked scan: 3 pipeline stages with the read-ahead of the next chunk's small tiles, which leaves room
# for three stages of W and k^T; the output kernel at 4 warps capped at 168 registers (no spills).
# Re-measure: python bench/kernels.py --sweep gdn
SCAN_STAGES = 3
SCAN_PREFETCH = True
OUT_WARPS = 4
OUT_MAXNREG = 168


def scan_bv(device, dv):
    """Value columns per scan program: 64 with 8 warps (one program per SM) beat 32 with 4 warps (two per SM).
    Re-measure: python bench/kernels.py --sweep gdn"""
    if interpreting(device):
        return 16
    return min(next_pow2(dv, 16), 64)


def scan_warps(device, bv):
    return 4 if interpreting(device) or bv < 64 else 8


def out_bv(bv_padded):
    """Value columns per output program (of the padded dv). Re-measure: python bench/kernels.py --sweep gdn"""
    return min(bv_padded, 64)


# The split prep (chunk_prep_split, the default): the solve kernel at 1 warp over 32-column slices of k with
# 2 cp.async stages (eight programs an SM), the W/U kernel at 8 warps. Re-measure: python bench/kernels.py --sweep gdn
SOLVE_WARPS = 1
SOLVE_BK = 32
SOLVE_STAGES = 2
WY_WARPS = 8
# The fused prep (config prep="fused"): 4 warps, so two programs share an SM and one's loads overlap the other's
# barrier-bound solve; 8 warps fit without spills but leave one. Re-measure: python bench/kernels.py --sweep gdn
FUSED_PREP_WARPS = 4

# config= variants of gdn_chunked that only a measurement can rank: bench/kernels.py --sweep gdn times them;
# tests/oracles/test_gated_delta_rule.py runs each (CPU and GPU). Their register and shared-memory use (offline
# sm_90 builds at dk = dv = 128) decides how many programs share an SM: the default scan (64 columns, 8 warps,
# 3 stages, read-ahead) fits one, 32 columns at 4 warps two; the solve kernel fits one warp without spills at
# "tf32" merges, where "ieee" merges spill below 4 warps.
SWEEP_CONFIGS = [dict(scan_prefetch=False, scan_stages=2, bv=32, scan_warps=4),  # the scan without the read-ahead
                 dict(bv=32, scan_warps=4), dict(bv=64, scan_warps=8, scan_stages=2), dict(scan_stages=4),
                 dict(solve_stages=1), dict(solve_stages=3), dict(out_warps=8), dict(out_bv=128, out_warps=8),
                 dict(prep="fused"), dict(split_o=False, bv=64, scan_warps=8)]
