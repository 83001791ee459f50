"""Triton attention: one flash-attention kernel serves prefill chunks over the paged cache, decode
and speculative rows (split-K over the context, then a reduce pass) where the decode kernels
(triton_decode.py, cuda_sm90.py) are not chosen, and the vision tower's dense varlen attention
(varlen_attention/triton.py calls `attention` here).

Rows of a program tile are (query token, q head of one KV head's group) pairs: row r is token
r // REP, head kvh * REP + r % REP, so each K/V tile is loaded once for the whole GQA group.
Query i of a sequence with q_len queries and kv_len keys sits at position kv_len - q_len + i and
sees keys 0..position (CAUSAL) or all kv_len keys. Scores use exp2 with log2(e) folded into the
scale; int8 K/V scales (one per key and KV head) multiply score columns and P columns.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from qv.kernels.paged_attention import sdpa_prefill
from qv.kernels.paged_attention.configs import (CUDNN_MIN_ROWS, CUDNN_PIECE_TOKENS, attn_config, decode_config,
                                                decode_cuda_config, decode_kind, prefill_kind)
from qv.kernels.paged_attention.cuda_sm90 import decode_cuda
from qv.kernels.paged_attention.triton_decode import (LOG2E, decode_attention, kv_codes, split_length,
                                                      split_outputs)
from qv.kernels.triton_utils import find_seq, interpreting, jit_per_step, next_pow2, num_sms


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
def _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr,
               stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, BS, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
               QUANT: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr,
               keep_ptr, keep_rows, SEL, SPARSE: tl.constexpr):
    """One BLOCK_N-key tile of online softmax. TMA: k_ptr/v_ptr are tensor descriptors over the
    contiguous rows [T, Hkv * D] (rows past kv_len are masked below; past the tensor, zero-filled).
    SPARSE (with MASK): a key counts only where its row's block is kept (sparse.py: keep_ptr + keep_rows
    [BLOCK_M] is each row's keep row, one byte per SEL-key block)."""
    o_n = start + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < kv_len
    m_kd = m_n[:, None] & (o_d[None, :] < D)
    if TMA:
        row0 = (kv_start + start).to(tl.int32)
        b_k = k_ptr.load([row0, (kvh * D).to(tl.int32)])
    else:
        kv_off, s_off = _kv_offsets(o_n, kv_len, b, kvh, kv_start, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                                    stride_sb, stride_ss, BS, PAGED)
        b_k = kv_codes(tl.load(k_ptr + kv_off[:, None] + o_d[None, :], mask=m_kd, other=0.), b_q.dtype, QUANT)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BM, BN]
    if MASK or QUANT:
        if QUANT:
            b_s = b_s * tl.load(ks_ptr + s_off, mask=m_n, other=0.)[None, :]
        b_s = b_s * qk_scale
        if MASK:
            vis = m_n[None, :]
            if CAUSAL:
                vis = vis & (o_n[None, :] <= qpos[:, None])
            if SPARSE:
                kept = tl.load(keep_ptr + keep_rows[:, None] + (o_n // SEL)[None, :], mask=m_n[None, :], other=0)
                vis = vis & (kept != 0)
            b_s = tl.where(vis, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        # a row may see no key in this tile (split-K over speculative rows): keep exp2 finite
        m_safe = tl.where(m_new == float("-inf"), 0., m_new)
        b_p = tl.math.exp2(b_s - m_safe[:, None])
    else:  # every score finite: the scale folds into one FMA with the max
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1) * qk_scale)
        m_safe = m_new
        b_p = tl.math.exp2(b_s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    if TMA:
        b_v = v_ptr.load([row0, (kvh * D).to(tl.int32)])
    else:
        b_v = kv_codes(tl.load(v_ptr + kv_off[:, None] + o_d[None, :], mask=m_kd, other=0.), b_q.dtype, QUANT)
    if QUANT:
        b_p = b_p * tl.load(vs_ptr + s_off, mask=m_n, other=0.)[None, :]
    acc = tl.dot(b_p.to(b_q.dtype), b_v, acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _attn_span(acc, m_i, l_i, b_q, qpos, lo, hi, free, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr,
               stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, BS, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
               QUANT: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr = False,
               keep_ptr=None, keep_rows=None, SEL=1, SPARSE: tl.constexpr = False):
    """Keys lo..hi-1 (positions; key row kv_start + position when not PAGED, mask n < kv_len): whole
    tiles below `free` (keys every row sees) skip the mask, the rest are masked. SPARSE: every tile is
    masked by the rows' kept blocks, and a tile no row keeps is skipped."""
    mid = tl.minimum(free, hi)
    mid = tl.where(mid > lo, lo + (mid - lo) // BLOCK_N * BLOCK_N, lo)
    if SPARSE:
        mid = lo
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                   BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL, False, TMA,
                                   keep_ptr, keep_rows, SEL, False)
    for start in range(mid, hi, BLOCK_N):
        if SPARSE:
            o_n = start + tl.arange(0, BLOCK_N)
            kept = tl.load(keep_ptr + keep_rows[:, None] + (o_n // SEL)[None, :], mask=(o_n < kv_len)[None, :],
                           other=0)
            if tl.max(tl.max(kept, axis=1), axis=0) != 0:
                acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr,
                                           ks_ptr, vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                                           stride_sb, stride_ss, BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT,
                                           CAUSAL, True, TMA, keep_ptr, keep_rows, SEL, True)
        else:
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr,
                                       vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                       BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL, True, TMA,
                                       keep_ptr, keep_rows, SEL, False)
    return acc, m_i, l_i


# SPLIT_LEN: the longest context where one split takes all; stride_bt: the step's block table width
@jit_per_step("B", "T", "SPLIT_LEN", "stride_bt")
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, lse_ptr, bt_ptr, cu_q_ptr, kv_len_ptr, kn_ptr, vn_ptr,
    qk_scale, B, T, HQ,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os,
    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt, BS, SPLIT_LEN, stride_nt, stride_nh,
    D: tl.constexpr, REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, QUANT: tl.constexpr, CAUSAL: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
    NEW_KV: tl.constexpr, TMA: tl.constexpr = False,
    keep_ptr=None, stride_kt=0, stride_kq=0, SEL=1, SPARSE: tl.constexpr = False,
):
    """NEW_KV (paged prefill): the chunk's own keys (positions kv_len - q_len ..) are read from the
    packed K/V it was written from (kn_ptr/vn_ptr [T, Hkv, D], rows like q's), contiguous rows
    instead of 16-token pages; only the cached prefix comes from the pages. TMA: kn_ptr/vn_ptr are
    tensor descriptors of them (Hopper's bulk copies; sm_90+)."""
    BQ: tl.constexpr = BLOCK_M // REP
    kvh = tl.program_id(1).to(tl.int64)
    if DECODE:  # one program per sequence holds all its (few) query rows
        b = tl.program_id(0)
        q_lo = 0
    else:  # virtual tiles: sequence b owns tiles cu[b] // BQ + b ..; the heaviest (last) tiles go first
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        b = find_seq(cu_q_ptr, tile, B, BQ, True)
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
    if QUANT and b_q.dtype == tl.bfloat16:  # int8 K/V run their dots in fp16 (see kv_codes)
        b_q = b_q.to(tl.float16)
    keep_rows = tl.where(row_ok, rows * stride_kt + o_h * stride_kq, 0)  # SPARSE: each row's keep row

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

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NEW_KV:
        prefix = kv_len - q_len
        acc, m_i, l_i = _attn_span(acc, m_i, l_i, b_q, qpos, k_lo, tl.minimum(k_end, prefix), prefix, prefix, b,
                                   kvh, 0, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks,
                                   stride_kh, stride_sb, stride_ss, BS, qk_scale, D, BLOCK_N, BLOCK_D, True, QUANT,
                                   CAUSAL, False, keep_ptr, keep_rows, SEL, SPARSE)
        # its tiles start at `prefix`, off the split grid: keys past k_end belong to the next split
        acc, m_i, l_i = _attn_span(acc, m_i, l_i, b_q, qpos, tl.maximum(k_lo, prefix), k_end, k_free, k_end, b,
                                   kvh, q_start - prefix, kn_ptr, vn_ptr, ks_ptr, vs_ptr, bt_ptr, 0, stride_nt, 0,
                                   stride_nh, 0, 0, 1, qk_scale, D, BLOCK_N, BLOCK_D, False, False, CAUSAL, TMA,
                                   keep_ptr, keep_rows, SEL, SPARSE)
    else:
        acc, m_i, l_i = _attn_span(acc, m_i, l_i, b_q, qpos, k_lo, k_end, k_free, kv_len, b, kvh, q_start, k_ptr,
                                   v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                                   stride_sb, stride_ss, BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL,
                                   False, keep_ptr, keep_rows, SEL, SPARSE)

    b_o = acc / tl.where(l_i == 0., 1., l_i)[:, None]
    p_o = o_ptr + rows[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
    if SPLIT:
        split = tl.program_id(2).to(tl.int64)
        tl.store(p_o + split * stride_os, b_o, mask=m_q)
        b_lse = tl.where(l_i == 0., float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0., 1., l_i)))
        tl.store(lse_ptr + (split * T + rows) * HQ + o_h, b_lse, mask=row_ok)
    else:
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_q)


@jit_per_step("B", "T")
def attn_reduce_kernel(po_ptr, lse_ptr, o_ptr, cu_q_ptr, kv_len_ptr, B, T, HQ, stride_ot, stride_oh, SPLIT_LEN,
                       D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combines the split partials of one (token, head): split s holds keys s*SPLIT_LEN.. and is
    used by a row iff its position reaches it."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = find_seq(cu_q_ptr, t, B, 1, False)
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
        m_safe = tl.where(m_new == float("-inf"), 0., m_new)  # a split where the row kept no key (sparse)
        alpha = tl.math.exp2(m - m_safe)
        beta = tl.math.exp2(lse - m_safe)
        b_o = tl.load(po_ptr + (s * T * HQ + row) * D + o_d, mask=m_d, other=0.)
        acc = acc * alpha + b_o * beta
        w = w * alpha + beta
        m = m_new
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + o_d, (acc / w).to(o_ptr.dtype.element_ty), mask=m_d)


def _num_splits(device, programs, max_kv, block_n, min_keys):
    """Split the context so about two programs run per multiprocessor; each split keeps >= min_keys."""
    target = 2 * num_sms(device)
    if programs >= target or max_kv <= min_keys:
        return 1, max_kv
    splits = min(triton.cdiv(target, programs), triton.cdiv(max_kv, min_keys))
    return split_length(max_kv, splits, block_n)


def attention(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, causal, paged, max_q, max_kv, config=None,
              k_new=None, v_new=None, keep=None, block_tokens=0):
    """keep [T, Hq, NBsel] (bool or uint8) with block_tokens: attend only to kept blocks (sparse.py); it
    runs this kernel for decode rows too (the split decode kernels take no block lists)."""
    t, hq, d = q.shape
    hkv = k.shape[-2]
    rep = hq // hkv
    n_seq = cu_q.shape[0] - 1
    out = torch.empty_like(q)
    if t == 0 or n_seq == 0:
        return out
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())  # one sync; callers pass it to avoid this
    if max_kv is None:
        max_kv = int(kv_lens.max()) if paged else max_q
    decode = paged and max_q <= 8
    config = dict(config or {})
    kind = config.pop("kind", None) or (decode_kind(q.device, config) if decode else "split")
    if keep is not None:
        kind = "blocks"
    if decode and kind == "cuda":
        out = decode_cuda(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv,
                          dict(decode_cuda_config(q.device), **config))
        if out is not None:
            return out
        kind, config = "split", {}  # where it does not apply: the Triton kernel below
    if decode and kind == "split":
        cfg = dict(decode_config(q.device, q.dtype, d, rep, max_q, n_seq, hkv), **config)
        return decode_attention(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, cfg)
    cfg = dict(attn_config(q.device, q.dtype, d, rep, decode, max_q, n_seq, hkv), **(config or {}))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    bq = block_m // rep
    grid0 = n_seq if decode else t // bq + n_seq
    splits, split_len = _num_splits(q.device, grid0 * hkv, max_kv, block_n, (4 if decode else 16) * block_n)
    if "splits" in cfg:  # benchmarks may force the split count
        splits = cfg.pop("splits")
        splits, split_len = split_length(max_kv, splits, block_n)
    quant = k.dtype == torch.int8
    if q.stride(-1) != 1:
        q = q.contiguous()
    if paged:
        stride_kb, stride_ks, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        bt, stride_bt, bs = block_tables, block_tables.stride(0), k.shape[1]
    else:
        stride_kb, stride_ks, stride_kh = k.stride(0), 0, k.stride(1)
        bt, stride_bt, bs = cu_q, 0, 1
    sc = ks if quant else k
    stride_sb, stride_ss = (ks.stride(0), ks.stride(1)) if quant else (0, 0)
    # a prefill chunk reads its own keys from the K/V it wrote (contiguous rows) where the cache holds
    # them unchanged; config new_kv=False forces the pages (benchmarks)
    new_kv = cfg.pop("new_kv", True) and k_new is not None and paged and not decode and k_new.dtype == k.dtype
    if new_kv and (k_new.stride() != v_new.stride() or k_new.stride(-1) != 1):  # one layout for both (a small copy)
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    kn, vn = (k_new, v_new) if new_kv else (k, v)
    tma = (cfg.pop("tma", False) and new_kv and next_pow2(d, 16) == d and not interpreting(q.device)
           and all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in (k_new, v_new)))
    if tma:  # tensor descriptors over the rows [T, Hkv * D]; one box = one K or V tile of a head
        from triton.tools.tensor_descriptor import TensorDescriptor
        kn, vn = (TensorDescriptor.from_tensor(x.reshape(t, hkv * d), [block_n, d]) for x in (k_new, v_new))
    o_t, plse, o_s, o_h, o_x = split_outputs(out, splits)
    attn_fwd_kernel[(grid0, hkv, splits)](
        q, k, v, sc, vs if quant else v, o_t, plse, bt, cu_q, kv_lens if paged else cu_q, kn, vn,
        scale * LOG2E, n_seq, t, hq, q.stride(0), q.stride(1), o_h, o_x, o_s,
        stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt, bs, split_len, k_new.stride(0) if new_kv else 0,
        k_new.stride(1) if new_kv else 0, D=d, REP=rep, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(d, 16),
        PAGED=paged, QUANT=quant, CAUSAL=causal, DECODE=decode, SPLIT=splits > 1, NEW_KV=new_kv, TMA=tma,
        **(dict(keep_ptr=keep, stride_kt=keep.stride(0), stride_kq=keep.stride(1), SEL=block_tokens, SPARSE=True)
           if keep is not None else {}), **cfg)
    if splits > 1:
        attn_reduce_kernel[(t, hq)](o_t, plse, out, cu_q, kv_lens if paged else cu_q, n_seq, t, hq, out.stride(0),
                                    out.stride(1), split_len, D=d, BLOCK_D=next_pow2(d))
    return out


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale=None,
                    v_scale=None, max_query_len=None, max_seq_len=None, k_new=None, v_new=None, *,
                    config=None):
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention: K and V caches must share one layout with a unit inner stride")
    if k_cache.dtype == torch.int8 and k_scale.stride() != v_scale.stride():
        raise ValueError("paged_attention: K and V scale tables must share one layout")
    config = dict(config or {})
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one sync; callers pass it
    kind = config.pop("prefill", None) or prefill_kind(q.device, max_query_len, q.dtype, k_cache.dtype)
    if kind == "cudnn":
        return cudnn_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale,
                             max_seq_len, k_new, v_new, config)
    return attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, scale, True, True,
                     max_query_len, max_seq_len, config, k_new, v_new)


def cudnn_prefill(q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, k_scale, v_scale, max_seq_len, k_new,
                  v_new, config):
    """Sequences with a chunk of at least min_rows rows through cuDNN (sdpa_prefill.chunk_attention), the runs of
    shorter ones between them (decodes, short chunks) through the Triton kernels. One host sync reads the
    sequences' lengths: a step with such a chunk runs for milliseconds per layer."""
    min_rows = config.pop("min_rows", CUDNN_MIN_ROWS)
    piece = config.pop("piece_tokens", CUDNN_PIECE_TOKENS)
    shapes = {k: config.pop(k) for k in ("grain", "bucket") if k in config}  # tests: small grains and buckets
    cu, lens = cu_q.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    rows_of = lambda s, e: slice(cu[s], cu[e])  # noqa: E731  the packed rows of sequences s..e-1
    new = lambda r: (None, None) if k_new is None else (k_new[r], v_new[r])  # noqa: E731
    by_length = itertools.groupby(range(len(lens)), key=lambda b: cu[b + 1] - cu[b] >= min_rows)
    for long_chunks, run in by_length:
        run = list(run)
        if long_chunks:
            for b in run:
                r = rows_of(b, b + 1)
                sdpa_prefill.chunk_attention(q[r], k_cache, v_cache, k_scale, v_scale, block_tables[b], lens[b], scale,
                                             out[r], piece, *new(r), **shapes)
            continue
        s, e = run[0], run[-1] + 1
        r = rows_of(s, e)
        if r.start < r.stop:  # a run of decodes and short chunks (sequences with no rows this step are skipped)
            # fresh copies of the run's slices: pointers 16-byte aligned whatever s is (Triton compiles a variant per
            # pointer alignment, as per integer class: qv.kernels.triton_utils.jit_per_step)
            out[r] = attention(q[r], k_cache, v_cache, k_scale, v_scale, block_tables[s:e].clone(),
                               cu_q[s:e + 1] - cu[s], seq_lens[s:e].clone(), scale, True, True,
                               max(cu[i + 1] - cu[i] for i in run), max(lens[s:e]), dict(config), *new(r))
    return out
