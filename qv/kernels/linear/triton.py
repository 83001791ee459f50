"""Triton linear layers over GPTQ-int8 weights, and the per-row low-rank delta. Dense weights use
torch.nn.functional.linear (cuBLAS): nothing to gain there.

Weights are qv's GPTQ layout (linear.py): codes [K, N] uint8, scales/zeros [G, N], g_idx [K].
Paths by rows M (sequential groups, g_idx = k // group_size, unless noted):
  M <= 8      sm_90, fp16/bf16 rows: the raw-CUDA GEMV (linear_cuda.py, gptq_gemv_mma.cu; the weight is
              the wide operand of mma.sync), in CUDA graphs and for eager calls from 1 GiB of weight.
              Where it does not apply (no CuPy, group sizes other than 32/64/128, a smaller eager call:
              cuda_build.worth_launching): M = 1 as on other GPUs, M > 1 gptq_gemv_mma_kernel
              (linear_gemv.py, the same idea in Triton).
  M = 1       other GPUs: gptq_gemv_kernel (linear_gemv.py), CUDA-core FMAs streaming the codes.
  M <= 16     other GPUs, and 9..16 on sm_90: gptq_matmul_kernel, F16=1: raw codes on fp16 tensor cores,
              zero and scale applied once per tile and column after the dot (_f16_tile); split-K over the SMs.
  M < 1024    gptq_matmul_kernel, F16=2: each [BK, BN] tile dequantized in x's dtype for tl.dot; up to 64
              rows (decode batches) one row tile and split-K over the SMs.
  M >= 1024   W dequantized once into a [K, N] workspace in x's dtype, then cuBLAS (any g_idx): the
              dequantization costs ~3 K*N bytes of traffic, small next to 2*M*K*N FLOPs.
Codes become fp16 by bit tricks (no int->float instructions); bf16 activations are scaled into fp16
range by powers of two. fp32 activations and act-order weights (any g_idx, "GATHER") below the
cuBLAS threshold dequantize exactly in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qv.kernels.linear import GPTQWeight
from qv.kernels.linear_cuda import gemv_cuda, gemv_cuda_config
from qv.kernels.linear_gemv import (codes_f16, gemv_config, gemv_fma, gemv_mma, gemv_mma_config, k_ranges,
                                    sum_partials)
from qv.kernels.registry import register
from qv.kernels.triton_utils import interpreting, next_pow2, num_sms


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
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)  # GROUP_M row tiles sweep the columns together (L2 reuse of weights)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    o_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_m, m_n = o_m < M, o_n < N
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
    m_o = m_m[:, None] & m_n[None, :]
    if SPLIT:
        tl.store(o_ptr + tl.program_id(1).to(tl.int64) * stride_os + o_m[:, None] * stride_om + o_n[None, :], acc,
                 mask=m_o)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
        tl.store(o_ptr + o_m[:, None] * stride_om + o_n[None, :], acc.to(o_ptr.dtype.element_ty), mask=m_o)


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


def _dequant_matmul(x2, w, bias, out):
    """Large M (prefill): W dequantized once into a [K, N] workspace in x's dtype, then cuBLAS. The extra
    traffic (K*N codes read, 2 K*N bytes written and read) is small next to the 2*M*K*N FLOPs."""
    k, n = w.qweight.shape
    wd = torch.empty((k, n), dtype=x2.dtype, device=x2.device)
    bk, bn = (16, 32) if interpreting(x2.device) else (32, 256)
    gptq_dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, w.g_idx, wd, n, k, w.qweight.stride(0),
        w.scales.stride(0), wd.stride(0), BLOCK_K=bk, BLOCK_N=bn, HAS_ZERO=w.zeros is not None)
    if bias is not None:
        torch.addmm(bias.to(x2.dtype), x2, wd, out=out)
    else:
        torch.mm(x2, wd, out=out)


def _sequential_groups(w) -> bool:
    """Whether g_idx is k // group_size (checked once per weight; one host sync at first use)."""
    cached = getattr(w, "_qv_sequential", None)
    if cached is None:
        k = w.qweight.shape[0]
        expect = torch.arange(k, device=w.g_idx.device, dtype=torch.int64) // w.group_size
        cached = bool(torch.equal(w.g_idx.long(), expect))
        w._qv_sequential = cached
    return cached


def _gptq_config(device, m, n, k, group, f16):
    """Tiles (measured on the H200, bench/kernels.py --sweep; docs/BENCHMARKS.md)."""
    if interpreting(device):
        bk = 16 if group % 32 else 32
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=bk, GROUP_M=4, num_warps=4, num_stages=1, split=None)
    if m <= 16:  # decode: memory bound; enough programs in flight to stream the weight at full rate
        return dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4, split=None)
    if m <= 64 and f16:
        # decode batches: one row tile, bf16 rows to fp16 in one launch, codes by byte permutes, split-K over
        # the SMs; the MLP's long rows or wide outputs in narrower, deeper tiles (fastest in the H200 sweep of
        # bench/gemm_rows.py --sweep at the 27B shapes; numbers in docs/BENCHMARKS.md)
        tile = dict(BLOCK_N=64, BLOCK_K=128, waves=4) if n >= 32768 or k >= 16384 else dict(BLOCK_N=128, BLOCK_K=64,
                                                                                           waves=2)
        return dict(BLOCK_M=64, GROUP_M=1, num_warps=4, num_stages=4, split=None, x_f16=True, asm=True, **tile)
    if not f16:  # fp32 (ieee dots on FMA units) or act-order gathers
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2, split=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, split=1)


# the raw-CUDA GEMV up to this many rows: at 16 the Triton tiles read the 27B MLP weights faster
# (bench/gemm_rows.py --sweep)
CUDA_GEMV_ROWS = 8


def _gemv_kind(device, m, dtype):
    """Default kernel for few rows (bench/kernels.py --sweep gemv, docs/BENCHMARKS.md). On sm_90, where
    it was measured: the raw-CUDA GEMV ("cuda", linear_cuda.py; where it does not apply, "fma" at M = 1
    and its Triton twin "mma" in linear_gemv.py above, the next best there). Other GPUs keep the older
    kernels: "fma" (CUDA cores) at M = 1 and "dot" (x on the MMA's wide side) above."""
    if (m <= CUDA_GEMV_ROWS and dtype in (torch.float16, torch.bfloat16) and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9):
        return "cuda"
    return "fma" if m == 1 else "dot"


def gptq_linear(x, w, bias=None, config=None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w.qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*shape[:-1], n)
    sequential = _sequential_groups(w)
    config = dict(config or {})
    kind = config.pop("kind", None) or _gemv_kind(x.device, m, x.dtype)
    if kind == "cuda":
        if sequential and gemv_cuda(x2, w, bias, out, dict(gemv_cuda_config(x.device), **config)):
            return out.view(*shape[:-1], n)
        kind, config = ("fma" if m == 1 else "mma"), {}  # where it does not apply: the next best measured
    if kind == "fma" and m <= 4 and sequential:
        if gemv_fma(x2, w, bias, out, dict(gemv_config(x.device, m, n, k), **config)):
            return out.view(*shape[:-1], n)
    if kind == "mma" and m <= 16 and sequential and x.dtype in (torch.float16, torch.bfloat16):
        if gemv_mma(x2, w, bias, out, dict(gemv_mma_config(x.device), **config)):
            return out.view(*shape[:-1], n)
    if kind != "dot":  # that GEMV's settings do not apply to the paths below
        config = {}
    if m >= config.pop("dequant_min_m", 1 << 30 if interpreting(x.device) else 1024):
        _dequant_matmul(x2, w, bias, out)
        return out.view(*shape[:-1], n)
    f16 = sequential and x.dtype in (torch.float16, torch.bfloat16)
    cfg = dict(_gptq_config(x.device, m, n, k, w.group_size, f16), **(config or {}))
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
    asm = cfg.pop("asm", False) and not interpreting(x.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, waves = cfg.pop("split"), cfg.pop("waves", 4)
    if split is None:  # about `waves` waves of programs over the SMs
        split = max(1, min(triton.cdiv(waves * num_sms(x.device), tiles), k // (4 * bk)))
    split, k_split = k_ranges(k, split, bk)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    zeros = w.zeros if w.zeros is not None else w.scales
    gptq_matmul_kernel[(tiles, split)](
        x2, w.qweight, w.scales, zeros, w.g_idx, bias if bias is not None else w.scales,
        rows if rows is not None else w.scales, part, m, n, k, k_split,
        w.group_size, x2.stride(0), w.qweight.stride(0), w.scales.stride(0), part.stride(-2),
        part.stride(0) if split > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.pop("GROUP_M"), HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, GATHER=gather, F16=f16_mode,
        TILE_SCALE=f16_mode == 1 and x2.dtype == torch.bfloat16, SPLIT=split > 1,
        F32_DOT=interpreting(x.device) and x2.dtype == torch.bfloat16, ASM=asm, ROW_SCALE=rows is not None, **cfg)
    if split > 1:
        sum_partials(part, bias, out)
    return out.view(*shape[:-1], n)


def _linear_triton(x, weight, bias=None, *, config=None):
    if isinstance(weight, GPTQWeight):
        return gptq_linear(x, weight, bias, config)
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@triton.jit
def lora_delta_kernel(y_ptr, x_ptr, rows_ptr, a_ptr, b_ptr, scale, N, K, R,
                      stride_ym, stride_xm, stride_ar, stride_bn,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    b_t = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # t = x[row] A^T, recomputed per column block (r is small)
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_x = tl.load(x_ptr + row * stride_xm + o_k, mask=m_k, other=0.).to(tl.float32)
        b_a = tl.load(a_ptr + o_r[:, None] * stride_ar + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                      other=0.).to(tl.float32)
        b_t += tl.sum(b_a * b_x[None, :], axis=1)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_b = tl.load(b_ptr + o_n[:, None] * stride_bn + o_r[None, :], mask=m_n[:, None] & m_r[None, :],
                  other=0.).to(tl.float32)
    b_d = tl.sum(b_b * b_t[None, :], axis=1) * scale
    p_y = y_ptr + row * stride_ym + o_n
    b_y = tl.load(p_y, mask=m_n, other=0.).to(tl.float32)
    tl.store(p_y, (b_y + b_d).to(y_ptr.dtype.element_ty), mask=m_n)


LORA_GEMM_ROWS = 16  # from this many delta rows on, two tensor-core GEMMs beat the per-row kernel


def _lora_delta_triton(y, x, rows, a, b, scale):
    """In place on y (rows must be distinct); returns y. Few rows (decode): one program per (row,
    column block) recomputes x[row] A^T, cheap at small K * r. Many rows (a Clef record's prefill
    chunk): that recompute costs N/256 * K * r multiply-adds per row on CUDA cores (rank 256 on the
    27B shapes ran Clef prefill 25x slower than chat prefill on the H200), so gather the rows and
    run (x_rows A^T) B^T as two GEMMs, adding to y in fp32."""
    n, k = y.shape[-1], x.shape[-1]
    r = a.shape[0]
    if y.stride(-1) != 1 or x.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("lora_delta: tensors need a unit inner stride")
    if rows.numel() >= LORA_GEMM_ROWS:
        d = (x.index_select(0, rows) @ a.to(x.dtype).t()) @ b.to(x.dtype).t()
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + d.float() * scale).to(y.dtype))
    elif rows.numel():
        block_n = min(next_pow2(n), 32 if interpreting(y.device) else 256)
        lora_delta_kernel[(rows.numel(), triton.cdiv(n, block_n))](
            y, x, rows, a, b, float(scale), n, k, r, y.stride(0), x.stride(0), a.stride(0), b.stride(0),
            BLOCK_N=block_n, BLOCK_K=min(next_pow2(k), 128), BLOCK_R=next_pow2(r))
    return y


register("linear", "triton", _linear_triton)
register("lora_delta", "triton", _lora_delta_triton)
