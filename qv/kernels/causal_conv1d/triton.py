"""Triton causal depthwise conv1d with per-slot state (Gated DeltaNet input mixing), prefill and
single-step alike: y[t] = act(sum_j w[:, j] * xx[t + j]) over xx = state ++ x_seq, and the slot's
state becomes the last W-1 rows of xx."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import interpreting, next_pow2


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, st_ptr, y_ptr, cu_ptr, slot_ptr, init_ptr, C,
                         stride_xt, stride_yt, stride_wc, stride_ws, stride_ss, stride_sw,
                         W: tl.constexpr, ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    i_c = tl.program_id(1)
    i_t = tl.program_id(2)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    L = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    t0 = i_t * BLOCK_T
    if t0 >= L and i_t > 0:
        return
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # first state row a tap may read: -(W-1) with an initial state, 0 (none: zeros) without
    st_lo = (1 - W) * tl.load(init_ptr + b).to(tl.int32)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    o_t = t0 + tl.arange(0, BLOCK_T)
    m_t = o_t < L
    p_st = st_ptr + slot * stride_ss + o_c[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        src = o_t + (j - (W - 1))  # row of x_seq feeding tap j; negative rows come from the state
        m_x = (m_t & (src >= 0))[:, None] & m_c[None, :]
        b_x = tl.load(x_ptr + (bos + src)[:, None] * stride_xt + o_c[None, :], mask=m_x, other=0.).to(tl.float32)
        m_s = (m_t & (src < 0) & (src >= st_lo))[:, None] & m_c[None, :]
        b_x += tl.load(p_st + (src + W - 1)[:, None] * stride_sw, mask=m_s, other=0.).to(tl.float32)
        b_w = tl.load(w_ptr + o_c * stride_wc + j * stride_ws, mask=m_c, other=0.).to(tl.float32)
        acc += b_x * b_w[None, :]
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (bos + o_t)[:, None] * stride_yt + o_c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])
    if i_t == 0:  # the only program that reads this slot's old state also writes the new one
        o_r = tl.arange(0, BLOCK_W)
        src_r = L + o_r - (W - 1)
        m_r = o_r < W - 1
        m_rx = (m_r & (src_r >= 0))[:, None] & m_c[None, :]
        b_new = tl.load(x_ptr + (bos + src_r)[:, None] * stride_xt + o_c[None, :], mask=m_rx, other=0.)
        m_rs = (m_r & (src_r < 0) & (src_r >= st_lo))[:, None] & m_c[None, :]
        b_new = b_new.to(tl.float32) + tl.load(p_st + (src_r + W - 1)[:, None] * stride_sw, mask=m_rs,
                                               other=0.).to(tl.float32)
        tl.debug_barrier()  # every thread has read the old state before any thread overwrites it
        tl.store(p_st + o_r[:, None] * stride_sw, b_new.to(st_ptr.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


def causal_conv1d(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state, activation=True,
                  max_query_len=None):
    t, c = x.shape
    width = weight.shape[1]
    n_seq = cu_seqlens.shape[0] - 1
    y = torch.empty_like(x)
    if n_seq == 0:
        return y
    if max_query_len is None:
        max_query_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # one sync; callers pass it
    if x.stride(-1) != 1:
        x = x.contiguous()
    if conv_state.stride(-1) != 1:
        raise ValueError("causal_conv1d: conv_state needs a unit inner stride")
    block_t = next_pow2(min(max_query_len, 16 if interpreting(x.device) else 64), width - 1)
    block_c = min(next_pow2(c), 32 if interpreting(x.device) else 256)
    grid = (n_seq, triton.cdiv(c, block_c), max(1, triton.cdiv(max_query_len, block_t)))
    causal_conv1d_kernel[grid](x, weight, conv_state, y, cu_seqlens, state_slots, has_initial_state, c,
                               x.stride(0), y.stride(0), weight.stride(0), weight.stride(1), conv_state.stride(0),
                               conv_state.stride(1), W=width, ACT=activation, BLOCK_T=block_t, BLOCK_C=block_c,
                               BLOCK_W=next_pow2(width - 1))
    return y
