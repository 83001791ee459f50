"""Triton decode attention over the paged cache: decode and speculative rows (few queries a sequence),
split-K over the context with one program per (sequence, KV head, split), then a reduce pass that merges
the splits; also the split-K host helpers the flash kernel (triton.py) and the raw-CUDA decode
(cuda_sm90.py) share. int8 K/V codes become fp16 without int->float instructions (see kv_codes)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import find_seq, interpreting, jit_per_step, next_pow2, num_sms


LOG2E = 1.4426950408889634


@triton.jit
def kv_codes(b_x, dtype: tl.constexpr, QUANT: tl.constexpr):
    """A loaded K/V tile in the dot dtype. int8 codes become fp16 without int->float conversion
    instructions (a quarter-rate unit that would bound decode): the bits 0x6480 + c read as fp16
    are 1152 + c exactly. fp32 dots take the exact fp32 conversion."""
    if QUANT:
        if dtype == tl.float16:
            return (b_x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        return b_x.to(tl.float32).to(dtype)
    return b_x.to(dtype)


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
        b_y = kv_codes(b_x, dtype, QUANT)
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


@jit_per_step("T", "stride_bt")  # stride_bt: the step's block table width (eager decode steps)
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
    merges them; merging in this launch measured slower: bench/kernels.py --sweep decode)."""
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
    if QUANT and b_q.dtype == tl.bfloat16:  # int8 K/V run their dots in fp16 (see kv_codes)
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


@jit_per_step("B", "T", "N_SPLITS")
def decode_reduce_kernel(po_ptr, lse_ptr, o_ptr, cu_q_ptr, kv_len_ptr, B, T, HQ, stride_ot, stride_oh, SPLIT_LEN,
                         N_SPLITS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Combines the split partials of one (token, head, BLOCK_D slice of the head dim), BLOCK_S splits
    per step (split s holds keys s*SPLIT_LEN.. and is used by a row iff its position reaches it; never
    past the N_SPLITS written, even if a caller's max_seq_len undercounted a sequence)."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = find_seq(cu_q_ptr, t, B, 1, False)
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
    256): one round of loads, where fewer at a time cost dependent steps at long contexts. block_d: head dims
    a program merges (default: up to 4096 values a program)."""
    splits, t, hq, d = part.shape
    bs = min(triton.next_power_of_2(splits), 256)
    bd = block_d or min(triton.next_power_of_2(d), max(16, 4096 // bs))
    decode_reduce_kernel[(t, hq, triton.cdiv(d, bd))](part, lse, out, cu_q, kv_lens, cu_q.shape[0] - 1, t, hq,
                                                      out.stride(0), out.stride(1), split_len, splits, D=d,
                                                      BLOCK_D=bd, BLOCK_S=bs)
    return out


def decode_attention(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, cfg):
    """Decode / speculative rows: split-K over the context with one program per (sequence, KV head,
    split), then the splits are merged by a reduce pass. The split count depends only on the batch size, the
    head counts and max_kv (an upper bound of seq_lens, max_seq_len from the caller), never on device
    values. cfg (from configs.decode_config, overridable for the sweep): BLOCK_M, BLOCK_N, num_warps; waves
    (programs per multiprocessor the splits aim at) or splits; stages (0: register prefetch, >= 2:
    cp.async pipeline depth); words."""
    t, hq, d = q.shape
    hkv, bs = k.shape[-2], k.shape[1]
    n_seq = cu_q.shape[0] - 1
    cfg = dict(cfg)
    block_m, block_n, waves = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("waves")
    stages = cfg.pop("stages", 0)
    splits = max(1, min(triton.cdiv(waves * num_sms(q.device), n_seq * hkv), triton.cdiv(max_kv, 2 * block_n)))
    splits = cfg.pop("splits", splits)
    splits, split_len = split_length(max_kv, splits, block_n)
    quant = k.dtype == torch.int8
    words = (quant and q.dtype != torch.float32 and d % 4 == 0 and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
             and all(st % 4 == 0 for st in k.stride()[:3]) and cfg.pop("words", True))
    cfg.pop("words", None)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    o_t, plse, o_s, o_h, o_x = split_outputs(out, splits)
    sc = ks if quant else k
    paged_decode_kernel[(n_seq, hkv, splits)](
        q, k, v, sc, vs if quant else v, o_t, plse, block_tables, cu_q, kv_lens, scale * LOG2E, t,
        hq, q.stride(0), q.stride(1), o_h, o_x, o_s, k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0, block_tables.stride(0), split_len,
        D=d, REP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(d, 16), BS=bs, QUANT=quant,
        SPLIT=splits > 1, WORDS=words, ASM=words and not interpreting(q.device), STAGES=stages,
        num_stages=1, **cfg)
    if splits > 1:
        reduce_splits(o_t, plse, out, cu_q, kv_lens, split_len)
    return out
