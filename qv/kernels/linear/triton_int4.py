"""Triton W4A16 linear over 4-bit GPTQ weights (GPTQWeight.bits == 4; GPTQ-Int4 and AWQ load into it).

Layout (qv/kernels/linear/__init__.py): codes uint8 [K/2, N], byte row r holding input 2r in its low nibble
and 2r + 1 in its high one; scales/zeros [G, N] (zeros None: symmetric, 8); g_idx [K].

Paths by rows M:
  M <= 64, sm_90     the raw-CUDA GEMV shared with 8-bit codes (cuda_sm90.py, gptq_gemv_mma.cu: the nibbles
                     split by masks after the loads), 16 rows a launch, sequential groups of 32/64/128;
                     otherwise:
  M < DEQUANT_MIN_M  int4_matmul_kernel: each program reads a [BLOCK_K/2, BLOCK_N] tile of packed bytes once,
                     splits it in registers into the even-row (low nibble) and odd-row (high nibble) code
                     tiles, dequantizes each ((c - z) s, exact c - z, one rounding) in x's dtype and takes
                     two tensor-core dots against x's even and odd columns. Sequential groups load one scale
                     row a tile; act-order weights (any g_idx, "GATHER") load each row's scale and zero.
                     Few rows: K split over the SMs, fp32 partials summed by a second launch.
  M >= DEQUANT_MIN_M W dequantized once into a [K, N] workspace in x's dtype (int4_dequant_kernel, no tl.dot,
                     any g_idx), then cuBLAS: prefill is compute bound, the 2.5 K*N bytes of extra traffic small.
fp32 activations dot in fp32 (ieee), so the fp32 path matches the reference to fp32 rounding.
The tiles below are first choices, not measured ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.linear import GPTQWeight, on_rows
from qv.kernels.linear.configs import gemv_cuda_config, gemv_kind
from qv.kernels.linear.cuda_sm90 import gemv_cuda
from qv.kernels.linear.triton_gemv import k_ranges, store_tile, sum_partials
from qv.kernels.triton_utils import interpreting, num_sms, output_tile

CUDA_ROWS = 64  # rows up to which the raw-CUDA GEMV runs, 16-row slices (sm_90)
DEQUANT_MIN_M = 1024  # rows from which the dequantized workspace + cuBLAS path runs (GPU)
MIN_BLOCK_K = 32  # two dots of BLOCK_K/2 >= 16 columns of x each


@triton.jit
def int4_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, o_ptr, M, N, K, K_SPLIT, GROUP,
    stride_xm, stride_qr, stride_sg, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
):
    o_m, o_n, m_m, m_n = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    cd = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_r = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed byte rows
        o_e = 2 * o_r  # even inputs (low nibbles); o_e + 1 the odd ones, inside K too since K is even
        m_r = o_e < k_hi
        b_p = tl.load(q_ptr + o_r[:, None].to(tl.int64) * stride_qr + o_n[None, :], mask=m_r[:, None] & m_n[None, :],
                      other=0)
        b_lo = (b_p & 15).to(tl.float32)
        b_hi = (b_p >> 4).to(tl.float32)
        m_x = m_m[:, None] & m_r[None, :]
        b_xe = tl.load(x_ptr + o_m[:, None] * stride_xm + o_e[None, :], mask=m_x, other=0.)
        b_xo = tl.load(x_ptr + o_m[:, None] * stride_xm + (o_e + 1)[None, :], mask=m_x, other=0.)
        if GATHER:
            m_w = m_r[:, None] & m_n[None, :]
            p_e = tl.load(g_ptr + o_e, mask=m_r, other=0).to(tl.int64)[:, None] * stride_sg + o_n[None, :]
            p_o = tl.load(g_ptr + o_e + 1, mask=m_r, other=0).to(tl.int64)[:, None] * stride_sg + o_n[None, :]
            s_e = tl.load(s_ptr + p_e, mask=m_w, other=0.).to(tl.float32)
            s_o = tl.load(s_ptr + p_o, mask=m_w, other=0.).to(tl.float32)
            if HAS_ZERO:
                z_e = tl.load(z_ptr + p_e, mask=m_w, other=0.).to(tl.float32)
                z_o = tl.load(z_ptr + p_o, mask=m_w, other=0.).to(tl.float32)
            else:
                z_e, z_o = 8., 8.
            w_lo = (b_lo - z_e) * s_e
            w_hi = (b_hi - z_o) * s_o
        else:  # the tile lies in one group (GROUP a multiple of BLOCK_K, K ranges in whole tiles)
            g_off = (k0 // GROUP).to(tl.int64) * stride_sg
            b_s = tl.load(s_ptr + g_off + o_n, mask=m_n, other=0.).to(tl.float32)
            if HAS_ZERO:
                b_z = tl.load(z_ptr + g_off + o_n, mask=m_n, other=0.).to(tl.float32)
            else:
                b_z = tl.full([BLOCK_N], 8., dtype=tl.float32)
            w_lo = (b_lo - b_z[None, :]) * b_s[None, :]
            w_hi = (b_hi - b_z[None, :]) * b_s[None, :]
        if F32_DOT:  # fp32 rows, and the interpreter (no bf16 arithmetic there)
            acc += tl.dot(b_xe.to(tl.float32), w_lo, input_precision="ieee")
            acc += tl.dot(b_xo.to(tl.float32), w_hi, input_precision="ieee")
        else:
            acc += tl.dot(b_xe, w_lo.to(cd))
            acc += tl.dot(b_xo, w_hi.to(cd))
    store_tile(acc, o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, stride_os, HAS_BIAS, SPLIT)


@triton.jit
def int4_dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, stride_qr, stride_sg, stride_wk,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr):
    """W[k, n] = (c - z) s in the workspace's dtype, any g_idx; CUDA cores only (no tl.dot: the sm70 chain
    runs it too)."""
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
        b_z = 8.
    b_p = tl.load(q_ptr + (o_k // 2)[:, None].to(tl.int64) * stride_qr + o_n[None, :], mask=m, other=0)
    b_c = ((b_p >> ((o_k % 2) * 4).to(tl.uint8)[:, None]) & 15).to(tl.float32)
    tl.store(w_ptr + o_k[:, None].to(tl.int64) * stride_wk + o_n[None, :],
             ((b_c - b_z) * b_s).to(w_ptr.dtype.element_ty), mask=m)


def dequantize_int4(w: GPTQWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a [K, N] matrix in `dtype` (one launch)."""
    k, n = w.in_features, w.out_features
    wd = torch.empty((k, n), dtype=dtype, device=w.qweight.device)
    bk, bn = (16, 32) if interpreting(w.qweight.device) else (32, 256)
    int4_dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, w.g_idx, wd, n, k, w.qweight.stride(0),
        w.scales.stride(0), wd.stride(0), BLOCK_K=bk, BLOCK_N=bn, HAS_ZERO=w.zeros is not None)
    return wd


def dequant_matmul_int4(x2, w, bias, out):
    """Large M (prefill), and the sm70 chain's fallback: W dequantized once, then cuBLAS."""
    wd = dequantize_int4(w, x2.dtype)
    if bias is not None:
        torch.addmm(bias.to(x2.dtype), x2, wd, out=out)
    else:
        torch.mm(x2, wd, out=out)


def int4_config(device, m):
    """int4_matmul_kernel's tiles by rows m (tiny under the interpreter so tests cross tile and split edges)."""
    if interpreting(device):
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, split=None, waves=2)
    if m <= 16:  # decode: memory bound; split-K so enough programs stream the weight
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, split=None, waves=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4, split=None, waves=2)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, split=1, waves=1)


def _gemv_slices(x2, w, bias, out, cfg) -> bool:
    """The raw-CUDA GEMV over rows 16 at a time (its widest tile): each slice reads the 4-bit codes again, which
    up to CUDA_ROWS rows costs less than the Triton tiles; False (nothing launched) where it does not apply."""
    for a in range(0, x2.shape[0], 16):
        if not gemv_cuda(x2[a:a + 16], w, bias, out[a:a + 16], cfg):
            if a:
                raise RuntimeError("int4_linear: the CUDA GEMV took the first rows and refused later ones")
            return False
    return True


def int4_linear(x, w, bias=None, config=None):
    """y = x W^T (+ bias) for a 4-bit GPTQWeight; `config` overrides int4_config's entries (and
    dequant_min_m, the rows from which the dequantize + cuBLAS path runs)."""
    k = x.shape[-1]
    if k != w.in_features or k % 2:
        raise ValueError(f"int4_linear: x has {k} inputs, the 4-bit weight {w.in_features} (an even count)")
    return on_rows(x, w.out_features, lambda x2, out: _int4_rows(x2, w, bias, out, config))


def _int4_rows(x2, w, bias, out, config) -> None:
    """int4_linear on 2-D rows into out (the paths by rows: module docstring)."""
    m, k = x2.shape
    n = out.shape[1]
    config = dict(config or {})
    kind = config.pop("kind", None) or ("cuda" if m <= CUDA_ROWS and gemv_kind(x2.device, 1, x2.dtype) == "cuda"
                                        else "triton")
    if kind not in ("cuda", "triton"):
        raise ValueError(f"int4_linear: kind {kind!r}; 4-bit weights run kind 'cuda' (the raw-CUDA GEMV) or 'triton'")
    if kind == "cuda":
        if _gemv_slices(x2, w, bias, out, dict(gemv_cuda_config(x2.device), **config)):
            return
        config = {}  # where the CUDA GEMV does not apply (act-order, odd shapes): the Triton kernel's defaults
    cfg = int4_config(x2.device, m)
    unknown = set(config) - set(cfg) - {"dequant_min_m"}
    if unknown:
        raise ValueError(f"int4_linear: unknown settings {sorted(unknown)} (the 4-bit kernel takes {sorted(cfg)})")
    cfg.update(config)
    if m >= cfg.pop("dequant_min_m", 1 << 30 if interpreting(x2.device) else DEQUANT_MIN_M):
        dequant_matmul_int4(x2, w, bias, out)
        return
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    gather = not w.is_sequential()
    while not gather and w.group_size % bk:  # a K tile must not straddle two groups
        bk //= 2
        if bk < MIN_BLOCK_K:
            gather, bk = True, MIN_BLOCK_K
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, waves = cfg.pop("split"), cfg.pop("waves")
    if split is None:  # about `waves` waves of programs over the SMs
        split = max(1, min(triton.cdiv(waves * num_sms(x2.device), tiles), k // (4 * bk)))
    split, k_split = k_ranges(k, split, bk)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    int4_matmul_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, w.g_idx,
        bias if bias is not None else w.scales, part, m, n, k, k_split, w.group_size,
        x2.stride(0), w.qweight.stride(0), w.scales.stride(0), part.stride(-2), part.stride(0) if split > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.pop("GROUP_M"), HAS_ZERO=w.zeros is not None,
        HAS_BIAS=bias is not None, GATHER=gather, SPLIT=split > 1,
        F32_DOT=interpreting(x2.device) or x2.dtype == torch.float32, **cfg)
    if split > 1:
        sum_partials(part, bias, out)
