"""GPTQ-int8 GEMM on tensor cores for decode batches and short prompt chunks (9-64 rows on sm_90 by default;
configs.CHUNKED_ROWS says why not more): the codes are converted in registers and fed to tl.dot (wgmma on
Hopper), never written back as a dequantized weight.

Per K tile: uint8 codes [BK, BN] -> fp16 1024 + c by byte permutes (codes_f16), minus 1024 + z (exact:
|c - z| < 256), times the group's scale in the MMA's dtype. With fp16 activations (bf16 rows are scaled
into fp16 range by a power of two per row first, rows_to_f16: fp16's 10 mantissa bits hold the weight
products better than bf16's 7) the whole conversion is three instructions per pair of codes.

Hopper's copy engine (TMA) brings the x and code tiles in (tensor descriptors; rows past M and K arrive as
zeros, so no masks), pipelined STAGES deep; the grid is the (row tile, column tile) pairs, grouped so row
tiles sharing a weight tile run together (L2 reuse), times a split of K where the pairs alone would leave
SMs idle (fp32 partials, summed in split order by sum_partials: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.linear.triton_gemv import codes_f16, k_ranges, store_tile, sum_partials
from qv.kernels.triton_utils import grouped_tile, interpreting, next_pow2, num_sms


@triton.jit
def gptq_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, r_ptr, bias_ptr, o_ptr, M, N, K, K_SPLIT, GROUP,
    stride_xm, stride_qk, stride_sg, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, SPLIT: tl.constexpr,
    TMA: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, F32_DOT: tl.constexpr, SWAP: tl.constexpr = False,
):
    """x_ptr/q_ptr: tensor descriptors of x [M, K] and the codes [K, N] when TMA, else pointers (K a multiple
    of BLOCK_K there). A K tile lies in one scale group (BLOCK_K divides GROUP)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    o_m = off_m + tl.arange(0, BLOCK_M)
    o_n = off_n + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    if SWAP:  # acc^T = W x^T: the converted weight is the MMA's A operand, which wgmma reads from registers
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if TMA:
            b_x = x_ptr.load([off_m, k0])
            b_q = q_ptr.load([k0, off_n])
        else:
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_x = tl.load(x_ptr + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :], mask=m_m[:, None], other=0.)
            b_q = tl.load(q_ptr + o_k[:, None].to(tl.int64) * stride_qk + o_n[None, :], mask=m_n[None, :], other=0)
        g_off = (k0 // GROUP).to(tl.int64) * stride_sg
        b_s = tl.load(s_ptr + g_off + o_n, mask=m_n, other=0.)
        if HAS_ZERO:
            b_z = (tl.load(z_ptr + g_off + o_n, mask=m_n, other=0.).to(tl.float32) + 1024.).to(tl.float16)
        else:
            b_z = tl.full([BLOCK_N], 1152., dtype=tl.float16)  # 1024 + the symmetric zero 128
        if SWAP:  # the weight tile [BN, BK]: scales per row
            b_w = codes_f16(tl.trans(b_q), ASM) - b_z[:, None]
            b_sw = b_s[:, None]
        else:
            b_w = codes_f16(b_q, ASM) - b_z[None, :]
            b_sw = b_s[None, :]
        if F32_DOT:  # Triton's interpreter has no bf16 arithmetic: the products in fp32
            b_w = b_w.to(tl.float32) * b_sw.to(tl.float32)
            if SWAP:
                acc = tl.dot(b_w, tl.trans(b_x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(b_x.to(tl.float32), b_w, acc, input_precision="ieee")
        else:
            b_w = b_w.to(b_x.dtype) * b_sw.to(b_x.dtype)
            if SWAP:
                acc = tl.dot(b_w, tl.trans(b_x), acc)
            else:
                acc = tl.dot(b_x, b_w, acc)
    if SWAP:
        acc = tl.trans(acc)
    if ROW_SCALE:  # rows that came in scaled by a power of two (rows_to_f16)
        acc *= tl.load(r_ptr + o_m, mask=m_m, other=1.)[:, None]
    store_tile(acc, o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, stride_os, HAS_BIAS, SPLIT)


@triton.jit
def rows_to_f16_kernel(x_ptr, y_ptr, r_ptr, K, stride_x, stride_y, BLOCK: tl.constexpr):
    """One row: its max to (8192, 16384] by a power of two r (at least 1), y = x / r in fp16."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        o = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.).to(tl.float32)))
    r = tl.exp2(tl.maximum(tl.ceil(tl.log2(tl.max(amax) / 16384.)), 0.))
    for k0 in range(0, K, BLOCK):
        o = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.).to(tl.float32)
        tl.store(y_ptr + row * stride_y + o, (v / r).to(tl.float16), mask=o < K)
    tl.store(r_ptr + row, r)


def rows_to_f16(x2):
    """bf16 rows -> (fp16 rows scaled into range, fp32 scale per row): one launch."""
    m, k = x2.shape
    y = torch.empty((m, k), dtype=torch.float16, device=x2.device)
    r = torch.empty(m, dtype=torch.float32, device=x2.device)
    rows_to_f16_kernel[(m,)](x2, y, r, k, x2.stride(0), y.stride(0), BLOCK=min(next_pow2(k), 1024))
    return y, r


def applies(x2, w) -> bool:
    """Sequential groups, fp16/bf16 rows on a CUDA GPU with TMA-aligned tensors (the host checks the group)."""
    k, n = w.qweight.shape
    return ((x2.is_cuda or interpreting(x2.device)) and x2.dtype in (torch.float16, torch.bfloat16)
            and w.is_sequential()
            and n % 16 == 0 and k % 8 == 0 and w.qweight.stride(-1) == 1 and x2.stride(-1) == 1
            and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 and w.qweight.data_ptr() % 16 == 0
            and w.qweight.stride(0) % 16 == 0)


def gemm(x2, w, bias, out, cfg) -> bool:
    """out = x2 W^T (+ bias); False (nothing launched) where it does not apply. cfg: BLOCK_M/N/K, GROUP_M,
    num_warps, STAGES, waves (split K until the pairs x splits fill about that many rounds of the SMs), f16
    (bf16 rows to fp16 first), tma."""
    if not applies(x2, w):
        return False
    cfg = dict(cfg)
    m, k = x2.shape
    n = w.qweight.shape[1]
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    while w.group_size % bk:  # a K tile must not straddle two groups
        bk //= 2
        if bk < 16:
            return False
    rows = None
    if cfg.pop("f16", True) and x2.dtype == torch.bfloat16:
        x2, rows = rows_to_f16(x2)
    tma = cfg.pop("tma", True) and not interpreting(x2.device)
    if not tma and k % bk:
        return False
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    waves = cfg.pop("waves", 1)
    split = cfg.pop("split", None) or max(1, min(triton.cdiv(waves * num_sms(x2.device), tiles), k // (2 * bk)))
    split, k_split = k_ranges(k, split, bk)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    xa, qa = x2, w.qweight
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        xa, qa = TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(w.qweight, [bk, bn])
    gptq_gemm_kernel[(tiles, split)](
        xa, qa, w.scales, w.zeros if w.zeros is not None else w.scales, rows if rows is not None else w.scales,
        bias if bias is not None else w.scales, part, m, n, k, k_split, w.group_size, x2.stride(0),
        w.qweight.stride(0), w.scales.stride(0), part.stride(-2), part.stride(0) if split > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.pop("GROUP_M", 8), HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, ROW_SCALE=rows is not None, SPLIT=split > 1, TMA=tma,
        STAGES=cfg.pop("STAGES", 4), ASM=not interpreting(x2.device),
        F32_DOT=interpreting(x2.device) and x2.dtype == torch.bfloat16, **cfg)
    if split > 1:
        sum_partials(part, bias, out)
    return True
