"""Triton Gated DeltaNet, token by token: decode steps and the k+1-position verification step
(state after every position into intermediate_states). Also the shared pieces of the chunked
kernels: fused gating and the state-slot load/store for fp32, fp16 and int16 (codes times one
scale per (head, column), recomputed on every store).

Per token, with q, k l2-normalised (eps 1e-6) and q scaled:
    S *= exp(g);  S += k (beta (v - S^T k))^T;  o = S^T q
with g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b). A program owns one
(sequence, value head, BV columns) tile of the state, all dk rows in registers (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.gated_delta_rule.configs import recurrent_tile
from qv.kernels.triton_utils import next_pow2


@triton.jit
def gdn_gate(a, b, neg_A, dt_bias):
    """g (log decay, fp32) and beta for raw projections a, b (fp32)."""
    x = a + dt_bias
    e = tl.exp(tl.minimum(x, 20.))
    u = 1. + e
    # log1p(e) without libdevice: log(u) * e / (u - 1) is exact to rounding where u != 1
    sp = tl.where(x > 20., x, tl.where(u == 1., e, tl.log(u) * (e / (u - 1.))))
    return neg_A * sp, tl.sigmoid(b)


@triton.jit
def l2norm_rows(x):
    """Rows of x [N, D] (fp32) divided by sqrt(sum x^2 + 1e-6)."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def load_state(st_ptr, sc_ptr, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs, stride_ch,
               INT16: tl.constexpr):
    m = (o_k[:, None] < DK) & (o_v[None, :] < DV)
    b_h = tl.load(st_ptr + slot * stride_ss + hv * stride_sh + o_k[:, None] * stride_sk + o_v[None, :], mask=m,
                  other=0.).to(tl.float32)
    if INT16:
        b_h *= tl.load(sc_ptr + slot * stride_cs + hv * stride_ch + o_v, mask=o_v < DV, other=0.)[None, :]
    return b_h


@triton.jit
def store_state(st_ptr, sc_ptr, b_h, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs,
                stride_ch, INT16: tl.constexpr):
    m = (o_k[:, None] < DK) & (o_v[None, :] < DV)
    p_h = st_ptr + slot * stride_ss + hv * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    if INT16:  # rows beyond DK hold zeros, so the column amax is over the real rows only
        b_amax = tl.maximum(tl.max(tl.abs(b_h), axis=0), 1e-30)
        b_sc = tl.math.div_rn(b_amax, tl.full(b_amax.shape, 32767., tl.float32))
        b_c = tl.math.div_rn(b_h, b_sc[None, :])
        # +- 1.5 * 2**23 rounds half-to-even like torch.round (libdevice.rint is missing in the interpreter)
        b_c = tl.minimum(tl.maximum((b_c + 12582912.0) - 12582912.0, -32767.), 32767.)
        tl.store(p_h, b_c.to(tl.int16), mask=m)
        tl.store(sc_ptr + slot * stride_cs + hv * stride_ch + o_v, b_sc, mask=o_v < DV)
    else:
        tl.store(p_h, b_h.to(st_ptr.dtype.element_ty), mask=m)


@triton.jit
def gdn_token(b_h, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row, live, hk, hv, o_k, o_v, DK, DV, neg_A, dt_bias, scale,
              stride_qt, stride_qh, stride_vt, stride_vh, stride_at, stride_bt):
    """One token at `row` applied to the state tile b_h [BK, BV] (none where `live` is false: nothing is
    loaded and b_h comes back unchanged); returns the new tile and the output columns."""
    m_k, m_v = o_k < tl.where(live, DK, 0), o_v < tl.where(live, DV, 0)  # none where there is no token
    b_q = tl.load(q_ptr + row * stride_qt + hk * stride_qh + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(k_ptr + row * stride_qt + hk * stride_qh + o_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(v_ptr + row * stride_vt + hv * stride_vh + o_v, mask=m_v, other=0.).to(tl.float32)
    g, beta = gdn_gate(tl.load(a_ptr + row * stride_at + hv, mask=live, other=0.).to(tl.float32),
                       tl.load(b_ptr + row * stride_bt + hv, mask=live, other=0.).to(tl.float32), neg_A, dt_bias)
    # no token: decay 1 and beta 0 give b_h back (finite values bit for bit, -0 as +0), where a second
    # copy of it to select would cost registers
    g, beta = tl.where(live, g, 0.), tl.where(live, beta, 0.)
    b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_h *= tl.exp(g)
    b_d = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * beta
    b_h += b_k[:, None] * b_d[None, :]
    return b_h, tl.sum(b_h * b_q[:, None], axis=0)


@triton.jit
def gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, o_ptr, st_ptr, sc_ptr, inter_ptr,
    cu_ptr, slot_ptr, init_ptr, scale, DK, DV,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk, stride_cs, stride_ch, stride_ib, stride_it, stride_ih, stride_ik,
    REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, INT16: tl.constexpr, INTER: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
):
    i_b = tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    o_v = tl.program_id(2) * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_k, m_v = o_k < DK, o_v < DV
    hk = hv // REP
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    L = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    init = tl.load(init_ptr + i_b) != 0
    neg_A = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + hv).to(tl.float32)
    if ONE_TOKEN:
        # decode (at most one token a sequence): the state (by its slot) and the token (by its row) load
        # together, one dependent load deep; the loop below loads the token only after the state
        b_h = load_state(st_ptr, sc_ptr, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs,
                         stride_ch, INT16)
        b_h = tl.where(init, b_h, 0.)  # a slot without a state may hold anything (NaN included)
        live = L > 0
        b_h, b_o = gdn_token(b_h, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos, live, hk, hv, o_k, o_v, DK, DV, neg_A,
                             dt_bias, scale, stride_qt, stride_qh, stride_vt, stride_vh, stride_at, stride_bt)
        tl.store(o_ptr + bos * stride_ot + hv * stride_oh + o_v, b_o.to(o_ptr.dtype.element_ty),
                 mask=o_v < tl.where(live, DV, 0))
    else:
        if init:
            b_h = load_state(st_ptr, sc_ptr, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk,
                             stride_cs, stride_ch, INT16)
        else:
            b_h = tl.zeros([BK, BV], dtype=tl.float32)
        for t in range(0, L):
            row = bos + t
            # (t < L: always true here; the one-token path passes a live flag that can be false)
            b_h, b_o = gdn_token(b_h, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row, t < L, hk, hv, o_k, o_v, DK, DV,
                                 neg_A, dt_bias, scale, stride_qt, stride_qh, stride_vt, stride_vh, stride_at,
                                 stride_bt)
            tl.store(o_ptr + row * stride_ot + hv * stride_oh + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
            if INTER:
                p_i = (inter_ptr + i_b * stride_ib + t * stride_it + hv * stride_ih + o_k[:, None] * stride_ik
                       + o_v[None, :])
                tl.store(p_i, b_h.to(inter_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    store_state(st_ptr, sc_ptr, b_h, slot, hv, o_k, o_v, DK, DV, stride_ss, stride_sh, stride_sk, stride_cs,
                stride_ch, INT16)


def gdn_recurrent(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                  state_scale, intermediate_states, config=None, one_token=False):
    """one_token: no sequence has more than one token (decode; the caller's max_query_len is 1); ignored
    where intermediate_states are asked for."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n_seq = cu_seqlens.shape[0] - 1
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n_seq == 0:
        return out
    cfg = config or {}
    int16 = state.dtype == torch.int16
    bv, warps = recurrent_tile(v.device, n_seq, hv, dk, dv, int16, cfg.get("bv"))
    sc = state_scale if int16 else state
    inter = intermediate_states if intermediate_states is not None else state
    gdn_recurrent_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        q, k, v, a, b, A_log, dt_bias, out, state, sc, inter, cu_seqlens, state_slots, has_initial_state, scale,
        dk, dv, q.stride(0), q.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0), out.stride(0),
        out.stride(1), state.stride(0), state.stride(1), state.stride(2), sc.stride(0) if int16 else 0,
        sc.stride(1) if int16 else 0, inter.stride(0), inter.stride(1), inter.stride(2), inter.stride(3),
        REP=hv // hk, BK=next_pow2(dk), BV=bv, INT16=int16, INTER=intermediate_states is not None,
        ONE_TOKEN=one_token and intermediate_states is None, num_warps=cfg.get("warps") or warps)
    return out
