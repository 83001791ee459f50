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

import torch
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
               QUANT: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    """One BLOCK_N-key tile of online softmax. TMA: k_ptr/v_ptr are tensor descriptors over the
    contiguous rows [T, Hkv * D] (rows past kv_len are masked below; past the tensor, zero-filled)."""
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
        b_k = _kv_codes(tl.load(k_ptr + kv_off[:, None] + o_d[None, :], mask=m_kd, other=0.), b_q.dtype, QUANT)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BM, BN]
    if MASK or QUANT:
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
    else:  # every score finite: the scale folds into one FMA with the max
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1) * qk_scale)
        m_safe = m_new
        b_p = tl.math.exp2(b_s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    if TMA:
        b_v = v_ptr.load([row0, (kvh * D).to(tl.int32)])
    else:
        b_v = _kv_codes(tl.load(v_ptr + kv_off[:, None] + o_d[None, :], mask=m_kd, other=0.), b_q.dtype, QUANT)
    if QUANT:
        b_p = b_p * tl.load(vs_ptr + s_off, mask=m_n, other=0.)[None, :]
    acc = tl.dot(b_p.to(b_q.dtype), b_v, acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _attn_span(acc, m_i, l_i, b_q, qpos, lo, hi, free, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr,
               stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, BS, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
               QUANT: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr = False):
    """Keys lo..hi-1 (positions; key row kv_start + position when not PAGED, mask n < kv_len): whole
    tiles below `free` (keys every row sees) skip the mask, the rest are masked."""
    mid = tl.minimum(free, hi)
    mid = tl.where(mid > lo, lo + (mid - lo) // BLOCK_N * BLOCK_N, lo)
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                   BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL, False, TMA)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attn_tile(acc, m_i, l_i, b_q, qpos, start, kv_len, b, kvh, kv_start, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                   BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL, True, TMA)
    return acc, m_i, l_i


@triton.jit
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, lse_ptr, bt_ptr, cu_q_ptr, kv_len_ptr, kn_ptr, vn_ptr,
    qk_scale, B, T, HQ,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os,
    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt, BS, SPLIT_LEN, stride_nt, stride_nh,
    D: tl.constexpr, REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, QUANT: tl.constexpr, CAUSAL: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
    NEW_KV: tl.constexpr, TMA: tl.constexpr = False,
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

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NEW_KV:
        prefix = kv_len - q_len
        acc, m_i, l_i = _attn_span(acc, m_i, l_i, b_q, qpos, k_lo, tl.minimum(k_end, prefix), prefix, prefix, b,
                                   kvh, 0, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks,
                                   stride_kh, stride_sb, stride_ss, BS, qk_scale, D, BLOCK_N, BLOCK_D, True, QUANT,
                                   CAUSAL)
        # its tiles start at `prefix`, off the split grid: keys past k_end belong to the next split
        acc, m_i, l_i = _attn_span(acc, m_i, l_i, b_q, qpos, tl.maximum(k_lo, prefix), k_end, k_free, k_end, b,
                                   kvh, q_start - prefix, kn_ptr, vn_ptr, ks_ptr, vs_ptr, bt_ptr, 0, stride_nt, 0,
                                   stride_nh, 0, 0, 1, qk_scale, D, BLOCK_N, BLOCK_D, False, False, CAUSAL, TMA)
    else:
        acc, m_i, l_i = _attn_span(acc, m_i, l_i, b_q, qpos, k_lo, k_end, k_free, kv_len, b, kvh, q_start, k_ptr,
                                   v_ptr, ks_ptr, vs_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                                   stride_sb, stride_ss, BS, qk_scale, D, BLOCK_N, BLOCK_D, PAGED, QUANT, CAUSAL)

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


@triton.jit
def _kv_words_f16(b_w, ASM: tl.constexpr):
    """int8 codes packed four to an int32 word [N, D/4] -> fp16 [N, D] (code 4w + i is byte i of word w).
    ASM: no int->float instructions: c ^ 0x80 = c + 128 as a byte, byte | 0x6400 read as fp16 is
    1152 + c, and one packed subtract of 1152 leaves c exactly (1.25 instructions per code).
    Otherwise (the CPU interpreter) shifts and exact conversions."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "{ .reg .b32 t, c, lo, hi; xor.b32 t, $4, 0x80808080; mov.b32 c, 0x64806480; "
            "prmt.b32 lo, t, 0x64646464, 0x4140; prmt.b32 hi, t, 0x64646464, 0x4342; "
            "sub.f16x2 lo, lo, c; sub.f16x2 hi, hi, c; mov.b32 {$0, $1}, lo; mov.b32 {$2, $3}, hi; }",
            "=h,=h,=h,=h,r", [b_w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        c0 = ((b_w << 24) >> 24).to(tl.float32).to(tl.float16)
        c1 = ((b_w << 16) >> 24).to(tl.float32).to(tl.float16)
        c2 = ((b_w << 8) >> 24).to(tl.float32).to(tl.float16)
        c3 = (b_w >> 24).to(tl.float32).to(tl.float16)
    b_x = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [N, D/4, 2, 2]: element (w, j, i) is code 4w + 2j + i
    return tl.reshape(b_x, [b_w.shape[0], 4 * b_w.shape[1]])


@triton.jit
def _decode_codes(b_x, dtype: tl.constexpr, QUANT: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    if WORDS:
        b_y = _kv_words_f16(b_x, ASM)
    else:
        b_y = _kv_codes(b_x, dtype, QUANT)
    return b_y


@triton.jit
def _decode_tile_load(n, pg, k_end, kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb, stride_ks, stride_kh, stride_sb,
                      stride_ss, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, QUANT: tl.constexpr,
                      WORDS: tl.constexpr):
    """Registers of one K/V tile: keys n [BN] on pages pg [BN] (codes, and their scales when int8)."""
    m_n = n < k_end
    off = pg.to(tl.int64) * stride_kb + (n % BS) * stride_ks + kvh * stride_kh
    if WORDS:  # int8 codes as int32 words: compact registers while the tile waits for its turn
        o_w = tl.arange(0, BLOCK_D // 4)
        m = m_n[:, None] & (o_w[None, :] < D // 4)
        b_k = tl.load(k_ptr.to(tl.pointer_type(tl.int32)) + (off // 4)[:, None] + o_w[None, :], mask=m, other=0)
        b_v = tl.load(v_ptr.to(tl.pointer_type(tl.int32)) + (off // 4)[:, None] + o_w[None, :], mask=m, other=0)
    else:
        o_d = tl.arange(0, BLOCK_D)
        m = m_n[:, None] & (o_d[None, :] < D)
        b_k = tl.load(k_ptr + off[:, None] + o_d[None, :], mask=m, other=0)
        b_v = tl.load(v_ptr + off[:, None] + o_d[None, :], mask=m, other=0)
    if QUANT:
        s_off = pg.to(tl.int64) * stride_sb + (n % BS) * stride_ss + kvh
        b_ks = tl.load(ks_ptr + s_off, mask=m_n, other=0.)
        b_vs = tl.load(vs_ptr + s_off, mask=m_n, other=0.)
    else:
        b_ks = m_n.to(tl.float32)
        b_vs = b_ks
    return b_k, b_v, b_ks, b_vs


@triton.jit
def _decode_tile_step(b_q, b_k, b_v, b_ks, b_vs, n, k_end, qpos, acc, m_i, l_i, qk_scale, QUANT: tl.constexpr,
                      WORDS: tl.constexpr, ASM: tl.constexpr):
    """Online softmax over one K/V tile (keys n): returns the updated (acc, row max, row sum)."""
    b_s = tl.dot(b_q, tl.trans(_decode_codes(b_k, b_q.dtype, QUANT, WORDS, ASM)), input_precision="ieee")  # [BM, BN]
    b_s = b_s * (b_ks * qk_scale)[None, :]
    vis = (n[None, :] < k_end) & (n[None, :] <= qpos[:, None])
    b_s = tl.where(vis, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0., m_new)
    b_p = tl.math.exp2(b_s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    b_p = b_p * b_vs[None, :]
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_q.dtype), _decode_codes(b_v, b_q.dtype, QUANT, WORDS, ASM),
                                        input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, lse_ptr, bt_ptr, cu_q_ptr, kv_len_ptr,
    qk_scale, T, HQ, stride_qt, stride_qh, stride_ot, stride_oh, stride_os,
    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt, SPLIT_LEN,
    D: tl.constexpr, REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Decode and speculative rows (few queries per sequence) over the paged cache: program
    (sequence b, KV head, split) holds the b's query rows of that KV head's GQA group and the keys
    split*SPLIT_LEN .. +SPLIT_LEN. The grid may be larger than the work (splits sized from an upper
    bound of seq_lens, so a captured CUDA graph stays valid): programs past seq_lens[b] return at once.

    STAGES 0: the K/V tile for the next step is loaded into registers before the current one is used
    (and the block-table entries one step earlier still), so one tile per program is always in flight;
    no loop-carried dependence runs through a load issued in the same step. STAGES >= 2: Triton's
    software pipeliner keeps STAGES - 1 tiles in flight through cp.async into shared memory (no
    registers held per tile in flight; the block-table load is pipelined one stage ahead of K/V).

    SPLIT: o_ptr/lse_ptr are per-split fp32 partials and their base-2 log-sum-exps (decode_reduce_kernel
    merges them; merging in this launch measured slower on the H200, docs/BENCHMARKS.md)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_len_ptr + b)
    k_lo = tl.program_id(2) * SPLIT_LEN
    k_end = tl.minimum(kv_len, k_lo + SPLIT_LEN)
    if (q_len <= 0) | (k_lo >= k_end):
        return
    o_m = tl.arange(0, BLOCK_M)
    tok = o_m // REP
    o_h = kvh * REP + o_m % REP
    row_ok = tok < q_len
    qpos = tl.where(row_ok, kv_len - q_len + tok, kv_len - 1)  # padding rows see every key: no empty softmax
    o_d = tl.arange(0, BLOCK_D)
    rows = (q_start + tok).to(tl.int64)
    m_q = row_ok[:, None] & (o_d[None, :] < D)
    b_q = tl.load(q_ptr + rows[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :], mask=m_q, other=0.)
    if QUANT and b_q.dtype == tl.bfloat16:  # int8 K/V run their dots in fp16 (see _kv_codes)
        b_q = b_q.to(tl.float16)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    o_n = tl.arange(0, BLOCK_N)
    p_bt = bt_ptr + b.to(tl.int64) * stride_bt
    if STAGES == 0:
        n = k_lo + o_n
        pg = tl.load(p_bt + n // BS, mask=n < k_end, other=0)
        b_k, b_v, b_ks, b_vs = _decode_tile_load(n, pg, k_end, kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb,
                                                 stride_ks, stride_kh, stride_sb, stride_ss, D, BLOCK_D, BS, QUANT,
                                                 WORDS)
        pg = tl.load(p_bt + (n + BLOCK_N) // BS, mask=n + BLOCK_N < k_end, other=0)
        for start in range(k_lo, k_end, BLOCK_N):
            n = start + o_n
            n_k, n_v, n_ks, n_vs = _decode_tile_load(n + BLOCK_N, pg, k_end, kvh, k_ptr, v_ptr, ks_ptr, vs_ptr,
                                                     stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, D,
                                                     BLOCK_D, BS, QUANT, WORDS)
            pg = tl.load(p_bt + (n + 2 * BLOCK_N) // BS, mask=n + 2 * BLOCK_N < k_end, other=0)
            acc, m_i, l_i = _decode_tile_step(b_q, b_k, b_v, b_ks, b_vs, n, k_end, qpos, acc, m_i, l_i, qk_scale,
                                              QUANT, WORDS, ASM)
            b_k, b_v, b_ks, b_vs = n_k, n_v, n_ks, n_vs
    else:
        for start in tl.range(k_lo, k_end, BLOCK_N, num_stages=STAGES):
            n = start + o_n
            pg = tl.load(p_bt + n // BS, mask=n < k_end, other=0)
            b_k, b_v, b_ks, b_vs = _decode_tile_load(n, pg, k_end, kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb,
                                                     stride_ks, stride_kh, stride_sb, stride_ss, D, BLOCK_D, BS,
                                                     QUANT, WORDS)
            acc, m_i, l_i = _decode_tile_step(b_q, b_k, b_v, b_ks, b_vs, n, k_end, qpos, acc, m_i, l_i, qk_scale,
                                              QUANT, WORDS, ASM)

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
def decode_reduce_kernel(po_ptr, lse_ptr, o_ptr, cu_q_ptr, kv_len_ptr, B, T, HQ, stride_ot, stride_oh, SPLIT_LEN,
                         N_SPLITS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Combines the split partials of one (token, head, BLOCK_D slice of the head dim), BLOCK_S splits
    per step (split s holds keys s*SPLIT_LEN.. and is used by a row iff its position reaches it; never
    past the N_SPLITS written, even if a caller's max_seq_len undercounted a sequence)."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = _find_seq(cu_q_ptr, t, B, 1, False)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    n_split = tl.minimum((tl.load(kv_len_ptr + b) - q_len + (t - q_start)) // SPLIT_LEN + 1, N_SPLITS)
    o_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_s = tl.arange(0, BLOCK_S)
    row = t.to(tl.int64) * HQ + h
    m = tl.full([], float("-inf"), dtype=tl.float32)
    w = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        m_s = s0 + o_s < n_split
        p_s = (s0 + o_s).to(tl.int64) * T * HQ + row
        lse = tl.load(lse_ptr + p_s, mask=m_s, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.math.exp2(m - m_new)
        beta = tl.math.exp2(lse - m_new)
        b_o = tl.load(po_ptr + p_s[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.)
        acc = acc * alpha + tl.sum(b_o * beta[:, None], axis=0)
        w = w * alpha + tl.sum(beta, axis=0)
        m = m_new
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + o_d, (acc / w).to(o_ptr.dtype.element_ty), mask=m_d)


# ---------------------------------------------------------------------------------------------
# host helpers of split-K attention (the Triton launchers in attention.py and the CUDA decode share them)
# ---------------------------------------------------------------------------------------------


def split_length(max_kv: int, splits: int, unit: int) -> tuple[int, int]:
    """(splits, keys a split) for about `splits` parts of max_kv keys, each a multiple of `unit` keys."""
    split_len = triton.cdiv(triton.cdiv(max_kv, splits), unit) * unit
    return triton.cdiv(max_kv, split_len), split_len


def split_outputs(out, splits: int):
    """Where the attention kernels write: with split-K, fp32 partials [splits, T, Hq, D] and their
    log-sum-exps [splits, T, Hq] for the reduce pass; else `out` itself (the lse pointer unused).
    Returns (output, lse, split stride, token stride, head stride)."""
    if splits == 1:
        return out, out, 0, out.stride(0), out.stride(1)
    t, hq, d = out.shape
    po = torch.empty((splits, t, hq, d), dtype=torch.float32, device=out.device)
    plse = torch.empty((splits, t, hq), dtype=torch.float32, device=out.device)
    return po, plse, po.stride(0), po.stride(1), po.stride(2)


def reduce_splits(part, lse, out, cu_q, kv_lens, split_len, block_d=None):
    """out = the merge of the decode splits' fp32 partials [splits, T, Hq, D] and their base-2 log-sum-exps
    [splits, T, Hq] (decode_reduce_kernel). All splits of a (token, head, column slice) in one step (up to
    256): one round of loads (H200, 32K x 1, 171 splits: 64 at a time, three dependent steps, took 8.4
    us). block_d: head dims a program merges (default: up to 4096 values a program)."""
    splits, t, hq, d = part.shape
    bs = min(triton.next_power_of_2(splits), 256)
    bd = block_d or min(triton.next_power_of_2(d), max(16, 4096 // bs))
    decode_reduce_kernel[(t, hq, triton.cdiv(d, bd))](part, lse, out, cu_q, kv_lens, cu_q.shape[0] - 1, t, hq,
                                                      out.stride(0), out.stride(1), split_len, splits, D=d,
                                                      BLOCK_D=bd, BLOCK_S=bs)
    return out
