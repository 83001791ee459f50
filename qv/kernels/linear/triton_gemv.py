"""GPTQ-int8 GEMV for decode: on CUDA cores (M <= 4 rows), and on tensor cores with the weight as the
MMA's wide operand (gptq_gemv_mma_kernel, M <= 16; the Triton twin of cuda_sm90.py's kernel); and
the split-K partial sums shared with the tensor-core kernels of triton.py and cuda_sm90.py.

Decode reads every weight byte once per step, so the kernel is built to stream codes at HBM rate:
vector loads of 8 codes per thread, all loads of a step issued before any use, no tensor-core tiles
(with M <= 4 their layout shuffles through shared memory cost more than the FMAs), fp32 FMAs
straight into per-thread partial sums; split-K over a (column tile, K range) grid whose column tile
varies fastest, so programs running together read whole rows of the weight; the partials are summed
by the last program of each column tile (fused, the default) or by split_sum_kernel, both in split
order (deterministic). Used for M = 1 by default: at M = 4 the FMAs (about 7 instructions per
weight byte) make it issue-bound and the tensor-core kernel is faster (configs.gemv_kind).
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
def store_tile(acc, o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, stride_os, HAS_BIAS: tl.constexpr,
               SPLIT: tl.constexpr):
    """A GEMM program's [BM, BN] fp32 sums: its split's partials (SPLIT: summed later by sum_partials), or the
    output in its dtype with the bias added."""
    rows = o_m[:, None].to(tl.int64) * stride_om + o_n[None, :]
    m_o = m_m[:, None] & m_n[None, :]
    if SPLIT:
        tl.store(o_ptr + tl.program_id(1).to(tl.int64) * stride_os + rows, acc, mask=m_o)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
        tl.store(o_ptr + rows, acc.to(o_ptr.dtype.element_ty), mask=m_o)


@triton.jit
def _codes_f32(b_q, b_z, HAS_ZERO: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes -> c - z in fp32 without int->float conversion instructions (a slow unit): the bits
    0x4B000000 | c read as fp32 are 2**23 + c exactly (ASM: one prmt per code), and c - z is exact."""
    if ASM:
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
def codes_f16(b_q, ASM: tl.constexpr):
    """uint8 codes -> fp16 1024 + c, exactly: the bits 0x6400 | c (ASM: one prmt per two codes)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0x64646464, 0x4140; prmt.b32 $1, $2, 0x64646464, 0x4342;",
            "=r,=r,r", [b_q], dtype=tl.float16, is_pure=True, pack=4)
    return (b_q.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def gptq_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, o_ptr, y_ptr, ticket_ptr, M, N, K, K_SPLIT, GROUP,
                     SPLITS, stride_xm, stride_qk, stride_sg, stride_os, stride_om, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NW: tl.constexpr,
                     VEC: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     ASM: tl.constexpr, FUSED: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (column tile, K range): BLOCK_N = 32*VEC columns (VEC contiguous codes per thread) and
    NW warps; each step warp w takes rows k0 + w*BLOCK_K + i, i < BLOCK_K (unrolled), and accumulates
    x * (c - z) with FMAs into its own partial sums [NW, BLOCK_N]: the sum over K stays in each thread
    until one cross-warp sum at the end. Scales, zeros and x are loaded as [NW, BLOCK_N] broadcasts so
    they get the codes' layout (VEC=8: fp16 scales fill one 16-byte load) and nothing in the loop goes
    through shared memory. A step (NW*BLOCK_K rows) lies in one group: the host makes it divide GROUP.

    FUSED (split-K): no second launch. After storing its partials a program takes a ticket for its
    column tile (ticket_ptr[tile], zero between launches); the last of the SPLITS programs sums the
    partials in split order, adds the bias, writes y and puts the ticket back to zero (deterministic;
    a replayed CUDA graph finds zeros)."""
    o_n = tl.max_contiguous(tl.multiple_of(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), VEC), VEC)
    m_n = o_n < N
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    o_w = tl.arange(0, NW)[:, None] * BLOCK_K  # [NW, 1]: first row of each warp
    o_r = o_w + o_n[None, :] * 0
    p_q = q_ptr + o_r * 0 + o_n[None, :]
    m_c = (o_r * 0 + o_n[None, :]) < N
    acc0 = tl.zeros([NW, BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in range(k_lo, k_hi, BLOCK_K * NW):
        g_off = (k0 // GROUP).to(tl.int64) * stride_sg
        b_s = tl.load(s_ptr + g_off + o_r * 0 + o_n[None, :], mask=m_c, other=0.).to(tl.float32)
        b_z = b_s
        if HAS_ZERO:
            b_z = tl.load(z_ptr + g_off + o_r * 0 + o_n[None, :], mask=m_c, other=0.).to(tl.float32)
        r0 = tl.zeros([NW, BLOCK_N], dtype=tl.float32)
        r1 = r0
        r2 = r0
        r3 = r0
        for i in tl.static_range(BLOCK_K):
            o_k = k0 + o_w + i  # [NW, 1]
            m_k = o_k < k_hi
            b_c = _codes_f32(tl.load(p_q + o_k.to(tl.int64) * stride_qk, mask=m_k & m_c, other=0), b_z,
                             HAS_ZERO, ASM)
            r0 += tl.load(x_ptr + o_k, mask=m_k, other=0.).to(tl.float32) * b_c
            if BLOCK_M > 1:
                r1 += tl.load(x_ptr + stride_xm + o_k, mask=m_k & (o_k * 0 + 1 < M), other=0.).to(tl.float32) * b_c
            if BLOCK_M > 2:
                r2 += tl.load(x_ptr + 2 * stride_xm + o_k, mask=m_k & (o_k * 0 + 2 < M), other=0.).to(tl.float32) * b_c
                r3 += tl.load(x_ptr + 3 * stride_xm + o_k, mask=m_k & (o_k * 0 + 3 < M), other=0.).to(tl.float32) * b_c
        acc0 += b_s * r0
        acc1 += b_s * r1
        acc2 += b_s * r2
        acc3 += b_s * r3
    p_o = o_ptr + tl.program_id(1).to(tl.int64) * stride_os + o_n
    _gemv_store(p_o, acc0, bias_ptr, o_n, m_n, HAS_BIAS, SPLIT)
    if BLOCK_M > 1:
        _gemv_store(p_o + stride_om, acc1, bias_ptr, o_n, m_n & (o_n * 0 + 1 < M), HAS_BIAS, SPLIT)
    if BLOCK_M > 2:
        _gemv_store(p_o + 2 * stride_om, acc2, bias_ptr, o_n, m_n & (o_n * 0 + 2 < M), HAS_BIAS, SPLIT)
        _gemv_store(p_o + 3 * stride_om, acc3, bias_ptr, o_n, m_n & (o_n * 0 + 3 < M), HAS_BIAS, SPLIT)
    if FUSED:
        tl.debug_barrier()  # every thread's partial stores precede the ticket (released by the atomic)
        p_ticket = ticket_ptr + tl.program_id(0)
        if tl.atomic_add(p_ticket, 1, sem="acq_rel") == SPLITS - 1:
            for r in tl.static_range(BLOCK_M):
                _sum_splits(o_ptr + r * stride_om, bias_ptr, y_ptr + r * stride_ym, o_n, m_n & (o_n * 0 + r < M),
                            SPLITS, stride_os, HAS_BIAS, BLOCK_S)
            tl.atomic_xchg(p_ticket, 0)


@triton.jit
def _mma_tile_load(p_q, x_ptr, s_ptr, z_ptr, k0, k_hi, o_m, m_m, o_n, m_n, stride_xm, stride_sg, GROUP: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN: tl.constexpr):
    """One K tile of gptq_gemv_mma_kernel: codes [BLOCK_K, BLOCK_N], x^T [BLOCK_K, BLOCK_M], the group's
    scales and zeros [BLOCK_N] (rows at or past k_hi read as code 128 and x 0: they add nothing)."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m_k = o_k < k_hi
    if EVEN:  # K and N are multiples of the tile: rows only (whole tiles past k_hi)
        b_q = tl.load(p_q, mask=m_k[:, None], other=128)
    else:
        b_q = tl.load(p_q, mask=m_k[:, None] & m_n[None, :], other=128)
    b_x = tl.load(x_ptr + o_m[None, :] * stride_xm + o_k[:, None], mask=m_k[:, None] & m_m[None, :], other=0.)
    g_off = (tl.minimum(k0, k_hi - 1) // GROUP) * stride_sg  # scales [G, N] hold < 2**31 entries
    b_s = tl.load(s_ptr + g_off + o_n, mask=m_n, other=0.)
    b_z = b_s
    if HAS_ZERO:
        b_z = tl.load(z_ptr + g_off + o_n, mask=m_n, other=128.)
    return b_q, b_x, b_s, b_z


@triton.jit
def gptq_gemv_mma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, o_ptr, y_ptr, ticket_ptr, M, N, K, K_SPLIT,
                         GROUP: tl.constexpr, SPLITS, stride_xm, stride_qk, stride_sg, stride_os, stride_om, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, TILE_SCALE: tl.constexpr,
                         BLOCK_S: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
    """y^T = W^T x^T on fp16 tensor cores with the weight as the MMA's wide operand: a program's
    [BLOCK_N, BLOCK_K] weight tile is the 64-row side of the warpgroup MMA and the few rows of x the
    16-column side, so a weight byte costs about one instruction however many rows x has (x on the
    wide side, as in gptq_matmul_kernel, costs a shared-memory reshuffle of the weight per row tile).

    Codes become fp16 c - 128 exactly (bits 0x6400 | c are 1024 + c: one prmt per two codes, then one
    packed subtract); a zero point other than 128 comes in after the dot through the column sums of x:
    sum_k x (c - z) s = s (x.(c - 128) - (z - 128) sum_k x). Subtracting 1152 after the dot instead
    (column sums for every weight) measured more instructions: the sums cost a cross-warp reduction.
    TILE_SCALE: bf16 rows of x are scaled per tile by a power of two into fp16 range.
    Split-K over the grid's second axis as in gptq_gemv_kernel (FUSED: ticketed last-program sum)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    p_q = q_ptr + (k_lo + tl.arange(0, BLOCK_K))[:, None].to(tl.int64) * stride_qk + o_n[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        b_q, b_x, b_s, b_z = _mma_tile_load(p_q, x_ptr, s_ptr, z_ptr, k0, k_hi, o_m, m_m, o_n, m_n, stride_xm,
                                            stride_sg, GROUP, BLOCK_K, HAS_ZERO, EVEN)
        p_q += BLOCK_K * stride_qk
        b_x = b_x.to(tl.float32)  # x^T [BLOCK_K, BLOCK_M]
        if TILE_SCALE:
            b_r = tl.exp2(tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(b_x), axis=0), 1e-30) / 16384.)))
            b_xh = (b_x / b_r[None, :]).to(tl.float16)
        else:
            b_xh = b_x.to(tl.float16)
        b_w = codes_f16(b_q, ASM) - 1152.  # c - 128, exact
        b_d = tl.dot(tl.trans(b_w), b_xh)  # [BLOCK_N, BLOCK_M]
        if HAS_ZERO:
            b_d -= (b_z.to(tl.float32) - 128.)[:, None] * tl.sum(b_xh.to(tl.float32), axis=0)[None, :]
        if TILE_SCALE:
            b_d *= b_r[None, :]
        acc += b_d * b_s.to(tl.float32)[:, None]
    m_o = m_n[:, None] & m_m[None, :]
    if SPLIT:
        tl.store(o_ptr + tl.program_id(1).to(tl.int64) * stride_os + o_m[None, :] * stride_om + o_n[:, None], acc,
                 mask=m_o)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)[:, None]
        tl.store(y_ptr + o_m[None, :] * stride_ym + o_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=m_o)
    if FUSED:
        tl.debug_barrier()  # every thread's partial stores precede the ticket (released by the atomic)
        p_ticket = ticket_ptr + tl.program_id(0)
        if tl.atomic_add(p_ticket, 1, sem="acq_rel") == SPLITS - 1:
            for r in range(0, M):
                _sum_splits(o_ptr + r * stride_om, bias_ptr, y_ptr + r * stride_ym, o_n, m_n, SPLITS, stride_os,
                            HAS_BIAS, BLOCK_S)
            tl.atomic_xchg(p_ticket, 0)


@triton.jit
def _sum_splits(p_part, bias_ptr, p_y, o_n, m_n, SPLITS, stride_os, HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr):
    """y[o_n] = sum over splits of the partials (other programs wrote them: loads bypass L1)."""
    o_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([o_n.shape[0]], dtype=tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        m = ((s0 + o_s) < SPLITS)[:, None] & m_n[None, :]
        acc += tl.sum(tl.load(p_part + (s0 + o_s).to(tl.int64)[:, None] * stride_os + o_n[None, :], mask=m, other=0.,
                              cache_modifier=".cg"), axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)
    tl.store(p_y + o_n, acc.to(p_y.dtype.element_ty), mask=m_n)


@triton.jit
def _gemv_store(p_o, acc, bias_ptr, o_n, m_n, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    b_o = tl.sum(acc, axis=0)
    if SPLIT:
        tl.store(p_o, b_o, mask=m_n)
    else:
        if HAS_BIAS:
            b_o += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_n)


_TICKETS: dict[torch.device, torch.Tensor] = {}
MAX_TICKET_TILES = 4096


def split_tickets(device):
    """Zeroed per-column-tile counters for the fused split-K reduce (the kernel leaves them zero).
    Kept for the process: a captured CUDA graph holds their address. None while a graph is being
    captured before they exist (the caller then takes the two-launch path). One stream at a time."""
    buf = _TICKETS.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = _TICKETS[device] = torch.zeros(MAX_TICKET_TILES, dtype=torch.int32, device=device)
    return buf


def k_ranges(k, split, step):
    """K cut into about `split` ranges of whole `step`s: (ranges, rows per range)."""
    k_split = triton.cdiv(triton.cdiv(k, split), step) * step
    return triton.cdiv(k, k_split), k_split


def _split_k(x2, n, k, step, tiles, waves, fused):
    """Split K over about `waves` waves of programs: (splits, rows per split, fp32 partials [split, m, n]
    or None, tickets for the fused reduce or None)."""
    m = x2.shape[0]
    split = max(1, min(triton.cdiv(waves * num_sms(x2.device), tiles), triton.cdiv(k, step)))
    split, k_split = k_ranges(k, split, step)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else None
    tickets = split_tickets(x2.device) if fused and split > 1 and tiles <= MAX_TICKET_TILES else None
    return split, k_split, part, tickets


def sum_partials(part, bias, out):
    """The two-launch split-K reduce: out = sum over splits of part (+ bias)."""
    split, m, n = part.shape
    block = 1024
    split_sum_kernel[(triton.cdiv(m * n, block),)](part, bias if bias is not None else part, out, n, m * n, split,
                                                   part.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                                   BLOCK=block)


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
    vec = 8
    tiles = triton.cdiv(n, 32 * vec)
    split, k_split, part, tickets = _split_k(x2, n, k, step, tiles, cfg["waves"], cfg.get("fused"))
    part = out if part is None else part
    gptq_gemv_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, bias if bias is not None else w.scales,
        part, out, tickets if tickets is not None else part, m, n, k, k_split, w.group_size, split, x2.stride(0),
        w.qweight.stride(0), w.scales.stride(0), part.stride(0) if split > 1 else 0, part.stride(-2), out.stride(0),
        BLOCK_M=next_pow2(m), BLOCK_N=32 * vec, BLOCK_K=bk, NW=nw, VEC=vec, HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, SPLIT=split > 1, ASM=cfg["ASM"] and not interpreting(x2.device),
        FUSED=tickets is not None, BLOCK_S=min(next_pow2(split), 32), num_warps=nw, num_stages=1)
    if split > 1 and tickets is None:
        sum_partials(part, bias, out)
    return True


def gemv_mma(x2, w, bias, out, cfg):
    """out = x2 W^T (+ bias) for m <= 16 fp16/bf16 rows with gptq_gemv_mma_kernel; False when the groups do
    not allow a K tile of at least 16 rows."""
    m, k = x2.shape
    n = w.qweight.shape[1]
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    while w.group_size % bk:  # a K tile must lie in one group
        bk //= 2
        if bk < 16:
            return False
    tiles = triton.cdiv(n, bn)
    split, k_split, part, tickets = _split_k(x2, n, k, bk, tiles, cfg["waves"], cfg.get("fused"))
    gptq_gemv_mma_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, bias if bias is not None else w.scales,
        part if part is not None else out, out, tickets if tickets is not None else out, m, n, k, k_split,
        w.group_size, split, x2.stride(0), w.qweight.stride(0), w.scales.stride(0),
        part.stride(0) if part is not None else 0, part.stride(1) if part is not None else 0, out.stride(0),
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, HAS_ZERO=w.zeros is not None, HAS_BIAS=bias is not None,
        SPLIT=part is not None, FUSED=tickets is not None, TILE_SCALE=x2.dtype == torch.bfloat16,
        BLOCK_S=min(next_pow2(split), 32), ASM=not interpreting(x2.device), EVEN=k % bk == 0 and n % bn == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if part is not None and tickets is None:
        sum_partials(part, bias, out)
    return True
