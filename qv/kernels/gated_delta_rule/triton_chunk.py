"""Triton chunked gated delta rule for prefill (chunks of BT = 64 tokens, varlen, initial and
final state per slot). Three stages:

1. prep (triton_prep.py), parallel over (chunk, value head): gating g, beta and the in-chunk
   cumulative decay gc; the WY form W = T (beta exp(gc) k), U = T (beta v) with T = (I + A)^-1,
   A[t, s] = beta_t exp(gc_t - gc_s) k_t.k_s (s < t); also gc and k's inverse l2 norms per
   (token, value head).
2. scan, parallel over (sequence, value head, BV columns), sequential over chunks: with H the
   state at the chunk start, v_new = U - W H and H <- exp(gc_last) H + k^T diag(rk exp(gc_last - gc)) v_new:
   the norms and decays scale the [BT, BV] tile of v_new, so the raw k tile feeds the dot as loaded
   (no fp32 copy and row reduction of a [BT, dk] tile per chunk on the sequential path).
   It stores each chunk's start state and v_new (SPLIT_O, the default on the GPU: measured faster by
   bench/kernels.py --sweep gdn) or computes the output itself. The next chunk's small reads are loaded a step ahead (PREFETCH).
3. out, parallel over (chunk, value head, BV columns): o = scale (exp(gc) q_n H + tril(q_n k_n^T
   exp(gc_t - gc_s)) v_new) from raw q and k: q's inverse norms (computed here) and rk scale the rows
   of q H and the entries of q k^T.

Chunks are "virtual tiles" (sequence b owns cu[b] // BT + b ..), found by binary search, so no
host sync is needed. Exponents are always of non-positive differences (masked with where).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.gated_delta_rule.configs import (OUT_MAXNREG, OUT_WARPS, SCAN_PREFETCH, SCAN_STAGES, out_bv, scan_bv,
                                                 scan_warps)
from qv.kernels.gated_delta_rule.triton_prep import _chunk_of_tile, chunk_prep, chunk_prep_split
from qv.kernels.gated_delta_rule.triton_recurrent import gdn_recurrent, load_state, store_state
from qv.kernels.triton_utils import interpreting, jit_per_step, next_pow2


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_kt(k_ptr, rows, m_t, hk, stride_kt, stride_kh, o_k, DK):
    """Raw q or k rows, transposed to [BK, BT] (activation dtype): the operand of k^T v_new and q k^T
    as loaded, so no fp32 copy of the tile is needed; the l2 norms are applied as scales instead."""
    return tl.load((k_ptr + hk * stride_kh) + rows[None, :] * stride_kt + o_k[:, None],
                   mask=m_t[None, :] & (o_k[:, None] < DK), other=0.)


@triton.jit
def _chunk_out(b_q, b_kt, b_gc, b_rk, b_hd, b_vnd, causal, scale):
    """o = scale (exp(gc) q_n H + tril(q_n k_n^T exp(gc_t - gc_s)) v_new) for one chunk [BT, BV]
    (fp32) from raw q [BT, BK] and k^T [BK, BT]: the inverse norms of q (computed here) and of k (b_rk,
    from the prep) scale the rows of q H and the entries of q k^T, which then lie in [-1, 1] before
    they are rounded for the second dot."""
    b_rq = tl.math.rsqrt(tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1) + 1e-6)  # as l2norm_rows
    b_o = tl.dot(b_q, b_hd, input_precision="ieee") * (b_rq * scale * tl.exp(b_gc))[:, None]
    # masked entries: exp2(-inf) = 0 (no second select); log2(e) applied to the vector, not the tile
    b_gl = b_gc * LOG2E
    b_s = tl.dot(b_q, b_kt, input_precision="ieee") * b_rq[:, None] * b_rk[None, :]
    b_s = b_s * tl.math.exp2(tl.where(causal, b_gl[:, None] - b_gl[None, :], float("-inf")))
    return b_o + scale * tl.dot(b_s.to(b_vnd.dtype), b_vnd, input_precision="ieee")


@triton.jit
def _chunk_gc(gc_ptr, rk_ptr, bos, c0, L, rows, m_t, hv, HV, BT: tl.constexpr):
    """In-chunk cumulative decay of the chunk's rows (padding rows carry the last), that last, and
    the rows' inverse k norms (0 in padding rows). A chunk at or past the end (c0 >= L: the scan's
    read-ahead) reads nothing."""
    g_last = tl.load(gc_ptr + (bos + tl.minimum(c0 + BT, L) - 1) * HV + hv, mask=c0 < L, other=0.)
    b_gc = tl.load(gc_ptr + rows * HV + hv, mask=m_t, other=0.)
    b_rk = tl.load(rk_ptr + rows * HV + hv, mask=m_t, other=0.)
    return tl.where(m_t, b_gc, g_last), g_last, b_rk


@triton.jit
def _scan_rows(c0, bos, L, o_t):
    """Rows of the chunk at c0 and which of them lie in the sequence."""
    r = c0 + o_t
    return bos + r, r < L


@triton.jit
def _scan_small(u_ptr, gc_ptr, rk_ptr, bos, c0, L, o_t, o_v, m_v, hv, HV, stride_ut, stride_uh, BT: tl.constexpr):
    """The scan's small reads for the chunk at c0: U's [BT, BV] tile, gc, g_last, k's inverse norms."""
    rows, m_t = _scan_rows(c0, bos, L, o_t)
    b_u = tl.load(u_ptr + rows[:, None] * stride_ut + hv * stride_uh + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.)
    b_gc, g_last, b_rk = _chunk_gc(gc_ptr, rk_ptr, bos, c0, L, rows, m_t, hv, HV, BT)
    return b_u, b_gc, g_last, b_rk


@triton.jit
def gdn_chunk_scan_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, gc_ptr, rk_ptr, o_ptr, h_ptr, st_ptr, sc_ptr, cu_ptr, slot_ptr, init_ptr, scale,
    DK, DV, HV, stride_qt, stride_qh, stride_wt, stride_wh, stride_ut, stride_uh, stride_ot, stride_oh,
    stride_hn, stride_hh, stride_hk, stride_ss, stride_sh, stride_sk, stride_cs, stride_ch,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, INT16: tl.constexpr,
    SPLIT_O: tl.constexpr, PREFETCH: tl.constexpr,
):
    """SPLIT_O: store each chunk's start state and v_new (into U) for gdn_chunk_out_kernel instead of
    producing the output here, which keeps only the two state dots on the sequential path. The state
    update H <- exp(gc_last) H + k_n^T diag(exp(gc_last - gc)) v_new puts the decay and k's norm on
    the [BT, BV] tile of v_new, so the raw k tile goes to the dot as loaded.

    PREFETCH: the next chunk's U tile, gc and k norms are loaded into registers while this chunk
    computes. Triton's pipeliner issues a stage's copies after the step's last dot, so with two
    stages every chunk waited a full load latency; the read-ahead keeps these small tiles out of the
    pipeline buffers, which leaves room for three stages of W and k^T."""
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
    nxt = _scan_small(u_ptr, gc_ptr, rk_ptr, bos, 0, L, o_t, o_v, m_v, hv, HV, stride_ut, stride_uh, BT)
    for c0 in range(0, L, BT):
        rows, m_t = _scan_rows(c0, bos, L, o_t)
        b_kt = _load_kt(k_ptr, rows, m_t, hk, stride_qt, stride_qh, o_k, DK)
        b_w = tl.load(w_ptr + rows[:, None] * stride_wt + hv * stride_wh + o_k[None, :], mask=m_t[:, None], other=0.)
        if PREFETCH:  # the next chunk's small reads fly while this one computes (masked off past the end)
            b_u, b_gc, g_last, b_rk = nxt
            nxt = _scan_small(u_ptr, gc_ptr, rk_ptr, bos, c0 + BT, L, o_t, o_v, m_v, hv, HV, stride_ut, stride_uh, BT)
        else:
            b_u, b_gc, g_last, b_rk = _scan_small(u_ptr, gc_ptr, rk_ptr, bos, c0, L, o_t, o_v, m_v, hv, HV, stride_ut,
                                                  stride_uh, BT)
        p_u = u_ptr + rows[:, None] * stride_ut + hv * stride_uh + o_v[None, :]
        m_u = m_t[:, None] & m_v[None, :]
        b_hd = b_h.to(dt)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_hd, input_precision="ieee")
        b_vnd = b_vn.to(dt)
        if SPLIT_O:
            p_h = h_ptr + (vt0 + c0 // BT) * stride_hn + hv * stride_hh + o_k[:, None] * stride_hk + o_v[None, :]
            tl.store(p_h, b_hd, mask=m_v[None, :])
            tl.store(p_u, b_vnd, mask=m_u)
        else:
            b_q = tl.load(q_ptr + rows[:, None] * stride_qt + hk * stride_qh + o_k[None, :],
                          mask=m_t[:, None] & (o_k[None, :] < DK), other=0.)
            b_o = _chunk_out(b_q, b_kt, b_gc, b_rk, b_hd, b_vnd, causal, scale)
            tl.store(o_ptr + rows[:, None] * stride_ot + hv * stride_oh + o_v[None, :],
                     b_o.to(o_ptr.dtype.element_ty), mask=m_u)
        b_vs = (b_vn * (b_rk * tl.exp(g_last - b_gc))[:, None]).to(dt)
        b_h = b_h * tl.exp(g_last) + tl.dot(b_kt, b_vs, input_precision="ieee")
    store_state(st_ptr, sc_ptr, b_h, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs,
                stride_ch, INT16)


@jit_per_step("B")
def gdn_chunk_out_kernel(
    q_ptr, k_ptr, u_ptr, gc_ptr, rk_ptr, h_ptr, o_ptr, cu_ptr, B, scale, DK, DV, HV,
    stride_qt, stride_qh, stride_ut, stride_uh, stride_ot, stride_oh, stride_hn, stride_hh, stride_hk,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):
    """Outputs of every (chunk, value head, BV columns) in parallel from the scan's chunk-start
    states and v_new."""
    # column tiles fastest: those of one chunk run side by side and share its q and k tiles in L2
    tile = tl.program_id(1)
    hv = tl.program_id(2).to(tl.int64)
    o_v = tl.program_id(0) * BV + tl.arange(0, BV)
    bos, L, c0 = _chunk_of_tile(cu_ptr, tile, B, BT)
    if c0 >= L:
        return
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    m_v = o_v < DV
    hk = hv // REP
    # 64-bit arithmetic once per tile (scalar bases); per-element offsets stay 32-bit
    row0 = bos + c0
    m_t = o_t < L - c0
    m_k = o_k < DK
    p_q = q_ptr + row0 * stride_qt + hk * stride_qh
    b_q = tl.load(p_q + o_t[:, None] * stride_qt + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
    b_kt = _load_kt(k_ptr + row0 * stride_qt, o_t, m_t, hk, stride_qt, stride_qh, o_k, DK)
    p_g = row0 * HV + hv
    g_last = tl.load(gc_ptr + (bos + tl.minimum(c0 + BT, L) - 1) * HV + hv)
    b_gc = tl.where(m_t, tl.load(gc_ptr + p_g + o_t * HV, mask=m_t, other=0.), g_last)
    b_rk = tl.load(rk_ptr + p_g + o_t * HV, mask=m_t, other=0.)
    b_hd = tl.load(h_ptr + tile.to(tl.int64) * stride_hn + hv * stride_hh + o_k[:, None] * stride_hk + o_v[None, :],
                   mask=m_v[None, :], other=0.)
    m_u = m_t[:, None] & m_v[None, :]
    off_u = o_t[:, None] * stride_ut + o_v[None, :]
    b_vnd = tl.load(u_ptr + row0 * stride_ut + hv * stride_uh + off_u, mask=m_u, other=0.)
    b_o = _chunk_out(b_q, b_kt, b_gc, b_rk, b_hd, b_vnd, o_t[:, None] >= o_t[None, :], scale)
    tl.store(o_ptr + row0 * stride_ot + hv * stride_oh + o_t[:, None] * stride_ot + o_v[None, :],
             b_o.to(o_ptr.dtype.element_ty), mask=m_u)


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
    n_tiles = t // bt + n_seq
    split_o = cfg.get("split_o", not interpreting(q.device) or t > 2 * bt)
    if split_o and n_tiles > 65535:  # the output kernel's grid axis (checked before any state is touched)
        raise ValueError(f"gdn_chunked: {t} tokens in {n_seq} sequences make {n_tiles} chunks of {bt} (at most "
                         "65535 a call); split the batch")
    # the prep settings' defaults live in configs (chunk_prep_split / chunk_prep); config overrides them
    if cfg.get("prep", "split") == "split":
        keys = ("solve_warps", "solve_bk", "wy_warps", "wy_bv", "solve_precision", "solve_stages")
        w, u, gc, rk = chunk_prep_split(k, v, a, b, A_log, dt_bias, cu_seqlens, hv,
                                        **{key: cfg[key] for key in keys if key in cfg})
    else:
        w, u, gc, rk = chunk_prep(k, v, a, b, A_log, dt_bias, cu_seqlens, hv,
                                  **({"warps": cfg["prep_warps"]} if "prep_warps" in cfg else {}))
    bv = cfg.get("bv") or scan_bv(q.device, dv)
    int16 = state.dtype == torch.int16
    sc = state_scale if int16 else state
    h_all = torch.empty((n_tiles, hv, bk, bvf), dtype=dt, device=q.device) if split_o else w
    gdn_chunk_scan_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        q, k, w, u, gc, rk, out, h_all, state, sc, cu_seqlens, state_slots, has_initial_state, scale, dk, dv, hv,
        q.stride(0), q.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), out.stride(0), out.stride(1),
        h_all.stride(0), h_all.stride(1), h_all.stride(2) if split_o else 0,
        state.stride(0), state.stride(1), state.stride(2), sc.stride(0) if int16 else 0, sc.stride(1) if int16 else 0,
        REP=hv // hk, BK=bk, BV=bv, BT=bt, INT16=int16, SPLIT_O=split_o, PREFETCH=cfg.get("scan_prefetch", SCAN_PREFETCH),
        num_warps=cfg.get("scan_warps", scan_warps(q.device, bv)), num_stages=cfg.get("scan_stages", SCAN_STAGES))
    if split_o:
        bvo = cfg.get("out_bv", out_bv(bvf))
        gdn_chunk_out_kernel[(triton.cdiv(dv, bvo), n_tiles, hv)](
            q, k, u, gc, rk, h_all, out, cu_seqlens, n_seq, scale, dk, dv, hv, q.stride(0), q.stride(1), u.stride(0),
            u.stride(1), out.stride(0), out.stride(1), h_all.stride(0), h_all.stride(1), h_all.stride(2),
            REP=hv // hk, BK=bk, BV=bvo, BT=bt, num_warps=cfg.get("out_warps", OUT_WARPS), num_stages=1,
            **({} if interpreting(q.device) else dict(maxnreg=cfg.get("out_maxnreg", OUT_MAXNREG))))
    return out
