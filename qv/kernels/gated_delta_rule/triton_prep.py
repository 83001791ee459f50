"""The WY prep of the chunked gated delta rule (triton_chunk.py's stage 1), per (chunk of BT = 64 tokens,
value head): gating g, beta = sigmoid(b) and the in-chunk cumulative decay gc; W = T (beta exp(gc) k),
U = T (beta v) with T = (I + A)^-1, A[t, s] = beta_t exp(gc_t - gc_s) k_t.k_s (s < t) over l2-normalised
k; and gc and k's inverse l2 norms per (token, value head), which the scan and out kernels reuse.

Two implementations with the same outputs:
- split (the default, the faster: bench/kernels.py --sweep gdn), in the style of FLA's kkt_solve and
  recompute_w_u: gdn_chunk_solve_kernel (gates, norms, the ten 16 x 16 blocks of k k^T streamed over
  k's columns, T stored as a [64, 64] matrix per chunk and value head; one warp a program) and
  gdn_chunk_wy_kernel (W and U as 64-row dots of T, which sm_90 runs as warpgroup MMAs);
- fused (config prep="fused"): gdn_chunk_prep_kernel, all in registers on the chunk's four 16-row
  sub-blocks: the blocks of A on tl.dot, the diagonal blocks of T by forward substitution (the four
  in one chain), the others by block forward substitution (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.gated_delta_rule.configs import FUSED_PREP_WARPS, SOLVE_BK, SOLVE_STAGES, SOLVE_WARPS, WY_WARPS
from qv.kernels.gated_delta_rule.triton_recurrent import gdn_gate
from qv.kernels.triton_utils import find_seq, jit_per_step, next_pow2


@triton.jit
def _chunk_of_tile(cu_ptr, tile, B, BT: tl.constexpr):
    """Start row and length of the sequence that owns virtual tile `tile`, and the tile's first row
    within it (c0 >= L: a tile past the sequence end, nothing to do)."""
    i_b = find_seq(cu_ptr, tile, B, BT, True)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    L = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    c0 = (tile - (tl.load(cu_ptr + i_b) // BT + i_b)).to(tl.int64) * BT
    return bos, L, c0


@triton.jit
def _sub_block_rows(bos, L, c0, BS: tl.constexpr):
    """Rows of the chunk's four BS-row sub-blocks and their masks (rows past the sequence end are padding)."""
    r1 = c0 + tl.arange(0, BS)
    r2, r3, r4 = r1 + BS, r1 + 2 * BS, r1 + 3 * BS
    return bos + r1, bos + r2, bos + r3, bos + r4, r1 < L, r2 < L, r3 < L, r4 < L


@triton.jit
def _tril_inverse4(b_A1, b_A2, b_A3, b_A4, BS: tl.constexpr):
    """(I + A)^-1 of four strictly lower-triangular [BS, BS] blocks (fp32) by forward substitution
    over rows, the four stacked as [BS, BS, 2, 2] so they share one chain of BS - 1 steps. The
    chain runs on T^T: row r of T = e_r - A[r, :] T is a reduction along the second axis, and
    extracting A[r, :] does not depend on T (off the chain)."""
    b_A = tl.join(tl.join(b_A1, b_A2), tl.join(b_A3, b_A4))
    o_r = tl.arange(0, BS)[:, None, None, None]
    o_c = tl.arange(0, BS)[None, :, None, None]
    b_Tt = tl.where(o_r == o_c, 1., tl.zeros_like(b_A))  # T^T, starting from I
    for r in range(1, BS):
        b_a = tl.sum(tl.where(o_r == r, b_A, 0.), axis=0)  # A[r, s], indexed by s
        b_x = tl.sum(b_Tt * b_a[None, :, :, :], axis=1)  # sum_s T[s, c] A[r, s], indexed by c
        b_Tt = tl.where(o_c == r, (o_r == r).to(tl.float32) - b_x[:, None, :, :], b_Tt)
    b_T12, b_T34 = tl.split(tl.permute(b_Tt, (1, 0, 2, 3)))
    b_T1, b_T2 = tl.split(b_T12)
    b_T3, b_T4 = tl.split(b_T34)
    return b_T1, b_T2, b_T3, b_T4


@triton.jit
def _tril_inverse1(b_A):
    """(I + A)^-1 of one strictly lower-triangular [BS, BS] block (fp32) by forward substitution
    over rows, kept in the layout A arrives in: X = (I + A)^-1 - I has rows X_r = -A_r - A_r X
    (A_r X only reads the rows s < r already done), rows 0 and 1 being -A_r as they start."""
    o_i = tl.arange(0, b_A.shape[0])
    b_X = -b_A
    for r in range(2, b_A.shape[0]):
        b_a = tl.sum(tl.where((o_i == r)[:, None], b_X, 0.), axis=0)  # -A[r, :] (row r not yet replaced)
        b_a = b_a + tl.sum(b_a[:, None] * b_X, axis=0)
        b_X = tl.where((o_i == r)[:, None], b_a[None, :], b_X)
    return b_X + (o_i[:, None] == o_i[None, :]).to(tl.float32)


@triton.jit
def _gate_rows(a_ptr, b_ptr, gc_ptr, rows, m, g_off, hv, HV, neg_A, dt_bias, stride_at, stride_bt):
    """beta and the cumulative decay gc (stored) of one 16-row sub-block and the decay up to its
    end. Padding rows get g = 0 (they carry the last decay, so exponent differences stay <= 0)
    and beta = 0."""
    b_g, b_beta = gdn_gate(tl.load(a_ptr + rows * stride_at + hv, mask=m, other=0.).to(tl.float32),
                           tl.load(b_ptr + rows * stride_bt + hv, mask=m, other=0.).to(tl.float32),
                           neg_A, dt_bias)
    b_g = tl.where(m, b_g, 0.)
    b_gc = g_off + tl.cumsum(b_g, axis=0)
    tl.store(gc_ptr + rows * HV + hv, b_gc, mask=m)
    return tl.where(m, b_beta, 0.), b_gc, g_off + tl.sum(b_g, axis=0)


@triton.jit
def _prep_rows(k_ptr, a_ptr, b_ptr, gc_ptr, rk_ptr, rows, m, g_off, hk, hv, HV, neg_A, dt_bias, o_k,
               DK, stride_kt, stride_kh, stride_at, stride_bt):
    """One 16-row sub-block of a chunk: raw k [16, BK] (zeros past DK and in padding rows), the
    inverse l2 norms of its rows, beta, and the cumulative decay gc continuing from g_off (the
    decay of the earlier sub-blocks; stored, as are the inverse norms) with the decay up to its end.
    Padding rows get g = 0 (they carry the last decay, so exponent differences stay <= 0) and beta = 0."""
    b_k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + o_k[None, :],
                  mask=m[:, None] & (o_k[None, :] < DK), other=0.)
    b_kf = b_k.to(tl.float32)
    b_rn = tl.math.rsqrt(tl.sum(b_kf * b_kf, axis=1) + 1e-6)  # as l2norm_rows
    b_beta, b_gc, g_end = _gate_rows(a_ptr, b_ptr, gc_ptr, rows, m, g_off, hv, HV, neg_A, dt_bias, stride_at,
                                     stride_bt)
    tl.store(rk_ptr + rows * HV + hv, b_rn, mask=m)
    return b_k, b_rn, b_beta, b_gc, g_end


@triton.jit
def _load_v_rows(v_ptr, rows, m, hv, stride_vt, stride_vh, o_v, DV):
    return tl.load(v_ptr + rows[:, None] * stride_vt + hv * stride_vh + o_v[None, :],
                   mask=m[:, None] & (o_v[None, :] < DV), other=0.)


@triton.jit
def _kkt_block(b_k_i, b_rn_i, b_beta_i, b_gc_i, b_k_j, b_rn_j, b_gc_j, DIAG: tl.constexpr):
    """A_ij = beta_i exp(gc_i - gc_j) k_i k_j^T / (|k_i| |k_j|) [16, 16] (fp32) of sub-blocks
    i >= j from raw k; strictly lower on the diagonal (DIAG), where the exponent is masked to
    stay <= 0."""
    return _scale_kkt(tl.dot(b_k_i, tl.trans(b_k_j), input_precision="ieee"), b_rn_i, b_beta_i, b_gc_i, b_rn_j, b_gc_j,
                      DIAG)


@triton.jit
def _scale_kkt(b_kk, b_rn_i, b_beta_i, b_gc_i, b_rn_j, b_gc_j, DIAG: tl.constexpr):
    """A_ij of _kkt_block from the raw product k_i k_j^T [16, 16] (fp32)."""
    b_A = b_kk * (b_beta_i * b_rn_i)[:, None] * b_rn_j[None, :]
    b_d = b_gc_i[:, None] - b_gc_j[None, :]
    if DIAG:
        o_s = tl.arange(0, b_A.shape[0])
        lower = o_s[:, None] > o_s[None, :]
        return tl.where(lower, b_A * tl.exp(tl.where(lower, b_d, 0.)), 0.)
    return b_A * tl.exp(b_d)


@triton.jit
def _mm(b_x, b_y):
    """fp32 product of two [16, 16] blocks (the merge of T stays in fp32)."""
    return tl.dot(b_x, b_y, input_precision="ieee")


@triton.jit
def _mmp(b_x, b_y, PREC: tl.constexpr):
    """fp32-accumulated product of two [16, 16] fp32 blocks with the given input precision."""
    return tl.dot(b_x, b_y, input_precision=PREC)


@triton.jit
def _tdot(b_T, b_s, b_x, acc):
    """acc + T_ij diag(s_j) x_j: the column scale s_j goes on the [16, 16] block T_ij (fp32),
    which is then rounded to the dtype of x_j (the activation dtype) for the dot."""
    return tl.dot((b_T * b_s[None, :]).to(b_x.dtype), b_x, acc, input_precision="ieee")


@triton.jit
def _store_rows(p, rows, m, stride_t, b_x):
    tl.store(p + rows[:, None] * stride_t, b_x.to(p.dtype.element_ty), mask=m[:, None])


@jit_per_step("B")
def gdn_chunk_prep_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, gc_ptr, rk_ptr, cu_ptr, B, DK, DV, HV,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_wt, stride_wh, stride_ut, stride_uh,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
):
    """W = T diag(beta exp(gc)) k, U = T diag(beta) v of one (chunk, value head), k l2-normalised,
    T = (I + A)^-1, all in registers on the chunk's four 16-row sub-blocks (BT = 4 BS): T_ii by
    forward substitution, then block forward substitution T_ij = -T_ii sum_{j <= l < i} A_il T_lj
    (1-based block indices). The l2 norms of k scale A and W's columns instead of k itself."""
    tl.static_assert(BT == 4 * BS)
    tile = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    bos, L, c0 = _chunk_of_tile(cu_ptr, tile, B, BT)
    if c0 >= L:
        return
    hk = hv // REP
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    rows1, rows2, rows3, rows4, m1, m2, m3, m4 = _sub_block_rows(bos, L, c0, BS)
    neg_A = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + hv).to(tl.float32)
    g0 = tl.zeros([], dtype=tl.float32)
    k1, rn1, beta1, gc1, g1 = _prep_rows(k_ptr, a_ptr, b_ptr, gc_ptr, rk_ptr, rows1, m1, g0, hk, hv, HV, neg_A,
                                         dt_bias, o_k, DK, stride_kt, stride_kh, stride_at, stride_bt)
    k2, rn2, beta2, gc2, g2 = _prep_rows(k_ptr, a_ptr, b_ptr, gc_ptr, rk_ptr, rows2, m2, g1, hk, hv, HV, neg_A,
                                         dt_bias, o_k, DK, stride_kt, stride_kh, stride_at, stride_bt)
    k3, rn3, beta3, gc3, g3 = _prep_rows(k_ptr, a_ptr, b_ptr, gc_ptr, rk_ptr, rows3, m3, g2, hk, hv, HV, neg_A,
                                         dt_bias, o_k, DK, stride_kt, stride_kh, stride_at, stride_bt)
    k4, rn4, beta4, gc4, g4 = _prep_rows(k_ptr, a_ptr, b_ptr, gc_ptr, rk_ptr, rows4, m4, g3, hk, hv, HV, neg_A,
                                         dt_bias, o_k, DK, stride_kt, stride_kh, stride_at, stride_bt)
    # A, block row by block row
    A11 = _kkt_block(k1, rn1, beta1, gc1, k1, rn1, gc1, True)
    A21 = _kkt_block(k2, rn2, beta2, gc2, k1, rn1, gc1, False)
    A22 = _kkt_block(k2, rn2, beta2, gc2, k2, rn2, gc2, True)
    A31 = _kkt_block(k3, rn3, beta3, gc3, k1, rn1, gc1, False)
    A32 = _kkt_block(k3, rn3, beta3, gc3, k2, rn2, gc2, False)
    A33 = _kkt_block(k3, rn3, beta3, gc3, k3, rn3, gc3, True)
    A41 = _kkt_block(k4, rn4, beta4, gc4, k1, rn1, gc1, False)
    A42 = _kkt_block(k4, rn4, beta4, gc4, k2, rn2, gc2, False)
    A43 = _kkt_block(k4, rn4, beta4, gc4, k3, rn3, gc3, False)
    A44 = _kkt_block(k4, rn4, beta4, gc4, k4, rn4, gc4, True)
    # T = (I + A)^-1 (fp32): diagonal blocks, then block forward substitution
    T11, T22, T33, T44 = _tril_inverse4(A11, A22, A33, A44, BS)
    T21 = -_mm(T22, _mm(A21, T11))
    T32 = -_mm(T33, _mm(A32, T22))
    T43 = -_mm(T44, _mm(A43, T33))
    T31 = -_mm(T33, _mm(A31, T11) + _mm(A32, T21))
    T42 = -_mm(T44, _mm(A42, T22) + _mm(A43, T32))
    T41 = -_mm(T44, _mm(A41, T11) + _mm(A42, T21) + _mm(A43, T31))
    # W_i = sum_j T_ij diag(beta_j exp(gc_j) / |k_j|) k_j and U_i = sum_j T_ij diag(beta_j) v_j;
    # padding columns of k and v are zeros, so those of W and U are too
    s1, s2, s3, s4 = beta1 * tl.exp(gc1) * rn1, beta2 * tl.exp(gc2) * rn2, beta3 * tl.exp(gc3) * rn3, \
        beta4 * tl.exp(gc4) * rn4
    v1 = _load_v_rows(v_ptr, rows1, m1, hv, stride_vt, stride_vh, o_v, DV)
    v2 = _load_v_rows(v_ptr, rows2, m2, hv, stride_vt, stride_vh, o_v, DV)
    v3 = _load_v_rows(v_ptr, rows3, m3, hv, stride_vt, stride_vh, o_v, DV)
    v4 = _load_v_rows(v_ptr, rows4, m4, hv, stride_vt, stride_vh, o_v, DV)
    p_w = w_ptr + hv * stride_wh + o_k[None, :]
    p_u = u_ptr + hv * stride_uh + o_v[None, :]
    zw = tl.zeros([BS, BK], dtype=tl.float32)
    zu = tl.zeros([BS, BV], dtype=tl.float32)
    _store_rows(p_w, rows1, m1, stride_wt, _tdot(T11, s1, k1, zw))
    _store_rows(p_w, rows2, m2, stride_wt, _tdot(T22, s2, k2, _tdot(T21, s1, k1, zw)))
    _store_rows(p_w, rows3, m3, stride_wt, _tdot(T33, s3, k3, _tdot(T32, s2, k2, _tdot(T31, s1, k1, zw))))
    _store_rows(p_w, rows4, m4, stride_wt,
                _tdot(T44, s4, k4, _tdot(T43, s3, k3, _tdot(T42, s2, k2, _tdot(T41, s1, k1, zw)))))
    _store_rows(p_u, rows1, m1, stride_ut, _tdot(T11, beta1, v1, zu))
    _store_rows(p_u, rows2, m2, stride_ut, _tdot(T22, beta2, v2, _tdot(T21, beta1, v1, zu)))
    _store_rows(p_u, rows3, m3, stride_ut, _tdot(T33, beta3, v3, _tdot(T32, beta2, v2, _tdot(T31, beta1, v1, zu))))
    _store_rows(p_u, rows4, m4, stride_ut,
                _tdot(T44, beta4, v4, _tdot(T43, beta3, v3, _tdot(T42, beta2, v2, _tdot(T41, beta1, v1, zu)))))


@triton.jit
def _load_k_cols(k_ptr, rows, m, hk, stride_kt, stride_kh, o_k, DK):
    return tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + o_k[None, :],
                   mask=m[:, None] & (o_k[None, :] < DK), other=0.)


@triton.jit
def _store_block(p, rows, m, stride_t, b_x):
    o_c = tl.arange(0, b_x.shape[1])
    tl.store(p + rows[:, None] * stride_t + o_c[None, :], b_x.to(p.dtype.element_ty), mask=m[:, None])


@triton.jit
def _block_row(b_1, b_2, b_3, b_4):
    """[b_1 b_2 b_3 b_4] of four [BS, BS] blocks: join gives x[r, c, i, j] = b_(1 + i + 2 j), so
    column j' BS + c of the row is x[r, c, j' % 2, j' // 2]."""
    bs: tl.constexpr = b_1.shape[0]
    x = tl.join(tl.join(b_1, b_2), tl.join(b_3, b_4))
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (bs, 4 * bs))


@jit_per_step("B")
def gdn_chunk_solve_kernel(
    k_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, t_ptr, gc_ptr, rk_ptr, cu_ptr, B, DK, HV,
    stride_kt, stride_kh, stride_at, stride_bt, stride_tt, stride_th,
    REP: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr,
):
    """First half of the split prep, per (chunk, value head): gc and k's inverse norms (stored, as
    gdn_chunk_prep_kernel stores them) and T = (I + A)^-1 [BT, BT] of the chunk (stored in the
    activation dtype, zeros above the diagonal). Only the ten 16 x 16 blocks of k k^T, the four
    row sums of squares and the fp32 solve stay live: k streams through in BKC-column slices and no
    v, W or U is held, so one warp fits (offline sm_90: 240 registers, no spills; eight programs
    per SM, where the fused prep fits two of four warps each).
    PREC: input precision of the sixteen fp32 [16, 16] products that merge T's blocks: "ieee" is an
    FMA loop whose operand copies alone push one warp past 255 registers (offline sm_90); "tf32"
    (FLA's choice for these products) runs them on the tensor cores, fp32 accumulation either way."""
    tl.static_assert(BT == 4 * BS)
    tile = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    bos, L, c0 = _chunk_of_tile(cu_ptr, tile, B, BT)
    if c0 >= L:
        return
    hk = hv // REP
    rows1, rows2, rows3, rows4, m1, m2, m3, m4 = _sub_block_rows(bos, L, c0, BS)
    neg_A = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + hv).to(tl.float32)
    g0 = tl.zeros([], dtype=tl.float32)
    beta1, gc1, g1 = _gate_rows(a_ptr, b_ptr, gc_ptr, rows1, m1, g0, hv, HV, neg_A, dt_bias, stride_at, stride_bt)
    beta2, gc2, g2 = _gate_rows(a_ptr, b_ptr, gc_ptr, rows2, m2, g1, hv, HV, neg_A, dt_bias, stride_at, stride_bt)
    beta3, gc3, g3 = _gate_rows(a_ptr, b_ptr, gc_ptr, rows3, m3, g2, hv, HV, neg_A, dt_bias, stride_at, stride_bt)
    beta4, gc4, g4 = _gate_rows(a_ptr, b_ptr, gc_ptr, rows4, m4, g3, hv, HV, neg_A, dt_bias, stride_at, stride_bt)
    z = tl.zeros([BS, BS], dtype=tl.float32)
    D11, D21, D22, D31, D32, D33, D41, D42, D43, D44 = z, z, z, z, z, z, z, z, z, z
    zs = tl.zeros([BS], dtype=tl.float32)
    ss1, ss2, ss3, ss4 = zs, zs, zs, zs
    for k0 in range(0, DK, BKC):
        o_k = k0 + tl.arange(0, BKC)
        k1 = _load_k_cols(k_ptr, rows1, m1, hk, stride_kt, stride_kh, o_k, DK)
        k2 = _load_k_cols(k_ptr, rows2, m2, hk, stride_kt, stride_kh, o_k, DK)
        k3 = _load_k_cols(k_ptr, rows3, m3, hk, stride_kt, stride_kh, o_k, DK)
        k4 = _load_k_cols(k_ptr, rows4, m4, hk, stride_kt, stride_kh, o_k, DK)
        ss1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), axis=1)
        ss2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), axis=1)
        ss3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), axis=1)
        ss4 += tl.sum(k4.to(tl.float32) * k4.to(tl.float32), axis=1)
        D11 = tl.dot(k1, tl.trans(k1), D11, input_precision="ieee")
        D21 = tl.dot(k2, tl.trans(k1), D21, input_precision="ieee")
        D22 = tl.dot(k2, tl.trans(k2), D22, input_precision="ieee")
        D31 = tl.dot(k3, tl.trans(k1), D31, input_precision="ieee")
        D32 = tl.dot(k3, tl.trans(k2), D32, input_precision="ieee")
        D33 = tl.dot(k3, tl.trans(k3), D33, input_precision="ieee")
        D41 = tl.dot(k4, tl.trans(k1), D41, input_precision="ieee")
        D42 = tl.dot(k4, tl.trans(k2), D42, input_precision="ieee")
        D43 = tl.dot(k4, tl.trans(k3), D43, input_precision="ieee")
        D44 = tl.dot(k4, tl.trans(k4), D44, input_precision="ieee")
    rn1, rn2 = tl.math.rsqrt(ss1 + 1e-6), tl.math.rsqrt(ss2 + 1e-6)  # as l2norm_rows
    rn3, rn4 = tl.math.rsqrt(ss3 + 1e-6), tl.math.rsqrt(ss4 + 1e-6)
    tl.store(rk_ptr + rows1 * HV + hv, rn1, mask=m1)
    tl.store(rk_ptr + rows2 * HV + hv, rn2, mask=m2)
    tl.store(rk_ptr + rows3 * HV + hv, rn3, mask=m3)
    tl.store(rk_ptr + rows4 * HV + hv, rn4, mask=m4)
    A11 = _scale_kkt(D11, rn1, beta1, gc1, rn1, gc1, True)
    A21 = _scale_kkt(D21, rn2, beta2, gc2, rn1, gc1, False)
    A22 = _scale_kkt(D22, rn2, beta2, gc2, rn2, gc2, True)
    A31 = _scale_kkt(D31, rn3, beta3, gc3, rn1, gc1, False)
    A32 = _scale_kkt(D32, rn3, beta3, gc3, rn2, gc2, False)
    A33 = _scale_kkt(D33, rn3, beta3, gc3, rn3, gc3, True)
    A41 = _scale_kkt(D41, rn4, beta4, gc4, rn1, gc1, False)
    A42 = _scale_kkt(D42, rn4, beta4, gc4, rn2, gc2, False)
    A43 = _scale_kkt(D43, rn4, beta4, gc4, rn3, gc3, False)
    A44 = _scale_kkt(D44, rn4, beta4, gc4, rn4, gc4, True)
    # T = (I + A)^-1 (fp32) as in gdn_chunk_prep_kernel, the diagonal blocks in four independent chains
    # (no join: at 1 or 2 warps the joined [BS, BS, 2, 2] chain spills)
    T11, T22, T33, T44 = _tril_inverse1(A11), _tril_inverse1(A22), _tril_inverse1(A33), _tril_inverse1(A44)
    T21 = -_mmp(T22, _mmp(A21, T11, PREC), PREC)
    T32 = -_mmp(T33, _mmp(A32, T22, PREC), PREC)
    T43 = -_mmp(T44, _mmp(A43, T33, PREC), PREC)
    T31 = -_mmp(T33, _mmp(A31, T11, PREC) + _mmp(A32, T21, PREC), PREC)
    T42 = -_mmp(T44, _mmp(A42, T22, PREC) + _mmp(A43, T32, PREC), PREC)
    T41 = -_mmp(T44, _mmp(A41, T11, PREC) + _mmp(A42, T21, PREC) + _mmp(A43, T31, PREC), PREC)
    # the zero blocks are stored too, so the W/U kernel loads whole rows with a row mask only
    p_t = t_ptr + hv * stride_th
    _store_block(p_t, rows1, m1, stride_tt, _block_row(T11, z, z, z))
    _store_block(p_t, rows2, m2, stride_tt, _block_row(T21, T22, z, z))
    _store_block(p_t, rows3, m3, stride_tt, _block_row(T31, T32, T33, z))
    _store_block(p_t, rows4, m4, stride_tt, _block_row(T41, T42, T43, T44))


@jit_per_step("B")
def gdn_chunk_wy_kernel(
    k_ptr, v_ptr, b_ptr, t_ptr, gc_ptr, rk_ptr, w_ptr, u_ptr, cu_ptr, B, DK, DV, HV,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_tt, stride_th, stride_wt, stride_wh,
    stride_ut, stride_uh,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):
    """Second half of the split prep, per (chunk, value head, BV columns of U; the first column
    block also writes W): W = T (diag(beta exp(gc) / |k|) k), U = T (diag(beta) v) as dots of the
    whole [BT, BT] T, rounded to the activation dtype, with [BT, *] row-scaled k and v, also
    rounded (fp32 accumulation): 64-row dots, which sm_90 runs as warpgroup MMAs."""
    tile = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    bos, L, c0 = _chunk_of_tile(cu_ptr, tile, B, BT)
    if c0 >= L:
        return
    hk = hv // REP
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    r = c0 + o_t
    m_t = r < L
    rows = bos + r
    b_t = tl.load(t_ptr + rows[:, None] * stride_tt + hv * stride_th + o_t[None, :], mask=m_t[:, None], other=0.)
    b_beta = tl.where(m_t, tl.sigmoid(tl.load(b_ptr + rows * stride_bt + hv, mask=m_t, other=0.).to(tl.float32)), 0.)
    b_v = tl.load(v_ptr + rows[:, None] * stride_vt + hv * stride_vh + o_v[None, :],
                  mask=m_t[:, None] & (o_v[None, :] < DV), other=0.)
    b_u = tl.dot(b_t, (b_v * b_beta[:, None]).to(b_v.dtype), input_precision="ieee")
    tl.store(u_ptr + rows[:, None] * stride_ut + hv * stride_uh + o_v[None, :], b_u.to(u_ptr.dtype.element_ty),
             mask=m_t[:, None])
    if i_v == 0:
        o_k = tl.arange(0, BK)
        b_gc = tl.load(gc_ptr + rows * HV + hv, mask=m_t, other=0.)
        b_rk = tl.load(rk_ptr + rows * HV + hv, mask=m_t, other=0.)
        b_k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + o_k[None, :],
                      mask=m_t[:, None] & (o_k[None, :] < DK), other=0.)
        b_w = tl.dot(b_t, (b_k * (b_beta * tl.exp(b_gc) * b_rk)[:, None]).to(b_k.dtype), input_precision="ieee")
        tl.store(w_ptr + rows[:, None] * stride_wt + hv * stride_wh + o_k[None, :], b_w.to(w_ptr.dtype.element_ty),
                 mask=m_t[:, None])


def _prep_outputs(k, hv, bk, bv):
    """What either prep stores: W [T, Hv, bk], U [T, Hv, bv] (activation dtype), gc and k's inverse
    norms [T, Hv] (fp32)."""
    t = k.shape[0]
    return (torch.empty((t, hv, bk), dtype=k.dtype, device=k.device),
            torch.empty((t, hv, bv), dtype=k.dtype, device=k.device),
            torch.empty((t, hv), dtype=torch.float32, device=k.device),
            torch.empty((t, hv), dtype=torch.float32, device=k.device))


def chunk_prep(k, v, a, b, A_log, dt_bias, cu_seqlens, hv, warps=FUSED_PREP_WARPS):
    """W [T, Hv, BK], U [T, Hv, BV] (activation dtype), gc [T, Hv] and the inverse l2 norms of k
    per value head rk [T, Hv] (fp32) of every chunk.

    warps: at dk = dv = 128 (bf16, sm_90) a program holds four 16 x 128 sub-blocks each of k and
    v plus the fp32 blocks of A and T: about 255 registers a thread with 4 warps (a few spills),
    so two programs share an SM (configs.FUSED_PREP_WARPS)."""
    t, hk, dk = k.shape
    dv, n_seq = v.shape[2], cu_seqlens.shape[0] - 1
    bk, bvf = next_pow2(dk, 16), next_pow2(dv, 16)
    w, u, gc, rk = _prep_outputs(k, hv, bk, bvf)
    gdn_chunk_prep_kernel[(t // 64 + n_seq, hv)](
        k, v, a, b, A_log, dt_bias, w, u, gc, rk, cu_seqlens, n_seq, dk, dv, hv, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), a.stride(0), b.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        REP=hv // hk, BK=bk, BV=bvf, BT=64, BS=16, num_warps=warps, num_stages=1)
    return w, u, gc, rk


def chunk_prep_split(k, v, a, b, A_log, dt_bias, cu_seqlens, hv, solve_warps=SOLVE_WARPS, solve_bk=SOLVE_BK,
                     wy_warps=WY_WARPS, wy_bv=None, solve_precision=None, solve_stages=SOLVE_STAGES):
    """chunk_prep's outputs from two kernels in the style of FLA's kkt_solve and recompute_w_u:
    gdn_chunk_solve_kernel stores gc, the inverse norms of k and T = (I + A)^-1 [T, Hv, 64]
    (activation dtype), gdn_chunk_wy_kernel forms W and U from it with 64-row dots.

    solve_bk: columns of k per step of the solve kernel's k k^T loop (solve_stages 2 or 3 prefetch the
    next steps' slices through cp.async); wy_bv: columns of U per
    wy program (all by default; the first column block also writes W); solve_precision: see
    gdn_chunk_solve_kernel's PREC, by default "tf32" for 16-bit activations (T is then rounded to
    8 or 11 significant bits anyway) and "ieee" for fp32 ones."""
    t, hk, dk = k.shape
    dv, n_seq = v.shape[2], cu_seqlens.shape[0] - 1
    bk, bvf = next_pow2(dk, 16), next_pow2(dv, 16)
    bt, n_tiles = 64, t // 64 + n_seq
    w, u, gc, rk = _prep_outputs(k, hv, bk, bvf)
    tinv = torch.empty((t, hv, bt), dtype=k.dtype, device=k.device)
    gdn_chunk_solve_kernel[(n_tiles, hv)](
        k, a, b, A_log, dt_bias, tinv, gc, rk, cu_seqlens, n_seq, dk, hv, k.stride(0), k.stride(1), a.stride(0),
        b.stride(0), tinv.stride(0), tinv.stride(1),
        REP=hv // hk, BKC=min(next_pow2(solve_bk, 16), bk), BT=bt, BS=16,
        PREC=solve_precision or ("ieee" if k.dtype == torch.float32 else "tf32"), num_warps=solve_warps,
        num_stages=solve_stages)
    bv = min(next_pow2(wy_bv or bvf, 16), bvf)
    gdn_chunk_wy_kernel[(n_tiles, hv, bvf // bv)](  # U's padding columns too (zeros), as chunk_prep
        k, v, b, tinv, gc, rk, w, u, cu_seqlens, n_seq, dk, dv, hv, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), b.stride(0), tinv.stride(0), tinv.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        REP=hv // hk, BK=bk, BV=bv, BT=bt, num_warps=wy_warps, num_stages=1)
    return w, u, gc, rk
