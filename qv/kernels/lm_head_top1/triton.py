"""Triton lm_head_top1 in two passes (shapes in __init__.py).

Pass 1 (rank_tiles_kernel) streams the ranking copy: program (row block, vocabulary tile) scores BLOCK_V
vocabulary rows for BLOCK_R rows of x and keeps each row's CAND best (value, index) of its tile. With a handful
of rows the weight read is the cost, so it is a GEMV: broadcast multiply-and-sum in fp32 registers, one
cross-lane sum at the end, no tl.dot (the same source runs on sm_70). The row-block axis varies fastest,
so the programs sharing a tile run together and read it from HBM once.
Pass 2 takes each row's TOPK best candidates overall (torch.topk), re-scores them exactly in fp32 against
the 16-bit weight rows, or the int8 head's codes and row scales (rescore_kernel), and picks the best, ties to
the lowest index (select_kernel).
Without a ranking copy pass 1 runs on the weight itself (dense_tiles_kernel): its scores are exact and the
tile bests go straight to select_kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.lm_head_top1 import configs
from qv.kernels.triton_utils import next_pow2

INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _field_bit(J: tl.constexpr, BITS: tl.constexpr):
    """The mantissa bit where _code_f32 puts code J's field: int4 codes pair up on four shifts of the word
    (by 12, 8, -4, -12 bits; codes 3 and 4 need none), landing at bit 12 or 16; int8 codes at the top."""
    return (12 if J % 3 == 0 else 16) if BITS == 4 else 23 - BITS


@triton.jit
def _code_f32(b_q, one_bits, J: tl.constexpr, BITS: tl.constexpr):
    """Code J of each packed word as the fp32 2**(23 - BITS - p) + u / 2**BITS (u the stored unsigned code,
    p = _field_bit): its bits masked into the mantissa of a power of two, so no int->float conversion (a slow
    unit) is needed. one_bits (of 1.0, 0x3F800000) comes in at run time: with the mask as the only
    immediate, ptxas fuses the and and the or into one LOP3 (two immediates do not fit one instruction)."""
    P = _field_bit(J, BITS)
    if P >= BITS * J:
        b_b = b_q << (P - BITS * J)
    else:  # an arithmetic shift: the sign bits it brings in land above the mask
        b_b = b_q >> (BITS * J - P)
    return ((b_b & (((1 << BITS) - 1) << P)) | (one_bits + ((23 - BITS - P) << 23))).to(tl.float32, bitcast=True)


@triton.jit
def _keep_best(score, o_v, o_r, m_r, V, cv_ptr, ci_ptr, stride_c, col0, CAND: tl.constexpr):
    """Store each row's CAND best (value, index) of the tile's scores [BLOCK_R, BLOCK_V], best first, equal
    values to the lower index. Indices stay valid whatever the scores (NaN, or a tile with fewer than CAND
    rows): pass 2 reads the weight rows they name."""
    for c in tl.static_range(CAND):
        b_m = tl.max(score, axis=1)
        b_i = tl.min(tl.where(score == b_m[:, None], o_v[None, :], INT32_MAX), axis=1)
        b_i = tl.minimum(b_i, V - 1)
        tl.store(cv_ptr + o_r * stride_c + col0 + c, b_m, mask=m_r)
        tl.store(ci_ptr + o_r * stride_c + col0 + c, b_i, mask=m_r)
        score = tl.where(o_v[None, :] == b_i[:, None], float("-inf"), score)


@triton.jit
def rank_tiles_kernel(x_ptr, q_ptr, s_ptr, cv_ptr, ci_ptr, R, V, H, WORDS, stride_x, stride_q, stride_c, one_bits,
                      BITS: tl.constexpr, CAND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_W: tl.constexpr, EVEN: tl.constexpr):
    """Approximate scores s_v * sum_h x_h c_vh. With f = 2**(23 - BITS - p) + u / 2**BITS (_code_f32) and
    c = u - 2**(BITS-1), sum x c = 2**BITS * (sum x f - sum_h x_h (2**(23 - BITS - p_h) + 1/2)): the loop
    needs one FMA a code, and the offsets' sum once a row (summed first, apart: inside the loop it would
    cost an add a code for every vocabulary row a thread holds). EVEN: R, V and the words divide the tiles
    and H fills the words, so the loop loads without masks."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    o_w = tl.arange(0, BLOCK_W)
    m_r = o_r < R
    m_v = o_v < V
    o_k = tl.arange(0, 4 * BLOCK_W)
    b_off = tl.zeros([BLOCK_R, 4 * BLOCK_W], dtype=tl.float32)
    for j in tl.static_range(32 // BITS):
        for k0 in range(0, WORDS, 4 * BLOCK_W):
            m_k = (k0 + o_k < WORDS) & (j * WORDS + k0 + o_k < H)
            b_x = tl.load(x_ptr + o_r[:, None] * stride_x + (j * WORDS + k0) + o_k[None, :],
                          mask=m_r[:, None] & m_k[None, :], other=0.).to(tl.float32)
            b_off += b_x * ((1 << (23 - BITS - _field_bit(j, BITS))) + 0.5)
    p_q = q_ptr + o_v.to(tl.int64)[None, :, None] * stride_q + o_w[None, None, :]  # [1, BLOCK_V, BLOCK_W]
    p_x = x_ptr + o_r[:, None, None] * stride_x + o_w[None, None, :]  # [BLOCK_R, 1, BLOCK_W]
    acc = tl.zeros([BLOCK_R, BLOCK_V, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, WORDS, BLOCK_W):
        m_w = w0 + o_w < WORDS
        if EVEN:
            b_q = tl.load(p_q + w0)
        else:
            b_q = tl.load(p_q + w0, mask=m_v[None, :, None] & m_w[None, None, :], other=0)
        for j in tl.static_range(32 // BITS):
            if EVEN:
                b_x = tl.load(p_x + (j * WORDS + w0))
            else:  # the padding past H holds code 0: x reads as 0 there
                m_h = m_w & (j * WORDS + w0 + o_w < H)
                b_x = tl.load(p_x + (j * WORDS + w0), mask=m_r[:, None, None] & m_h[None, None, :], other=0.)
            acc += b_x.to(tl.float32) * _code_f32(b_q, one_bits, j, BITS)
    b_s = tl.load(s_ptr + o_v, mask=m_v, other=0.)
    score = b_s[None, :] * ((1 << BITS) * (tl.sum(acc, axis=2) - tl.sum(b_off, axis=1)[:, None]))
    score = tl.where(m_v[None, :], score, float("-inf"))
    _keep_best(score, o_v, o_r, m_r, V, cv_ptr, ci_ptr, stride_c, tl.program_id(1) * CAND, CAND)


@triton.jit
def dense_tiles_kernel(x_ptr, w_ptr, cv_ptr, ci_ptr, R, V, H, stride_x, stride_w, stride_c, CAND: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    """Exact fp32 scores of the weight's own rows (BLOCK_W columns a step)."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    o_h = tl.arange(0, BLOCK_W)
    m_r = o_r < R
    m_v = o_v < V
    p_w = w_ptr + o_v.to(tl.int64)[None, :, None] * stride_w + o_h[None, None, :]
    p_x = x_ptr + o_r[:, None, None] * stride_x + o_h[None, None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_V, BLOCK_W], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_W):
        m_h = h0 + o_h < H
        b_w = tl.load(p_w + h0, mask=m_v[None, :, None] & m_h[None, None, :], other=0.).to(tl.float32)
        b_x = tl.load(p_x + h0, mask=m_r[:, None, None] & m_h[None, None, :], other=0.).to(tl.float32)
        acc += b_x * b_w
    score = tl.where(m_v[None, :], tl.sum(acc, axis=2), float("-inf"))
    _keep_best(score, o_v, o_r, m_r, V, cv_ptr, ci_ptr, stride_c, tl.program_id(1) * CAND, CAND)


@triton.jit
def rescore_kernel(x_ptr, w_ptr, s_ptr, ci_ptr, pos_ptr, e_ptr, ei_ptr, H, N, stride_x, stride_wv, stride_wh,
                   stride_ci, stride_p, stride_e, QUANT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (row r, BLOCK_C shortlisted candidates): the exact fp32 scores of the vocabulary rows that
    ci[r, pos[r, :]] names, stored with those indices. Element (v, h) of the weight is at v * stride_wv +
    h * stride_wh: a dense [V, H] weight, or (QUANT) the uint8 codes [H, V] of a row-int8 lm_head, each
    row's score then (sum_h x_h (u_vh - 128)) * scale_v."""
    r = tl.program_id(0)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < N
    b_p = tl.load(pos_ptr + r * stride_p + o_c, mask=m_c, other=0)
    b_i = tl.load(ci_ptr + r * stride_ci + b_p, mask=m_c, other=0)
    o_h = tl.arange(0, BLOCK_H)
    p_w = w_ptr + b_i.to(tl.int64)[:, None] * stride_wv + o_h.to(tl.int64)[None, :] * stride_wh
    acc = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        m_h = h0 + o_h < H
        b_x = tl.load(x_ptr + r * stride_x + h0 + o_h, mask=m_h, other=0.).to(tl.float32)
        if QUANT:  # masked lanes read code 128: they add nothing
            b_w = tl.load(p_w, mask=m_c[:, None] & m_h[None, :], other=128).to(tl.float32) - 128.
        else:
            b_w = tl.load(p_w, mask=m_c[:, None] & m_h[None, :], other=0.).to(tl.float32)
        acc += b_w * b_x[None, :]
        p_w += BLOCK_H * stride_wh
    score = tl.sum(acc, axis=1)
    if QUANT:
        score = score * tl.load(s_ptr + b_i, mask=m_c, other=0.).to(tl.float32)
    tl.store(e_ptr + r * stride_e + o_c, score, mask=m_c)
    tl.store(ei_ptr + r * stride_e + o_c, b_i, mask=m_c)


@triton.jit
def select_kernel(e_ptr, ei_ptr, out_ptr, N, V, stride_e, stride_ei, BLOCK: tl.constexpr):
    """out[r] = the index of row r's best of N (value, index) pairs, equal values to the lower index."""
    r = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], INT32_MAX, tl.int32)
    for n0 in range(0, N, BLOCK):
        m = n0 + o < N
        b_v = tl.load(e_ptr + r * stride_e + n0 + o, mask=m, other=float("-inf"))
        b_i = tl.load(ei_ptr + r * stride_ei + n0 + o, mask=m, other=INT32_MAX)
        c_v = tl.max(b_v, axis=0)
        c_i = tl.min(tl.where(m & (b_v == c_v), b_i, INT32_MAX), axis=0)
        take = (c_v > best_v) | ((c_v == best_v) & (c_i < best_i))
        best_v = tl.where(take, c_v, best_v)
        best_i = tl.where(take, c_i, best_i)
    tl.store(out_ptr + r, tl.minimum(best_i, V - 1).to(tl.int64))  # NaN scores: still a valid index


def tile_candidates(x, weight_or_ranking, config=None):
    """Pass 1: (values [R, tiles * CAND] fp32, indices [R, tiles * CAND] int32), each tile's CAND best by the
    ranking copy's approximate scores (a Top1Ranking) or the exact ones (a dense weight [V, H])."""
    dense = isinstance(weight_or_ranking, torch.Tensor)
    if not dense:  # fp32 with the channel scales in: one launch, and no conversions in the loop
        x = (x * weight_or_ranking.col_scale).contiguous()
    elif x.stride(1) != 1:
        x = x.contiguous()
    rows, vocab = x.shape[0], weight_or_ranking.shape[0] if dense else weight_or_ranking.vocab
    cfg = config or configs.rank_config(x.device, rows, None if dense else weight_or_ranking.bits)
    cand = 1 if dense else configs.CAND  # exact scores need no runner-up
    tiles = triton.cdiv(vocab, cfg["BLOCK_V"])
    cv = torch.empty(rows, tiles * cand, dtype=torch.float32, device=x.device)
    ci = torch.empty(rows, tiles * cand, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(rows, cfg["BLOCK_R"]), tiles)
    blocks = dict(BLOCK_R=cfg["BLOCK_R"], BLOCK_V=cfg["BLOCK_V"], BLOCK_W=cfg["BLOCK_W"], num_warps=cfg["num_warps"])
    if dense:
        dense_tiles_kernel[grid](x, weight_or_ranking, cv, ci, rows, vocab, x.shape[1], x.stride(0),
                                 weight_or_ranking.stride(0), cv.stride(0), CAND=cand, **blocks)
    else:
        rk = weight_or_ranking
        even = (rows % cfg["BLOCK_R"] == 0 and vocab % cfg["BLOCK_V"] == 0 and rk.words % cfg["BLOCK_W"] == 0
                and rk.hidden == rk.words * (32 // rk.bits))
        rank_tiles_kernel[grid](x, rk.codes, rk.scales, cv, ci, rows, vocab, rk.hidden, rk.words, x.stride(0),
                                rk.codes.stride(0), cv.stride(0), 0x3F800000, BITS=rk.bits, CAND=cand, EVEN=even,
                                **blocks)
    return cv, ci


def shortlist(x, ranking, config=None):
    """Pass 1 and the choice of pass 2's candidates: (tile indices ci, positions [R, k] int64 into ci of each
    row's k = TOPK best approximate scores, in no particular order)."""
    cv, ci = tile_candidates(x, ranking, config)
    k = min(configs.TOPK[ranking.bits], cv.shape[1])
    return ci, torch.topk(cv, k, dim=1, sorted=False).indices


def lm_head_top1(x, weight, ranking=None, config=None):
    rows, vocab = x.shape[0], weight.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if ranking is None:
        values, indices = tile_candidates(x, weight, config)
    else:
        ci, pos = shortlist(x, ranking, config)
        n = pos.shape[1]
        values = torch.empty(rows, n, dtype=torch.float32, device=x.device)
        indices = torch.empty(rows, n, dtype=torch.int32, device=x.device)
        cfg = dict(configs.rescore_config(x.device))
        cfg["BLOCK_H"] = min(cfg["BLOCK_H"], next_pow2(x.shape[1]))
        if isinstance(weight, torch.Tensor):
            w, scales, stride_wv, stride_wh, quant = weight, weight, weight.stride(0), weight.stride(1), False
        else:  # row-int8: codes [H, V], one scale a vocabulary row
            w, scales, quant = weight.qweight, weight.scales, True
            stride_wv, stride_wh = weight.qweight.stride(1), weight.qweight.stride(0)
        rescore_kernel[(rows, triton.cdiv(n, cfg["BLOCK_C"]))](
            x, w, scales, ci, pos, values, indices, x.shape[1], n, x.stride(0), stride_wv, stride_wh, ci.stride(0),
            pos.stride(0), values.stride(0), QUANT=quant, **cfg)
    select_kernel[(rows,)](values, indices, out, values.shape[1], vocab, values.stride(0), indices.stride(0),
                           BLOCK=min(1024, next_pow2(values.shape[1])), num_warps=4)
    return out
