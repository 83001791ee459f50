"""Triton chunked gated delta rule for prefill (chunks of BT = 64 tokens, varlen, initial and
final state per slot). Three kernels:

1. prep, parallel over (chunk, value head): gating g, beta and the in-chunk cumulative decay
   gc; the WY form W = T (beta exp(gc) k), U = T (beta v) with T = (I + A)^-1,
   A[t, s] = beta_t exp(gc_t - gc_s) k_t.k_s (s < t), solved block-row by block-row over 16-row
   sub-blocks (each diagonal block inverted by forward substitution, the rest on tl.dot).
2. scan, parallel over (sequence, value head, BV columns), sequential over chunks: with H the
   state at the chunk start, v_new = U - W H and H <- exp(gc_last) H + (exp(gc_last - gc) k)^T v_new.
   It stores each chunk's start state and v_new (SPLIT_O, the default on the GPU: measured faster)
   or computes the output itself.
3. out, parallel over (chunk, value head, BV columns): o = exp(gc) q H + tril(q k^T exp(gc_t - gc_s)) v_new.

Chunks are "virtual tiles" (sequence b owns cu[b] // BT + b ..), found by binary search, so no
host sync is needed. Exponents are always of non-positive differences (masked with where).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.attention_kernels import _find_seq
from qv.kernels.gdn_recurrent import gdn_gate, gdn_recurrent, l2norm_rows, load_state, store_state
from qv.kernels.triton_utils import interpreting, next_pow2


@triton.jit
def _tril_inverse(b_A, BS: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A [BS, BS] by forward substitution over rows."""
    o_r = tl.arange(0, BS)
    b_T = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    for r in range(1, BS):
        b_a = tl.sum(tl.where(o_r[:, None] == r, b_A, 0.), axis=0)  # row r of A, indexed by s
        b_row = tl.sum(b_a[:, None] * b_T, axis=0)  # sum_s A[r, s] T[s, :]
        b_T = tl.where(o_r[:, None] == r, (o_r == r).to(tl.float32)[None, :] - b_row[None, :], b_T)
    return b_T


@triton.jit
def _load_k_rows(k_ptr, rows, m_t, hk, stride_kt, stride_kh, o_k, DK):
    b_k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + o_k[None, :],
                  mask=m_t[:, None] & (o_k[None, :] < DK), other=0.).to(tl.float32)
    return l2norm_rows(b_k)


@triton.jit
def gdn_chunk_prep_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, gc_ptr, cu_ptr, B, DK, DV, HV,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_wt, stride_wh, stride_ut, stride_uh,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
):
    tile = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    i_b = _find_seq(cu_ptr, tile, B, BT, True)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    L = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    c0 = (tile - (tl.load(cu_ptr + i_b) // BT + i_b)).to(tl.int64) * BT
    if c0 >= L:
        return
    hk = hv // REP
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    o_s = tl.arange(0, BS)
    neg_A = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + hv).to(tl.float32)
    dt = w_ptr.dtype.element_ty
    g_off = tl.zeros([], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.minimum(L - c0, BT), BS)):
        r_i = c0 + i * BS + o_s
        m_i = r_i < L
        rows_i = bos + r_i
        b_k = _load_k_rows(k_ptr, rows_i, m_i, hk, stride_kt, stride_kh, o_k, DK)
        b_g, b_beta = gdn_gate(tl.load(a_ptr + rows_i * stride_at + hv, mask=m_i, other=0.).to(tl.float32),
                               tl.load(b_ptr + rows_i * stride_bt + hv, mask=m_i, other=0.).to(tl.float32),
                               neg_A, dt_bias)
        b_g = tl.where(m_i, b_g, 0.)  # padding rows carry the last decay: exp differences stay <= 0
        b_beta = tl.where(m_i, b_beta, 0.)
        b_gc = g_off + tl.cumsum(b_g, axis=0)
        g_off += tl.sum(b_g, axis=0)
        tl.store(gc_ptr + rows_i * HV + hv, b_gc, mask=m_i)
        b_kb = (b_k * b_beta[:, None]).to(dt)
        b_rw = b_k * (b_beta * tl.exp(b_gc))[:, None]  # [BS, BK]
        b_ru = tl.load(v_ptr + rows_i[:, None] * stride_vt + hv * stride_vh + o_v[None, :],
                       mask=m_i[:, None] & (o_v[None, :] < DV), other=0.).to(tl.float32) * b_beta[:, None]
        tl.debug_barrier()  # W, U and gc of earlier sub-blocks were stored by other threads
        for j in range(0, i):
            r_j = c0 + j * BS + o_s
            rows_j = bos + r_j
            b_kj = _load_k_rows(k_ptr, rows_j, r_j < L, hk, stride_kt, stride_kh, o_k, DK)
            b_gcj = tl.load(gc_ptr + rows_j * HV + hv)  # earlier sub-blocks are full
            b_A = tl.dot(b_kb, tl.trans(b_kj.to(dt)), input_precision="ieee") * tl.exp(b_gc[:, None] - b_gcj[None, :])
            b_A = b_A.to(dt)
            b_wj = tl.load(w_ptr + rows_j[:, None] * stride_wt + hv * stride_wh + o_k[None, :])
            b_uj = tl.load(u_ptr + rows_j[:, None] * stride_ut + hv * stride_uh + o_v[None, :])
            b_rw -= tl.dot(b_A, b_wj, input_precision="ieee")
            b_ru -= tl.dot(b_A, b_uj, input_precision="ieee")
        b_A = tl.dot(b_kb, tl.trans(b_k.to(dt)), input_precision="ieee")
        lower = o_s[:, None] > o_s[None, :]
        b_A = tl.where(lower, b_A * tl.exp(tl.where(lower, b_gc[:, None] - b_gc[None, :], 0.)), 0.)
        b_T = _tril_inverse(b_A, BS).to(dt)
        b_w = tl.dot(b_T, b_rw.to(dt), input_precision="ieee")
        b_u = tl.dot(b_T, b_ru.to(dt), input_precision="ieee")
        # padding columns are stored as zeros so later sub-blocks can load whole tiles
        tl.store(w_ptr + rows_i[:, None] * stride_wt + hv * stride_wh + o_k[None, :], b_w.to(dt),
                 mask=m_i[:, None])
        tl.store(u_ptr + rows_i[:, None] * stride_ut + hv * stride_uh + o_v[None, :], b_u.to(dt),
                 mask=m_i[:, None])


@triton.jit
def _chunk_out(b_q, b_k, b_gc, b_hd, b_vnd, causal, dt: tl.constexpr):
    """o = exp(gc) q H + tril(q k^T exp(gc_t - gc_s)) v_new for one chunk [BT, BV] (fp32)."""
    b_o = tl.dot((b_q * tl.exp(b_gc)[:, None]).to(dt), b_hd, input_precision="ieee")
    b_s = tl.dot(b_q.to(dt), tl.trans(b_k.to(dt)), input_precision="ieee")
    b_s = tl.where(causal, b_s * tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.)), 0.)
    return b_o + tl.dot(b_s.to(dt), b_vnd, input_precision="ieee")


@triton.jit
def _chunk_gc(gc_ptr, bos, c0, L, rows, m_t, hv, HV, BT: tl.constexpr):
    """In-chunk cumulative decay of the chunk's rows (padding rows carry the last) and that last."""
    g_last = tl.load(gc_ptr + (bos + tl.minimum(c0 + BT, L) - 1) * HV + hv)
    b_gc = tl.load(gc_ptr + rows * HV + hv, mask=m_t, other=0.)
    return tl.where(m_t, b_gc, g_last), g_last


@triton.jit
def gdn_chunk_scan_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr, o_ptr, h_ptr, st_ptr, sc_ptr, cu_ptr, slot_ptr, init_ptr, scale, DK, DV, HV,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_ut, stride_uh, stride_ot, stride_oh,
    stride_hn, stride_hh, stride_hk, stride_ss, stride_sh, stride_sk, stride_cs, stride_ch,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, INT16: tl.constexpr,
    SPLIT_O: tl.constexpr,
):
    """SPLIT_O: store each chunk's start state and v_new (into U) for gdn_chunk_out_kernel instead of
    producing the output here, which keeps only the two state dots on the sequential path."""
    i_b = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    o_v = tl.program_id(2) * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    m_v = o_v < DV
    hk = hv // REP
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    L = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    vt0 = tl.load(cu_ptr + i_b).to(tl.int64) // BT + i_b  # virtual index of this sequence's first chunk
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    if tl.load(init_ptr + i_b) != 0:
        b_h = load_state(st_ptr, sc_ptr, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs,
                         stride_ch, INT16)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    dt = w_ptr.dtype.element_ty
    causal = o_t[:, None] >= o_t[None, :]
    for c0 in range(0, L, BT):
        r = c0 + o_t
        m_t = r < L
        rows = bos + r
        b_k = _load_k_rows(k_ptr, rows, m_t, hk, stride_qt, stride_qh, o_k, DK)
        b_gc, g_last = _chunk_gc(gc_ptr, bos, c0, L, rows, m_t, hv, HV, BT)
        b_w = tl.load(w_ptr + rows[:, None] * stride_wt + hv * stride_wh + o_k[None, :], mask=m_t[:, None], other=0.)
        p_u = u_ptr + rows[:, None] * stride_ut + hv * stride_uh + o_v[None, :]
        m_u = m_t[:, None] & m_v[None, :]
        b_hd = b_h.to(dt)
        b_vn = tl.load(p_u, mask=m_u, other=0.).to(tl.float32) - tl.dot(b_w, b_hd, input_precision="ieee")
        b_vnd = b_vn.to(dt)
        if SPLIT_O:
            p_h = h_ptr + (vt0 + c0 // BT) * stride_hn + hv * stride_hh + o_k[:, None] * stride_hk + o_v[None, :]
            tl.store(p_h, b_hd, mask=m_v[None, :])
            tl.store(p_u, b_vnd, mask=m_u)
        else:
            b_q = _load_k_rows(q_ptr, rows, m_t, hk, stride_qt, stride_qh, o_k, DK) * scale
            b_o = _chunk_out(b_q, b_k, b_gc, b_hd, b_vnd, causal, dt)
            tl.store(o_ptr + rows[:, None] * stride_ot + hv * stride_oh + o_v[None, :],
                     b_o.to(o_ptr.dtype.element_ty), mask=m_u)
        b_kd = (b_k * tl.exp(g_last - b_gc)[:, None]).to(dt)
        b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_kd), b_vnd, input_precision="ieee")
    store_state(st_ptr, sc_ptr, b_h, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs,
                stride_ch, INT16)


@triton.jit
def gdn_chunk_out_kernel(
    q_ptr, k_ptr, u_ptr, gc_ptr, h_ptr, o_ptr, cu_ptr, B, scale, DK, DV, HV,
    stride_qt, stride_qh, stride_ut, stride_uh, stride_ot, stride_oh, stride_hn, stride_hh, stride_hk,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):
    """Outputs of every (chunk, value head, BV columns) in parallel from the scan's chunk-start
    states and v_new."""
    tile = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    o_v = tl.program_id(2) * BV + tl.arange(0, BV)
    i_b = _find_seq(cu_ptr, tile, B, BT, True)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    L = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    c0 = (tile - (tl.load(cu_ptr + i_b) // BT + i_b)).to(tl.int64) * BT
    if c0 >= L:
        return
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    m_v = o_v < DV
    hk = hv // REP
    r = c0 + o_t
    m_t = r < L
    rows = bos + r
    dt = u_ptr.dtype.element_ty
    b_q = _load_k_rows(q_ptr, rows, m_t, hk, stride_qt, stride_qh, o_k, DK) * scale
    b_k = _load_k_rows(k_ptr, rows, m_t, hk, stride_qt, stride_qh, o_k, DK)
    b_gc, g_last = _chunk_gc(gc_ptr, bos, c0, L, rows, m_t, hv, HV, BT)
    b_hd = tl.load(h_ptr + tile.to(tl.int64) * stride_hn + hv * stride_hh + o_k[:, None] * stride_hk + o_v[None, :],
                   mask=m_v[None, :], other=0.)
    m_u = m_t[:, None] & m_v[None, :]
    b_vnd = tl.load(u_ptr + rows[:, None] * stride_ut + hv * stride_uh + o_v[None, :], mask=m_u, other=0.)
    b_o = _chunk_out(b_q, b_k, b_gc, b_hd, b_vnd, o_t[:, None] >= o_t[None, :], dt)
    tl.store(o_ptr + rows[:, None] * stride_ot + hv * stride_oh + o_v[None, :], b_o.to(o_ptr.dtype.element_ty),
             mask=m_u)


def _scan_bv(device, n_seq, hv, dv, split_o):
    """Value columns per scan program (measured on the H200: wider tiles beat more programs)."""
    if interpreting(device):
        return 16
    return min(next_pow2(dv, 16), 32 if split_o else 64)


def chunk_prep(k, v, a, b, A_log, dt_bias, cu_seqlens, hv, warps=4):
    """W [T, Hv, BK], U [T, Hv, BV] (activation dtype) and gc [T, Hv] (fp32) of every chunk."""
    t, hk, dk = k.shape
    dv, n_seq = v.shape[2], cu_seqlens.shape[0] - 1
    bk, bvf = next_pow2(dk, 16), next_pow2(dv, 16)
    w = torch.empty((t, hv, bk), dtype=k.dtype, device=k.device)
    u = torch.empty((t, hv, bvf), dtype=k.dtype, device=k.device)
    gc = torch.empty((t, hv), dtype=torch.float32, device=k.device)
    gdn_chunk_prep_kernel[(t // 64 + n_seq, hv)](
        k, v, a, b, A_log, dt_bias, w, u, gc, cu_seqlens, n_seq, dk, dv, hv, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), a.stride(0), b.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        REP=hv // hk, BK=bk, BV=bvf, BT=64, BS=16, num_warps=warps, num_stages=1)
    return w, u, gc


def gdn_chunked(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                state_scale, config=None):
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n_seq = cu_seqlens.shape[0] - 1
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n_seq == 0 or t == 0:
        if n_seq:  # empty sequences still carry (or reset) their state
            gdn_recurrent(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                          state_scale, None)
        return out
    cfg = dict(config or {})
    bt = 64
    bk, bvf = next_pow2(dk, 16), next_pow2(dv, 16)
    dt = q.dtype
    w, u, gc = chunk_prep(k, v, a, b, A_log, dt_bias, cu_seqlens, hv, cfg.get("prep_warps", 4))
    split_o = cfg.get("split_o", not interpreting(q.device) or t > 2 * bt)
    bv = cfg.get("bv") or _scan_bv(q.device, n_seq, hv, dv, split_o)
    int16 = state.dtype == torch.int16
    sc = state_scale if int16 else state
    n_tiles = t // bt + n_seq
    h_all = torch.empty((n_tiles, hv, bk, bvf), dtype=dt, device=q.device) if split_o else w
    gdn_chunk_scan_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        q, k, w, u, gc, out, h_all, state, sc, cu_seqlens, state_slots, has_initial_state, scale, dk, dv, hv,
        q.stride(0), q.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), out.stride(0), out.stride(1),
        h_all.stride(0), h_all.stride(1), h_all.stride(2) if split_o else 0,
        state.stride(0), state.stride(1), state.stride(2), sc.stride(0) if int16 else 0, sc.stride(1) if int16 else 0,
        REP=hv // hk, BK=bk, BV=bv, BT=bt, INT16=int16, SPLIT_O=split_o,
        num_warps=cfg.get("scan_warps", 4 if interpreting(q.device) or bv < 64 or split_o else 8),
        num_stages=cfg.get("scan_stages", 2))
    if split_o:
        bvo = cfg.get("out_bv", min(bvf, 64))
        gdn_chunk_out_kernel[(n_tiles, hv, triton.cdiv(dv, bvo))](
            q, k, u, gc, h_all, out, cu_seqlens, n_seq, scale, dk, dv, hv, q.stride(0), q.stride(1), u.stride(0),
            u.stride(1), out.stride(0), out.stride(1), h_all.stride(0), h_all.stride(1), h_all.stride(2),
            REP=hv // hk, BK=bk, BV=bvo, BT=bt, num_warps=cfg.get("out_warps", 4), num_stages=1)
    return out
