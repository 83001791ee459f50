"""GPTQ-int8 GEMV on CUDA cores for decode (M <= 4 rows), and the split-K partial-sum pass shared
with the tensor-core kernels of linear_gptq.py.

Decode reads every weight byte once per step, so the kernel is built to stream codes at HBM rate:
vector loads of VEC (8 or 16) codes per thread and row, all loads of a step issued before any use,
no tensor-core tiles (with M <= 4 their layout shuffles through shared memory cost more than the
FMAs), codes to fp32 by one prmt each, fp32 FMAs into per-thread partial sums (a step's rows sit in
each thread's registers, [BK, NW, BLOCK_N], so the sum over K needs no shared memory until the end);
split-K over a (column tile, K range) grid whose column tile varies fastest, so programs running
together read whole rows of the weight. Variants, chosen by config (bench/kernels.py GEMV_SWEEP):
  PREFETCH  the loop unrolled by two with the next step's loads issued before this step's math
            (codes as int32 words, so LLVM does not repack bytes between the two register sets);
  fused     the split-K partials are summed by the last program of each column tile (atomic ticket,
            fixed split order, so deterministic) instead of a second launch of split_sum_kernel;
  split     forces the K split (1: none, each program streams all of K for its columns).
Used for M = 1 by default: at M = 4 the FMAs (about 7 instructions per weight byte) make it
issue-bound and the tensor-core kernel is faster (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import interpreting, next_pow2, num_sms


@triton.jit
def split_sum_kernel(p_ptr, bias_ptr, o_ptr, N, MN, SPLITS, stride_ps, stride_om, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + s * stride_ps + o, mask=m, other=0.)
    col = o % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=m, other=0.).to(tl.float32)
    tl.store(o_ptr + (o // N) * stride_om + col, acc.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _codes_f32(b_q, b_z, HAS_ZERO: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """Codes -> c - z in fp32 without int->float conversion instructions (a slow unit): the bits
    0x4B000000 | c read as fp32 are 2**23 + c exactly (ASM: one prmt per code), and c - z is exact.
    b_q: uint8 codes [..., BLOCK_N], or WORDS: int32 words [..., BLOCK_N / 4] holding 4 codes each
    (byte i of word w is code 4w + i), unpacked into the same [..., BLOCK_N] layout."""
    if WORDS:
        if ASM:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                "prmt.b32 $0, $4, 0x4B000000, 0x7540; prmt.b32 $1, $4, 0x4B000000, 0x7541; "
                "prmt.b32 $2, $4, 0x4B000000, 0x7542; prmt.b32 $3, $4, 0x4B000000, 0x7543;",
                "=r,=r,=r,=r,r", [b_q], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            c0 = ((b_q & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
            c1 = (((b_q >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
            c2 = (((b_q >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
            c3 = (((b_q >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
        b_b = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [..., W, 2, 2]: element (w, j, i) is code 4w + 2j + i
        b_b = tl.reshape(b_b, [b_q.shape[0], b_q.shape[1], 4 * b_q.shape[2]])
    elif ASM:
        b_b = tl.inline_asm_elementwise(
            "prmt.b32 $0, $4, 0x4B000000, 0x7540; prmt.b32 $1, $4, 0x4B000000, 0x7541; "
            "prmt.b32 $2, $4, 0x4B000000, 0x7542; prmt.b32 $3, $4, 0x4B000000, 0x7543;",
            "=r,=r,=r,=r,r", [b_q], dtype=tl.float32, is_pure=True, pack=4)
    else:
        b_b = (b_q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    if HAS_ZERO:
        return (b_b - 8388608.0) - b_z
    return b_b - 8388736.0  # 2**23 + 128


@triton.jit
def _gemv_step_loads(x_ptr, q_ptr, s_ptr, z_ptr, k0, k_hi, o_r, o_q, m_q, o_g, m_g, M, GROUP, stride_xm, stride_qk,
                     stride_sg, BLOCK_M: tl.constexpr, HAS_ZERO: tl.constexpr, WORDS: tl.constexpr):
    """Everything one step reads: codes [BK, NW, BLOCK_N] (WORDS: int32 words [BK, NW, BLOCK_N / 4]) of rows k0 + o_r, the step's group scales and
    zeros [1, NW, BLOCK_N] (broadcasts in the codes' layout) and x [BK, NW, 1] for up to four rows.
    Rows >= k_hi are masked, so a prefetch past the end reads nothing."""
    o_k = k0 + o_r  # [BK, NW, 1]
    m_k = o_k < k_hi
    if WORDS:  # whole 32-bit registers: prefetched bytes would be repacked with prmt across the loop
        b_q = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + o_k.to(tl.int64) * (stride_qk // 4) + o_q,
                      mask=m_k & m_q, other=0)
    else:
        b_q = tl.load(q_ptr + o_k.to(tl.int64) * stride_qk + o_q, mask=m_k & m_q, other=0)
    g_off = (k0 // GROUP).to(tl.int64) * stride_sg
    m_g = m_g & (o_g * 0 + k0 < k_hi)  # a prefetch past the end: its group row may not exist
    b_s = tl.load(s_ptr + g_off + o_g, mask=m_g, other=0.)
    b_z = b_s
    if HAS_ZERO:
        b_z = tl.load(z_ptr + g_off + o_g, mask=m_g, other=0.)
    b_x0 = tl.load(x_ptr + o_k, mask=m_k, other=0.)
    b_x1 = b_x0
    b_x2 = b_x0
    b_x3 = b_x0
    if BLOCK_M > 1:
        b_x1 = tl.load(x_ptr + stride_xm + o_k, mask=m_k & (o_k * 0 + 1 < M), other=0.)
    if BLOCK_M > 2:
        b_x2 = tl.load(x_ptr + 2 * stride_xm + o_k, mask=m_k & (o_k * 0 + 2 < M), other=0.)
        b_x3 = tl.load(x_ptr + 3 * stride_xm + o_k, mask=m_k & (o_k * 0 + 3 < M), other=0.)
    return b_q, b_s, b_z, b_x0, b_x1, b_x2, b_x3


@triton.jit
def _gemv_step_math(acc0, acc1, acc2, acc3, step, BLOCK_M: tl.constexpr, HAS_ZERO: tl.constexpr, WORDS: tl.constexpr,
                    ASM: tl.constexpr):
    """acc_m += s * sum over the step's rows of x_m (c - z), the row sum within each thread."""
    b_q, b_s, b_z, b_x0, b_x1, b_x2, b_x3 = step
    b_c = _codes_f32(b_q, b_z.to(tl.float32), HAS_ZERO, WORDS, ASM)
    b_sf = b_s.to(tl.float32)
    acc0 += b_sf * tl.sum(b_x0.to(tl.float32) * b_c, axis=0, keep_dims=True)
    if BLOCK_M > 1:
        acc1 += b_sf * tl.sum(b_x1.to(tl.float32) * b_c, axis=0, keep_dims=True)
    if BLOCK_M > 2:
        acc2 += b_sf * tl.sum(b_x2.to(tl.float32) * b_c, axis=0, keep_dims=True)
        acc3 += b_sf * tl.sum(b_x3.to(tl.float32) * b_c, axis=0, keep_dims=True)
    return acc0, acc1, acc2, acc3


@triton.jit
def gptq_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, p_ptr, cnt_ptr, o_ptr, M, N, K, K_SPLIT, GROUP, SPLITS,
                     stride_xm, stride_qk, stride_sg, stride_ps, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NW: tl.constexpr,
                     VEC: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr,
                     REDUCE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """Program (column tile, K range): BLOCK_N = 32*VEC columns (VEC contiguous codes per thread) and
    NW warps; each step warp w takes rows k0 + w*BLOCK_K + i, i < BLOCK_K (in registers), and
    accumulates s * sum_i x (c - z) into its own partial sums [NW, BLOCK_N]: the sum over K stays in
    each thread until one cross-warp sum at the end, and nothing in the loop goes through shared
    memory. A step (NW*BLOCK_K rows) lies in one group: the host makes it divide GROUP.
    PREFETCH: the next step's loads are issued before this step's math (registers double-buffered),
    so a thread always has two steps of codes in flight instead of draining to none between steps.
    REDUCE: 0 no split (y written here); 1 fp32 partials [SPLITS, M, N] for split_sum_kernel; 2 the
    same partials, then the program that finishes last for its column tile (a ticket from an atomic
    counter per tile) sums all SPLITS partials in split order (so bitwise the same every run), adds
    the bias, writes y and resets the counter to 0 for the next launch (CUDA-graph replay)."""
    o_n = tl.max_contiguous(tl.multiple_of(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), VEC), VEC)
    m_n = o_n < N
    o_n3 = o_n[None, None, :]  # [1, 1, BLOCK_N]
    if WORDS:
        o_q = tl.max_contiguous(tl.multiple_of(tl.program_id(0) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4),
                                               VEC // 4), VEC // 4)[None, None, :]
        m_q = o_q < N // 4  # (not o_q * 4 < N: its stride hides the mask's constancy and splits the vector loads)
    else:
        o_q = o_n3
        m_q = o_n3 < N
    o_g = tl.arange(0, NW)[None, :, None] * 0 + o_n3  # [1, NW, BLOCK_N]: group rows, loaded once per warp
    m_g = o_g < N
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    o_r = tl.arange(0, BLOCK_K)[:, None, None] + tl.arange(0, NW)[None, :, None] * BLOCK_K  # [BK, NW, 1]
    acc0 = tl.zeros([1, NW, BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    STEP: tl.constexpr = BLOCK_K * NW
    if PREFETCH:  # unrolled by two so both steps' registers are live at once (a loop-carried copy would not be)
        a = _gemv_step_loads(x_ptr, q_ptr, s_ptr, z_ptr, k_lo, k_hi, o_r, o_q, m_q, o_g, m_g, M, GROUP, stride_xm,
                             stride_qk, stride_sg, BLOCK_M, HAS_ZERO, WORDS)
        for k0 in range(k_lo, k_hi, 2 * STEP):
            b = _gemv_step_loads(x_ptr, q_ptr, s_ptr, z_ptr, k0 + STEP, k_hi, o_r, o_q, m_q, o_g, m_g, M, GROUP,
                                 stride_xm, stride_qk, stride_sg, BLOCK_M, HAS_ZERO, WORDS)
            acc0, acc1, acc2, acc3 = _gemv_step_math(acc0, acc1, acc2, acc3, a, BLOCK_M, HAS_ZERO, WORDS, ASM)
            a = _gemv_step_loads(x_ptr, q_ptr, s_ptr, z_ptr, k0 + 2 * STEP, k_hi, o_r, o_q, m_q, o_g, m_g, M, GROUP,
                                 stride_xm, stride_qk, stride_sg, BLOCK_M, HAS_ZERO, WORDS)
            acc0, acc1, acc2, acc3 = _gemv_step_math(acc0, acc1, acc2, acc3, b, BLOCK_M, HAS_ZERO, WORDS, ASM)
    else:  # all loads of a step are still issued before any use
        for k0 in range(k_lo, k_hi, STEP):
            a = _gemv_step_loads(x_ptr, q_ptr, s_ptr, z_ptr, k0, k_hi, o_r, o_q, m_q, o_g, m_g, M, GROUP, stride_xm,
                                 stride_qk, stride_sg, BLOCK_M, HAS_ZERO, WORDS)
            acc0, acc1, acc2, acc3 = _gemv_step_math(acc0, acc1, acc2, acc3, a, BLOCK_M, HAS_ZERO, WORDS, ASM)
    p_o = p_ptr + tl.program_id(1).to(tl.int64) * stride_ps + o_n
    _gemv_store(p_o, acc0, bias_ptr, o_n, m_n, HAS_BIAS, REDUCE)
    if BLOCK_M > 1:
        _gemv_store(p_o + stride_om, acc1, bias_ptr, o_n, m_n & (o_n * 0 + 1 < M), HAS_BIAS, REDUCE)
    if BLOCK_M > 2:
        _gemv_store(p_o + 2 * stride_om, acc2, bias_ptr, o_n, m_n & (o_n * 0 + 2 < M), HAS_BIAS, REDUCE)
        _gemv_store(p_o + 3 * stride_om, acc3, bias_ptr, o_n, m_n & (o_n * 0 + 3 < M), HAS_BIAS, REDUCE)
    if REDUCE == 2:
        tl.debug_barrier()  # every thread's partial is stored before the ticket releases them
        ticket = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:
            for m in range(0, M):
                _split_reduce(p_ptr + m * stride_om, bias_ptr, o_ptr + m * stride_om, o_n, m_n, SPLITS, stride_ps,
                              HAS_BIAS, REDUCE_BLOCK)
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_reduce(p_ptr, bias_ptr, o_ptr, o_n, m_n, SPLITS, stride_ps, HAS_BIAS: tl.constexpr, REDUCE_BLOCK: tl.constexpr):
    """y = sum of the SPLITS partials of one row and column tile, in split order (deterministic), + bias.
    .cg loads read L2, where the other programs' partials are (never a stale L1 line)."""
    o_s = tl.arange(0, REDUCE_BLOCK)[:, None]
    acc = tl.zeros([REDUCE_BLOCK, o_n.shape[0]], dtype=tl.float32)
    for s0 in range(0, SPLITS, REDUCE_BLOCK):
        acc += tl.load(p_ptr + (s0 + o_s).to(tl.int64) * stride_ps + o_n[None, :],
                       mask=(s0 + o_s < SPLITS) & m_n[None, :], other=0., cache_modifier=".cg")
    b_o = tl.sum(acc, axis=0)
    if HAS_BIAS:
        b_o += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)
    tl.store(o_ptr + o_n, b_o.to(o_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _gemv_store(p_o, acc, bias_ptr, o_n, m_n, HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr):
    b_o = tl.sum(tl.sum(acc, axis=0), axis=0)
    if REDUCE:
        tl.store(p_o, b_o, mask=m_n)
    else:
        if HAS_BIAS:
            b_o += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_n)


def gemv_config(device, m, n, k):
    """CUDA-core GEMV settings, measured on the H200 (bench/kernels.py --sweep gemv, docs/BENCHMARKS.md):
    wide outputs (>= 64 column tiles) take 4-warp programs over 8 waves, narrow ones 8-warp programs.
    VEC: codes per thread and row (8 or 16); PREFETCH: double-buffered step loads; fused: split-K
    partials summed by the last program of each column tile instead of split_sum_kernel."""
    base = dict(VEC=8, PREFETCH=False, fused=False)
    if interpreting(device):
        return dict(base, NW=2, BK=4, waves=2, ASM=False)
    if triton.cdiv(n, 256) >= 64:
        return dict(base, NW=4, BK=8, waves=8, ASM=True)
    return dict(base, NW=8, BK=8, waves=4, ASM=True)


_TILE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device, tiles):
    """Zeroed int32 tickets, one per column tile, shared by every fused GEMV on `device` (each launch
    leaves them at zero again; launches on one stream run in order). None when a new buffer would have
    to be allocated inside a CUDA-graph capture, where it would belong to the graph's memory pool."""
    cnt = _TILE_COUNTERS.get(device)
    if cnt is None or cnt.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _TILE_COUNTERS[device] = cnt
    return cnt


def gemv_fma(x2, w, bias, out, cfg):
    """out = x2 W^T (+ bias) for m <= 4 rows with gptq_gemv_kernel; False when the groups do not allow it."""
    m, k = x2.shape
    n = w.qweight.shape[1]
    nw, bk = cfg["NW"], cfg["BK"]
    while w.group_size % (nw * bk):  # one step of nw * bk rows must lie in one group
        if bk > 1:
            bk //= 2
        elif nw > 1:
            nw //= 2
        else:
            return False
    step = nw * bk
    vec = cfg.get("VEC", 8)
    block_n = 32 * vec
    tiles = triton.cdiv(n, block_n)
    split = cfg.get("split") or max(1, triton.cdiv(cfg["waves"] * num_sms(x2.device), tiles))
    split = min(split, triton.cdiv(k, step))
    k_split = triton.cdiv(triton.cdiv(k, split), step) * step
    split = triton.cdiv(k, k_split)
    # int32 code words need 4-byte aligned rows
    words = n % 4 == 0 and w.qweight.stride(0) % 4 == 0 and w.qweight.data_ptr() % 16 == 0 and cfg.get("WORDS", bool(cfg.get("PREFETCH")))
    counters = _tile_counters(x2.device, tiles) if split > 1 and cfg.get("fused") else None
    reduce = 0 if split == 1 else 2 if counters is not None else 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    gptq_gemv_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, bias if bias is not None else w.scales,
        part, counters if counters is not None else part, out, m, n, k, k_split, w.group_size, split,
        x2.stride(0), w.qweight.stride(0), w.scales.stride(0), part.stride(0) if split > 1 else 0, part.stride(-2),
        BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=bk, NW=nw, VEC=vec, HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, REDUCE=reduce, REDUCE_BLOCK=cfg.get("REDUCE_BLOCK") or min(next_pow2(split), 4096 // block_n),
        PREFETCH=bool(cfg.get("PREFETCH")), WORDS=words, ASM=cfg["ASM"] and not interpreting(x2.device), num_warps=nw, num_stages=1)
    if reduce == 1:
        block = 1024
        split_sum_kernel[(triton.cdiv(m * n, block),)](part, bias if bias is not None else part, out, n, m * n, split,
                                                       part.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                                       BLOCK=block)
    return True
