"""GPTQ-int8 GEMV on CUDA cores for decode (M <= 4 rows), and the split-K partial-sum pass shared
with the tensor-core kernels of linear_gptq.py.

Decode reads every weight byte once per step, so the kernel is built to stream codes at HBM rate:
vector loads of 8 codes per thread, all loads of a step issued before any use, no tensor-core tiles
(with M <= 4 their layout shuffles through shared memory cost more than the FMAs), fp32 FMAs
straight into per-thread partial sums; split-K over a (column tile, K range) grid whose column tile
varies fastest, so programs running together read whole rows of the weight; the partials are summed
by the last program of each column tile (fused, the default) or by split_sum_kernel, both in split
order (deterministic). Used for M = 1 by default: at M = 4 the FMAs (about 7 instructions per
weight byte) make it issue-bound and the tensor-core kernel is faster (docs/BENCHMARKS.md).
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


def gemv_config(device, m, n, k):
    """CUDA-core GEMV settings, measured on the H200 (bench/kernels.py --sweep gemv, docs/BENCHMARKS.md):
    4-warp programs over 8 waves of the SMs; narrow outputs (< 64 column tiles, so long K ranges per
    program) take 16 rows a warp per step (33.5-34.2 vs 34.9-35.2 us at 17408->5120 against 8-warp
    programs of 8 rows over 4 waves; at 5120->34816 16 rows measured 64.7 vs 59 us). The split-K
    partials are summed by the last program of each column tile (fused)."""
    if interpreting(device):
        return dict(NW=2, BK=4, waves=2, ASM=False, fused=True)
    if triton.cdiv(n, 256) >= 64:  # fused split-K reduce: 59 vs 62 us at 5120->34816, 35.5 vs 38.6 at 17408->5120
        return dict(NW=4, BK=8, waves=8, ASM=True, fused=True)
    return dict(NW=4, BK=16, waves=8, ASM=True, fused=True)


_TICKETS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 4096


def _tickets(device):
    """Zeroed per-column-tile counters for the fused split-K reduce (the kernel leaves them zero).
    Kept for the process: a captured CUDA graph holds their address. None while a graph is being
    captured before they exist (the caller then takes the two-launch path). One stream at a time."""
    buf = _TICKETS.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = _TICKETS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return buf


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
    split = max(1, min(triton.cdiv(cfg["waves"] * num_sms(x2.device), tiles), triton.cdiv(k, step)))
    k_split = triton.cdiv(triton.cdiv(k, split), step) * step
    split = triton.cdiv(k, k_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    tickets = _tickets(x2.device) if cfg.get("fused") and split > 1 and tiles <= _MAX_TILES else None
    gptq_gemv_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, bias if bias is not None else w.scales,
        part, out, tickets if tickets is not None else part, m, n, k, k_split, w.group_size, split, x2.stride(0),
        w.qweight.stride(0), w.scales.stride(0), part.stride(0) if split > 1 else 0, part.stride(-2), out.stride(0),
        BLOCK_M=next_pow2(m), BLOCK_N=32 * vec, BLOCK_K=bk, NW=nw, VEC=vec, HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, SPLIT=split > 1, ASM=cfg["ASM"] and not interpreting(x2.device),
        FUSED=tickets is not None, BLOCK_S=min(next_pow2(split), 32), num_warps=nw, num_stages=1)
    if split > 1 and tickets is None:
        block = 1024
        split_sum_kernel[(triton.cdiv(m * n, block),)](part, bias if bias is not None else part, out, n, m * n, split,
                                                       part.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                                       BLOCK=block)
    return True
