"""Triton attention: one flash-attention kernel serves prefill chunks over the paged cache, decode
and speculative rows (split-K over the context, then a reduce pass), and the vision tower's dense
varlen attention.

Rows of a program tile are (query token, q head of one KV head's group) pairs: row r is token
r // REP, head kvh * REP + r % REP, so each K/V tile is loaded once for the whole GQA group.
Query i of a sequence with q_len queries and kv_len keys sits at position kv_len - q_len + i and
sees keys 0..position (CAUSAL) or all kv_len keys. Scores use exp2 with log2(e) folded into the
scale; int8 K/V scales (one per key and KV head) multiply score columns and P columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_ptr, x, B, BQ: tl.constexpr, VIRTUAL: tl.constexpr):
    """Largest b in [0, B) with start(b) <= x; start(b) = cu[b] (tokens) or cu[b] // BQ + b (tiles)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        v = tl.load(cu_ptr + mid)
        if VIRTUAL:
            v = v // BQ + mid
        if v <= x:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _kv_offsets(o_n, kv_len, b, kvh, kv_start, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                stride_sb, stride_ss, BS, PAGED: tl.constexpr):
    """int64 offsets of key rows o_n in the K/V storage and in the scale tables (paged only)."""
    if PAGED:
        page = tl.load(bt_ptr + b * stride_bt + o_n // BS, mask=o_n < kv_len, other=0).to(tl.int64)
        off = (o_n % BS).to(tl.int64)
        return page * stride_kb + off * stride_ks + kvh * stride_kh, page * stride_sb + off * stride_ss + kvh
    else:
        rows = (kv_start + o_n).to(tl.int64)
        return rows * stride_kb + kvh * stride_kh, rows


@triton.jit
def _kv_codes(b_x, dtype: tl.constexpr, QUANT: tl.constexpr):
    """A loaded K/V tile in the dot dtype. int8 codes become fp16 without int->float conversion
    instructions (a quarter-rate unit that would bound decode): the bits 0x6480 + c read as fp16
    are 1152 + c exactly. fp32 dots take the exact fp32 conversion."""
    if QUANT:
        if dtype == tl.float16:
            return (b_x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        return b_x.to(tl.float32).to(dtype)
    return b_x.to(dtype)


@triton.jit
def _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr,
               stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, BS, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
               QUANT: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr):
    o_n = start + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < kv_len
    m_kd = m_n[:, None] & (o_d[None, :] < D)
    kv_off, s_off = _kv_offsets(o_n, kv_len, b, kvh, kv_start, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                                stride_sb, stride_ss, BS, PAGED)
    b_k = _kv_codes(tl.load(k_ptr + kv_off[:, None] + o_d[None, :], mask=m_kd, other=0.), b_q.dtype, QUANT)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BM, BN]
    if QUANT:
        b_s = b_s * tl.load(ks_ptr + s_off, mask=m_n, other=0.)[None, :]
    b_s = b_s * qk_scale
    if MASK:
        vis = m_n[None, :]
        if CAUSAL:
            vis = vis & (o_n[None, :] <= qpos[:, None])
        b_s = tl.where(vis, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    # a row may see no key in this tile (split-K over speculative rows): keep exp2 finite
    m_safe = tl.where(m_new == float("-inf"), 0., m_new)
    b_p = tl.math.exp2(b_s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    b_v = _kv_codes(tl.load(v_ptr + kv_off[:, None] + o_d[None, :], mask=m_kd, other=0.), b_q.dtype, QUANT)
    if QUANT:
        b_p = b_p * tl.load(vs_ptr + s_off, mask=m_n, other=0.)[None, :]
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, lse_ptr, bt_ptr, cu_q_ptr, kv_len_ptr,
    qk_scale, B, T, HQ,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os,
    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt, BS, SPLIT_LEN,
    D: tl.constexpr, REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, QUANT: tl.constexpr, CAUSAL: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
):
    BQ: tl.constexpr = BLOCK_M // REP
    kvh = tl.program_id(1).to(tl.int64)
    if DECODE:  # one program per sequence holds all its (few) query rows
        b = tl.program_id(0)
        q_lo = 0
    else:  # virtual tiles: sequence b owns tiles cu[b] // BQ + b ..; the heaviest (last) tiles go first
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        b = _find_seq(cu_q_ptr, tile, B, BQ, True)
        q_lo = (tile - (tl.load(cu_q_ptr + b) // BQ + b)) * BQ
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if q_lo >= q_len:
        return
    if PAGED:
        kv_len = tl.load(kv_len_ptr + b)
    else:
        kv_len = q_len
    o_m = tl.arange(0, BLOCK_M)
    tok = o_m // REP
    o_h = kvh * REP + o_m % REP
    row_ok = (tok < BQ) & (q_lo + tok < q_len)
    # padding rows take the last position so they see keys (no empty softmax); they are never stored
    qpos = tl.where(row_ok, kv_len - q_len + q_lo + tok, kv_len - 1)
    o_d = tl.arange(0, BLOCK_D)
    rows = (q_start + q_lo + tok).to(tl.int64)
    m_q = row_ok[:, None] & (o_d[None, :] < D)
    b_q = tl.load(q_ptr + rows[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :], mask=m_q, other=0.)
    if QUANT and b_q.dtype == tl.bfloat16:  # int8 K/V run their dots in fp16 (see _kv_codes)
        b_q = b_q.to(tl.float16)

    k_lo = 0
    if CAUSAL:
        k_end = kv_len - q_len + tl.minimum(q_lo + BQ, q_len)
        k_free = kv_len - q_len + q_lo + 1  # keys every row of the tile sees
    else:
        k_end = kv_len
        k_free = kv_len
    if SPLIT:
        k_lo = tl.program_id(2) * SPLIT_LEN
        k_end = tl.minimum(k_end, k_lo + SPLIT_LEN)
        if k_lo >= k_end:  # no row of this tile reaches this split; the reduce pass skips it
            return
    k_mid = tl.minimum(k_free, k_end)
    k_mid = tl.where(k_mid > k_lo, k_lo + (k_mid - k_lo) // BLOCK_N * BLOCK_N, k_lo)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_start = q_start
    for start in range(k_lo, k_mid, BLOCK_N):
        acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                   BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL, False)
    for start in range(k_mid, k_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                   BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL, True)

    b_o = acc / tl.where(l_i == 0., 1., l_i)[:, None]
    p_o = o_ptr + rows[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
    if SPLIT:
        split = tl.program_id(2).to(tl.int64)
        tl.store(p_o + split * stride_os, b_o, mask=m_q)
        b_lse = tl.where(l_i == 0., float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0., 1., l_i)))
        tl.store(lse_ptr + (split * T + rows) * HQ + o_h, b_lse, mask=row_ok)
    else:
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_q)


@triton.jit
def attn_reduce_kernel(po_ptr, lse_ptr, o_ptr, cu_q_ptr, kv_len_ptr, B, T, HQ, stride_ot, stride_oh, SPLIT_LEN,
                       D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combines the split partials of one (token, head): split s holds keys s*SPLIT_LEN.. and is
    used by a row iff its position reaches it."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = _find_seq(cu_q_ptr, t, B, 1, False)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    qpos = tl.load(kv_len_ptr + b) - q_len + (t - q_start)
    n_split = qpos // SPLIT_LEN + 1
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m = tl.full([], float("-inf"), dtype=tl.float32)
    w = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    row = t.to(tl.int64) * HQ + h
    for s in range(0, n_split):
        lse = tl.load(lse_ptr + s * T * HQ + row)
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        beta = tl.math.exp2(lse - m_new)
        b_o = tl.load(po_ptr + (s * T * HQ + row) * D + o_d, mask=m_d, other=0.)
        acc = acc * alpha + b_o * beta
        w = w * alpha + beta
        m = m_new
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + o_d, (acc / w).to(o_ptr.dtype.element_ty), mask=m_d)
