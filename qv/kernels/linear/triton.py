"""Triton linear layers over GPTQ-int8 weights. Dense weights use torch.nn.functional.linear (cuBLAS):
nothing to gain there.

Weights are qv's GPTQ layout (GPTQWeight in __init__.py): codes [K, N] uint8, scales/zeros [G, N], g_idx [K].
Paths by rows M (sequential groups, g_idx = k // group_size, unless noted; configs.py holds the row limits
and the tiles):
  M <= 8      sm_90, fp16/bf16 rows: the raw-CUDA GEMV (cuda_sm90.py, gptq_gemv_mma.cu; the weight is
              the wide operand of mma.sync), in CUDA graphs and for eager calls from 1 GiB of weight.
              Where it does not apply (no CuPy, group sizes other than 32/64/128, a smaller eager call:
              cuda_build.worth_launching): M = 1 as on other GPUs, M > 1 gptq_gemv_mma_kernel
              (triton_gemv.py, the same idea in Triton).
  M = 1       other GPUs: gptq_gemv_kernel (triton_gemv.py), CUDA-core FMAs streaming the codes.
  M <= 16     other GPUs, and 9..16 on sm_90: gptq_matmul_kernel, F16=1: raw codes on fp16 tensor cores,
              zero and scale applied once per tile and column after the dot (_f16_tile); split-K over the SMs.
  M < 1024    gptq_matmul_kernel, F16=2: each [BK, BN] tile dequantized in x's dtype for tl.dot; up to 64
              rows (decode batches) one row tile and split-K over the SMs.
  M >= 1024   W dequantized once into a [K, N] workspace in x's dtype, then cuBLAS (any g_idx): the
              dequantization costs about 3 K*N bytes of traffic, small next to 2*M*K*N FLOPs.
Codes become fp16 by bit tricks (no int->float instructions); bf16 activations are scaled into fp16
range by powers of two. fp32 activations and act-order weights (any g_idx, "GATHER") below the
cuBLAS threshold dequantize exactly in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qv.kernels.linear import FP8Weight, GPTQWeight, W12Weight, on_rows
from qv.kernels.linear.configs import (chunked_cols, gemv_config, gemv_cuda_config, gemv_kind, gemv_mma_config,
                                      gptq_config, tc_config)
from qv.kernels.linear.cuda_sm90 import gemv_cuda
from qv.kernels.linear.triton_fp8 import fp8_linear
from qv.kernels.linear.triton_gemm import gemm, rows_to_f16
from qv.kernels.linear.triton_int4 import int4_linear
from qv.kernels.linear.triton_gemv import codes_f16, gemv_fma, gemv_mma, k_ranges, store_tile, sum_partials
from qv.kernels.triton_utils import interpreting, next_pow2, num_sms, output_tile


@triton.jit
def _f16_tile(b_x, b_q, s_ptr, z_ptr, g_off, o_n, m_n, HAS_ZERO: tl.constexpr, TILE_SCALE: tl.constexpr):
    """x [BM, BK] times one group's codes [BK, BN] on fp16 tensor cores, scaled after the dot.

    Codes become fp16 without int->float conversions (a quarter-rate unit that would bound the
    GEMV): the bits 0x6400 | c read as fp16 are 1024 + c exactly, and the 1024 + zero offset is
    removed with the row sums of x: sum_k x (c - z) s = s (x.(1024 + c) - (1024 + z) sum_k x).
    TILE_SCALE: bf16 activations are scaled per row and tile by a power of two into fp16 range."""
    b_s = tl.load(s_ptr + g_off + o_n, mask=m_n, other=0.).to(tl.float32)
    if HAS_ZERO:
        b_z = tl.load(z_ptr + g_off + o_n, mask=m_n, other=0.).to(tl.float32)
    else:
        b_z = tl.full(b_s.shape, 128., dtype=tl.float32)
    b_w = (b_q.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    if TILE_SCALE:
        b_xf = b_x.to(tl.float32)
        b_r = tl.exp2(tl.maximum(tl.ceil(tl.log2(tl.max(tl.abs(b_xf), axis=1) / 16384.)), 0.))
        b_x = (b_xf / b_r[:, None]).to(tl.float16)
    b_d = tl.dot(b_x, b_w)
    b_d = b_d * b_s[None, :] - tl.sum(b_x.to(tl.float32), axis=1)[:, None] * ((1024. + b_z) * b_s)[None, :]
    if TILE_SCALE:
        b_d *= b_r[:, None]
    return b_d


@triton.jit
def gptq_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, r_ptr, o_ptr, M, N, K, K_SPLIT, GROUP,
    stride_xm, stride_qk, stride_sg, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr, F16: tl.constexpr,  # 0, 1 or 2
    TILE_SCALE: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr, ASM: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    o_m, o_n, m_m, m_n = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    cd = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        b_x = tl.load(x_ptr + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
        b_q = tl.load(q_ptr + o_k[:, None].to(tl.int64) * stride_qk + o_n[None, :], mask=m_k[:, None] & m_n[None, :],
                      other=0)
        if F16 == 1:
            acc += _f16_tile(b_x, b_q, s_ptr, z_ptr, (k0 // GROUP).to(tl.int64) * stride_sg, o_n, m_n, HAS_ZERO,
                             TILE_SCALE)
        elif F16 == 2:  # GEMM: the tile dequantized in x's dtype ((1024 + c) - (1024 + z) is exact in fp16,
            # and |c - z| < 256 exact in bf16 too), so bf16 rows need no conversion pass before the kernel
            g_off = (k0 // GROUP).to(tl.int64) * stride_sg
            b_s = tl.load(s_ptr + g_off + o_n, mask=m_n, other=0.)
            if HAS_ZERO:
                b_z = tl.load(z_ptr + g_off + o_n, mask=m_n, other=0.).to(tl.float32)
            else:
                b_z = tl.full([BLOCK_N], 128., dtype=tl.float32)
            b_w = codes_f16(b_q, ASM) - (1024. + b_z).to(tl.float16)[None, :]
            if F32_DOT:  # Triton's interpreter has no bf16 arithmetic: the products in fp32
                acc += tl.dot(b_x.to(tl.float32), b_w.to(tl.float32) * b_s.to(tl.float32)[None, :],
                              input_precision="ieee")
            else:
                acc += tl.dot(b_x, b_w.to(cd) * b_s.to(cd)[None, :])
        elif GATHER:
            b_g = tl.load(g_ptr + o_k, mask=m_k, other=0).to(tl.int64)
            p_sz = b_g[:, None] * stride_sg + o_n[None, :]
            b_s = tl.load(s_ptr + p_sz, mask=m_k[:, None] & m_n[None, :], other=0.).to(tl.float32)
            if HAS_ZERO:
                b_z = tl.load(z_ptr + p_sz, mask=m_k[:, None] & m_n[None, :], other=0.).to(tl.float32)
            else:
                b_z = 128.
            acc += tl.dot(b_x, ((b_q.to(tl.float32) - b_z) * b_s).to(cd), input_precision="ieee")
        else:
            g = (k0 // GROUP).to(tl.int64)
            b_s = tl.load(s_ptr + g * stride_sg + o_n, mask=m_n, other=0.).to(tl.float32)
            if HAS_ZERO:
                b_z = tl.load(z_ptr + g * stride_sg + o_n, mask=m_n, other=0.).to(tl.float32)
            else:
                b_z = tl.full([BLOCK_N], 128., dtype=tl.float32)
            acc += tl.dot(b_x, ((b_q.to(tl.float32) - b_z[None, :]) * b_s[None, :]).to(cd), input_precision="ieee")
    if ROW_SCALE:  # rows that came in scaled by a power of two (rows_to_f16)
        acc *= tl.load(r_ptr + o_m, mask=m_m, other=1.)[:, None]
    store_tile(acc, o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, stride_os, HAS_BIAS, SPLIT)


@triton.jit
def gptq_dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, stride_qk, stride_sg, stride_wk,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr):
    """W[k, n] = (c - z) s in the activation dtype, any g_idx (for the large-M path: cuBLAS on W)."""
    o_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_k, m_n = o_k < K, o_n < N
    m = m_k[:, None] & m_n[None, :]
    b_g = tl.load(g_ptr + o_k, mask=m_k, other=0).to(tl.int64)
    p_sz = b_g[:, None] * stride_sg + o_n[None, :]
    b_s = tl.load(s_ptr + p_sz, mask=m, other=0.).to(tl.float32)
    if HAS_ZERO:
        b_z = tl.load(z_ptr + p_sz, mask=m, other=0.).to(tl.float32)
    else:
        b_z = 128.
    b_c = tl.load(q_ptr + o_k[:, None].to(tl.int64) * stride_qk + o_n[None, :], mask=m, other=0).to(tl.float32)
    tl.store(w_ptr + o_k[:, None].to(tl.int64) * stride_wk + o_n[None, :], ((b_c - b_z) * b_s).to(w_ptr.dtype.element_ty),
             mask=m)


def dequant_matmul(x2, w, bias, out, cols=None):
    """Prompt chunks: W dequantized in x's dtype `cols` output columns at a time (any g_idx) into a chunk that
    stays in L2, each chunk then multiplied by cuBLAS straight into its columns of out. Only the codes come
    from HBM: the 2-byte chunk is written and re-read in L2 (cols=None: the whole weight, written to HBM)."""
    k, n = w.qweight.shape
    cols = min(n, cols or n)
    wd = torch.empty((k, cols), dtype=x2.dtype, device=x2.device)
    bk, bn = (16, 32) if interpreting(x2.device) else (32, 256)
    for a in range(0, n, cols):
        c = min(cols, n - a)
        gptq_dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(c, bn))](
            w.qweight[:, a:], w.scales[:, a:], w.zeros[:, a:] if w.zeros is not None else w.scales, w.g_idx, wd, c,
            k, w.qweight.stride(0), w.scales.stride(0), wd.stride(0), BLOCK_K=bk, BLOCK_N=bn,
            HAS_ZERO=w.zeros is not None)
        if bias is not None:
            torch.addmm(bias[a:a + c].to(x2.dtype), x2, wd[:, :c], out=out[:, a:a + c])
        else:
            torch.mm(x2, wd[:, :c], out=out[:, a:a + c])


def gptq_linear(x, w, bias=None, config=None):
    if w.bits == 4:  # 4-bit weights: triton_int4.py
        return int4_linear(x, w, bias, config)
    return on_rows(x, w.qweight.shape[1], lambda x2, out: _gptq_rows(x2, w, bias, out, config))


def _gptq_rows(x2, w, bias, out, config) -> None:
    """gptq_linear on 2-D rows into out (the paths by rows: module docstring)."""
    m, k = x2.shape
    n = out.shape[1]
    sequential = w.is_sequential()
    config = dict(config or {})
    kind = config.pop("kind", None) or gemv_kind(x2.device, m, x2.dtype)
    if kind == "cuda":
        if gemv_cuda(x2, w, bias, out, dict(gemv_cuda_config(x2.device), **config)):  # it declines act-order
            return
        kind, config = ("fma" if m == 1 else "mma"), {}  # where it does not apply: the next best measured
    if kind == "fma" and m <= 4 and sequential:
        if gemv_fma(x2, w, bias, out, dict(gemv_config(x2.device, m, n, k), **config)):
            return
    if kind == "mma" and m <= 16 and sequential and x2.dtype in (torch.float16, torch.bfloat16):
        if gemv_mma(x2, w, bias, out, dict(gemv_mma_config(x2.device), **config)):
            return
    if kind == "tc":
        if gemm(x2, w, bias, out, dict(tc_config(x2.device, m), **config)):
            return
        # act-order weights (any g_idx: the chunked dequantization gathers their scales), unaligned tensors
        kind, config = ("chunked" if m > 64 else "dot"), {}
    if kind == "chunked":
        dequant_matmul(x2, w, bias, out, config.pop("cols", chunked_cols(x2.device, m)))
        return
    if kind != "dot":  # that GEMV's settings do not apply to the paths below
        config = {}
    if m >= config.pop("dequant_min_m", 1 << 30 if interpreting(x2.device) else 1024):
        dequant_matmul(x2, w, bias, out)
        return
    f16 = sequential and x2.dtype in (torch.float16, torch.bfloat16)
    cfg = dict(gptq_config(x2.device, m, n, k, w.group_size, f16), **(config or {}))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    gather = not sequential
    while not gather and w.group_size % bk:  # a K tile must not straddle two groups
        bk //= 2
        if bk < 16:
            gather, f16, bk = True, False, 32
    # tensor cores: scale after the dot for the GEMV (few rows; bf16 rows scaled into fp16 range per tile),
    # tiles dequantized in x's dtype for the GEMM
    f16_mode = cfg.pop("f16_mode", 1 if m <= 16 else 2) if f16 else 0
    rows = None
    if cfg.pop("x_f16", False) and f16_mode == 2 and x2.dtype == torch.bfloat16:
        x2, rows = rows_to_f16(x2)
    asm = cfg.pop("asm", False) and not interpreting(x2.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, waves = cfg.pop("split"), cfg.pop("waves", 4)
    if split is None:  # about `waves` waves of programs over the SMs
        split = max(1, min(triton.cdiv(waves * num_sms(x2.device), tiles), k // (4 * bk)))
    split, k_split = k_ranges(k, split, bk)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    zeros = w.zeros if w.zeros is not None else w.scales
    gptq_matmul_kernel[(tiles, split)](
        x2, w.qweight, w.scales, zeros, w.g_idx, bias if bias is not None else w.scales,
        rows if rows is not None else w.scales, part, m, n, k, k_split,
        w.group_size, x2.stride(0), w.qweight.stride(0), w.scales.stride(0), part.stride(-2),
        part.stride(0) if split > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.pop("GROUP_M"), HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, GATHER=gather, F16=f16_mode,
        TILE_SCALE=f16_mode == 1 and x2.dtype == torch.bfloat16, SPLIT=split > 1,
        F32_DOT=interpreting(x2.device) and x2.dtype == torch.bfloat16, ASM=asm, ROW_SCALE=rows is not None, **cfg)
    if split > 1:
        sum_partials(part, bias, out)


def linear(x, weight, bias=None, *, config=None):
    if isinstance(weight, GPTQWeight):
        return gptq_linear(x, weight, bias, config)
    if isinstance(weight, (FP8Weight, W12Weight)):  # block-FP8 and 12-bit weights: triton_fp8.py
        return fp8_linear(x, weight, bias, config)
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
