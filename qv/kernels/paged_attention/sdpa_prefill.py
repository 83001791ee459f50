"""Prompt chunks over the paged cache through cuDNN's fused attention (sm_90).

A long chunk's keys and values are dequantized, page range by page range, into a 16-bit workspace of
contiguous rows (gather_kv_kernel: one pass, int8 codes times their per-key scale), and each piece is handed
to cuDNN's flash attention through torch (`_scaled_dot_product_cudnn_attention`, which also returns the
log-sum-exp of every query row): the prefix's pieces without a mask, the chunk's own keys causally. The
pieces are merged by their log-sum-exps (merge_kernel), so the result is the attention over all keys: exact
up to the cache's own int8 rounding and the fp16 workspace. Shapes are kept to a few (chunk_attention), as
cuDNN plans each new one. The workspace is counted in the memory plan (workspace_bytes).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import jit_per_step, next_pow2

# keys the prefix pieces come in multiples of, and rows the calls are padded to: few shapes, few cuDNN plans
KEY_GRAIN = 1024
ROW_BUCKET = 256


@jit_per_step("T0", "T1")
def gather_kv_kernel(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, wk_ptr, wv_ptr, T0, T1, BS,
                     stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_wt, stride_wh,
                     D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """Keys and values of positions T0..T1-1 of one sequence (block table row bt_ptr), KV head program_id(1),
    into rows 0.. of the workspaces."""
    t = T0 + tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_t = t < T1
    m = m_t[:, None] & (o_d[None, :] < D)
    page = tl.load(bt_ptr + t // BS, mask=m_t, other=0).to(tl.int64)
    off = (t % BS).to(tl.int64)
    src = (page * stride_kb + off * stride_ks + h * stride_kh)[:, None] + o_d[None, :]
    dst = ((t - T0).to(tl.int64) * stride_wt + h * stride_wh)[:, None] + o_d[None, :]
    b_k = tl.load(k_ptr + src, mask=m, other=0.).to(tl.float32)
    b_v = tl.load(v_ptr + src, mask=m, other=0.).to(tl.float32)
    if QUANT:
        s_off = page * stride_sb + off * stride_ss + h
        b_k *= tl.load(ks_ptr + s_off, mask=m_t, other=0.).to(tl.float32)[:, None]
        b_v *= tl.load(vs_ptr + s_off, mask=m_t, other=0.).to(tl.float32)[:, None]
    tl.store(wk_ptr + dst, b_k.to(wk_ptr.dtype.element_ty), mask=m)
    tl.store(wv_ptr + dst, b_v.to(wv_ptr.dtype.element_ty), mask=m)


@jit_per_step("L")
def merge_kernel(a_ptr, la_ptr, b_ptr, lb_ptr, o_ptr, lo_ptr, L, stride_at, stride_ah, stride_bt, stride_bh,
                 stride_ot, stride_oh, stride_lh, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                 STORE_LSE: tl.constexpr):
    """o = (a e^la + b e^lb) / (e^la + e^lb) for L rows of one head (program_id(1)); lo = log(e^la + e^lb)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_t = t < L
    m = m_t[:, None] & (o_d[None, :] < D)
    la = tl.load(la_ptr + h * stride_lh + t, mask=m_t, other=0.)
    lb = tl.load(lb_ptr + h * stride_lh + t, mask=m_t, other=0.)
    mx = tl.maximum(la, lb)
    wa, wb = tl.exp(la - mx), tl.exp(lb - mx)
    tt = t.to(tl.int64)
    b_a = tl.load(a_ptr + (tt * stride_at + h * stride_ah)[:, None] + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_b = tl.load(b_ptr + (tt * stride_bt + h * stride_bh)[:, None] + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_o = (b_a * wa[:, None] + b_b * wb[:, None]) / (wa + wb)[:, None]
    tl.store(o_ptr + (tt * stride_ot + h * stride_oh)[:, None] + o_d[None, :], b_o.to(o_ptr.dtype.element_ty),
             mask=m)
    if STORE_LSE:
        tl.store(lo_ptr + h * stride_lh + t, mx + tl.log(wa + wb), mask=m_t)


def cudnn_attention(q, k, v, scale, causal):
    """q [L, Hq, D], k/v [S, Hkv, D] (bf16, rows may be strided) -> (out [L, Hq, D], lse [Hq, L] fp32, natural
    log). cuDNN takes fewer KV heads than query heads as they are (grouped-query attention)."""
    as_bhsd = lambda x: x.permute(1, 0, 2).unsqueeze(0)  # noqa: E731  [1, H, S, D] views of [S, H, D] rows
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(as_bhsd(q), as_bhsd(k), as_bhsd(v), None, True, 0.0,
                                                             causal, False, scale=scale)
    return res[0][0].permute(1, 0, 2), res[1].reshape(q.shape[1], q.shape[0])


def merge(a, la, b, lb, out, want_lse):
    """Merge two attention results over disjoint key sets by their log-sum-exps (see merge_kernel)."""
    L, hq, d = out.shape
    lo = torch.empty_like(la) if want_lse else la
    block_t = 32
    merge_kernel[(triton.cdiv(L, block_t), hq)](
        a, la, b, lb, out, lo, L, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        la.stride(0), D=d, BLOCK_T=block_t, BLOCK_D=next_pow2(d), STORE_LSE=want_lse)
    return lo


def gather_kv(k_cache, v_cache, k_scale, v_scale, table, t0, t1, wk, wv):
    """Positions t0..t1-1 of one sequence (its block table row `table`) into wk/wv[: t1 - t0] (bf16)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    quant = k_cache.dtype == torch.int8
    block_t = 32
    gather_kv_kernel[(triton.cdiv(t1 - t0, block_t), hkv)](
        k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, table, wk, wv, t0, t1,
        k_cache.shape[1], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0, wk.stride(0), wk.stride(1),
        D=d, BLOCK_T=block_t, BLOCK_D=next_pow2(d), QUANT=quant)


def chunk_attention(q, k_cache, v_cache, k_scale, v_scale, table, kv_len, scale, out, piece_tokens, k_new=None,
                    v_new=None, grain=KEY_GRAIN, bucket=ROW_BUCKET):
    """out [L, Hq, D] = causal attention of one sequence's L chunk rows q (positions kv_len - L ..) over its
    kv_len cached keys, through cuDNN (fp16 for an int8 cache, else the cache's dtype).

    cuDNN builds an execution plan for every new shape (costing more than a short chunk's attention) and torch keeps
    each for the process's life, so the calls take few shapes: the prefix's first keys in whole `grain`s go without
    a mask in pieces of piece_tokens (a multiple of grain) or a power of two grains under it (key_pieces); the last
    e = prefix % grain prefix keys and the chunk's own keys go in one causal call, square, behind e discarded query
    rows (row i sees keys up to i, so the chunk's rows see those e keys and their own causally), padded to a
    multiple of `bucket` rows with zero queries and zero keys at the end (no real row reaches them). Every call
    has that padded row count. k_new/v_new [L, Hkv, D]: the chunk's own keys as written, used as they are where
    the cache holds them unchanged (a 16-bit cache)."""
    L = q.shape[0]
    hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    prefix = kv_len - L
    e = prefix % grain
    whole = prefix - e
    rows = -(-(e + L) // bucket) * bucket
    piece = min(piece_tokens // grain * grain, whole)  # the workspace's rows for a piece
    # int8 codes times their scales keep fp16's 10 mantissa bits (as the Triton kernels' fp16 dots do)
    dt = torch.float16 if k_cache.dtype == torch.int8 else k_cache.dtype
    ws = torch.empty((2, max(piece, rows), hkv, d), dtype=dt, device=q.device)
    qp = torch.zeros((rows, hq, d), dtype=dt, device=q.device)
    qp[e:e + L] = q
    # the causal span: positions whole .. kv_len - 1, then zero rows
    if k_new is not None and k_new.dtype == k_cache.dtype == dt:
        gather_kv(k_cache, v_cache, k_scale, v_scale, table, whole, prefix, ws[0], ws[1])
        ws[0, e:e + L], ws[1, e:e + L] = k_new, v_new
    else:
        gather_kv(k_cache, v_cache, k_scale, v_scale, table, whole, kv_len, ws[0], ws[1])
    ws[:, e + L:rows] = 0
    acc, lse = cudnn_attention(qp, ws[0, :rows], ws[1, :rows], scale, True)
    spans = key_pieces(whole, piece_tokens, grain)
    if not spans:
        out.copy_(acc[e:e + L])
        return out
    if len(spans) > 1:  # a running result that is merged again stays in fp32
        acc = acc.float()
    for i, (a, b) in enumerate(spans):
        gather_kv(k_cache, v_cache, k_scale, v_scale, table, a, b, ws[0], ws[1])
        o, lse_p = cudnn_attention(qp, ws[0, : b - a], ws[1, : b - a], scale, False)
        if i < len(spans) - 1:
            lse = merge(acc, lse, o, lse_p, acc, True)
        else:
            merge(acc[e:e + L], lse[:, e:e + L], o[e:e + L], lse_p[:, e:e + L], out, False)
    return out


def key_pieces(whole: int, piece_tokens: int, grain: int = KEY_GRAIN) -> list[tuple[int, int]]:
    """The spans [a, b) the first `whole` prefix keys (a multiple of grain) are attended in: pieces of
    piece_tokens // grain grains while that many are left, then the binary digits of the rest, largest first.
    Any prefix takes piece sizes from one short list (key_piece_sizes), so cuDNN plans few shapes, at most
    log2(piece_tokens // grain) more calls than pieces of any size would take."""
    cap = max(1, piece_tokens // grain)
    spans, a, left = [], 0, whole // grain
    while left:
        n = cap if left >= cap else 1 << (left.bit_length() - 1)
        spans.append((a, a + n * grain))
        a, left = a + n * grain, left - n
    return spans


def key_piece_sizes(piece_tokens: int, grain: int = KEY_GRAIN) -> list[int]:
    """Every key count a piece of key_pieces can have."""
    cap = max(1, piece_tokens // grain)
    return [n * grain for n in sorted({cap} | {1 << i for i in range(cap.bit_length()) if 1 << i < cap})]


def row_counts(chunk_rows: int, min_rows: int, grain: int = KEY_GRAIN, bucket: int = ROW_BUCKET) -> list[int]:
    """Every padded row count chunk_attention gives a chunk of min_rows .. chunk_rows rows: the chunk behind up
    to grain - 1 prefix rows, to a multiple of bucket."""
    lo, hi = -(-min_rows // bucket), -(-(chunk_rows + grain - 1) // bucket)
    return [n * bucket for n in range(max(1, lo), hi + 1)]


def warm_plans(device, dtype, hq: int, hkv: int, d: int, chunk_rows: int, piece_tokens: int, kv_int8: bool,
               min_rows: int, grain: int = KEY_GRAIN, bucket: int = ROW_BUCKET) -> int:
    """Has cuDNN plan every shape a chunk of min_rows .. chunk_rows rows can meet (each padded row count's causal
    call, and its call with each piece size of key_pieces), so that no request pays for a plan and the server's
    memory stops growing once it has started (each plan holds ~1.4 MiB of host memory for the process's life:
    bench/cudnn_plans.py). Returns how many shapes were planned."""
    dt = torch.float16 if kv_int8 else dtype
    counts, sizes = row_counts(chunk_rows, min_rows, grain, bucket), key_piece_sizes(piece_tokens, grain)
    q = torch.zeros((counts[-1], hq, d), dtype=dt, device=device)
    kv = torch.zeros((max(counts[-1], sizes[-1]), hkv, d), dtype=dt, device=device)
    for rows in counts:
        cudnn_attention(q[:rows], kv[:rows], kv[:rows], d ** -0.5, True)
        for keys in sizes:
            cudnn_attention(q[:rows], kv[:keys], kv[:keys], d ** -0.5, False)
    return len(counts) * (1 + len(sizes))


def workspace_bytes(piece_tokens: int, chunk_rows: int, hq: int, hkv: int, d: int) -> int:
    """Device memory the cuDNN path holds while it runs: the 16-bit K/V workspace of one piece or of the
    padded causal span, whichever is larger, and the padded queries."""
    rows = -(-(KEY_GRAIN + chunk_rows) // ROW_BUCKET) * ROW_BUCKET
    return (2 * max(piece_tokens, rows) * hkv + rows * hq) * d * 2


_CUDNN_OK: dict[int, bool] = {}


def available(device) -> bool:
    """Whether torch's cuDNN attention runs here (sm_90 where it was measured; a tiny call, once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CUDNN_OK:
        ok = torch.cuda.get_device_capability(device)[0] == 9 and torch.backends.cudnn.is_available()
        if ok:
            try:
                x = torch.randn(16, 2, 64, device=device, dtype=torch.bfloat16)
                cudnn_attention(x, x[:, :1], x[:, :1], 1 / math.sqrt(64), True)
            except RuntimeError:
                ok = False
        _CUDNN_OK[idx] = ok
    return _CUDNN_OK[idx]
