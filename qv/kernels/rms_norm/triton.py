"""Triton row norms: RMSNorm (+ residual add, zero-centred or plain weight), gated RMSNorm and
LayerNorm. One program normalises BLOCK_R rows held whole in registers (D <= 16K); statistics
are fp32, results are cast to the input dtype like the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.registry import register
from qv.kernels.triton_utils import next_pow2, rows2d


def _row_blocks(n_rows: int, d: int) -> tuple[int, int]:
    block_d = next_pow2(d)
    block_r = max(1, min(16, 4096 // block_d))
    return block_r, block_d


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, N, D, stride_x, stride_r, stride_y, stride_s, eps,
                    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    o_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_r[:, None] < N) & (o_d[None, :] < D)
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.)
    if HAS_RESIDUAL:
        b_r = tl.load(r_ptr + o_r[:, None] * stride_r + o_d[None, :], mask=m, other=0.)
        # the sum is rounded to the activation dtype before it is normalised (and returned)
        b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + o_r[:, None] * stride_s + o_d[None, :], b_x, mask=m)
    b_x = b_x.to(tl.float32)
    b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_w = tl.load(w_ptr + o_d, mask=o_d < D, other=0.).to(tl.float32)
    if ZERO_CENTERED:
        b_w = 1.0 + b_w
    b_y = b_x * b_rstd[:, None] * b_w[None, :]
    tl.store(y_ptr + o_r[:, None] * stride_y + o_d[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x, weight, eps, residual=None, zero_centered=True):
    shape, d = x.shape, x.shape[-1]
    x2 = rows2d(x)
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    r2 = rows2d(residual) if residual is not None else x2
    s = torch.empty((n, d), dtype=x.dtype, device=x.device) if residual is not None else y
    block_r, block_d = _row_blocks(n, d)
    if n:
        rms_norm_kernel[(triton.cdiv(n, block_r),)](
            x2, r2, weight, y, s, n, d, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=4 if block_d <= 4096 else 8)
    if residual is None:
        return y.view(shape)
    return y.view(shape), s.view(shape)


@triton.jit
def gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, N, D, stride_x, stride_z, stride_y, eps,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    o_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_r[:, None] < N) & (o_d[None, :] < D)
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_z = tl.load(z_ptr + o_r[:, None] * stride_z + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_w = tl.load(w_ptr + o_d, mask=o_d < D, other=0.).to(tl.float32)
    b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_y = b_x * b_rstd[:, None] * b_w[None, :] * (b_z * tl.sigmoid(b_z))
    tl.store(y_ptr + o_r[:, None] * stride_y + o_d[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x, gate, weight, eps):
    shape, d = x.shape, x.shape[-1]
    x2, z2 = rows2d(x), rows2d(gate)
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block_r, block_d = _row_blocks(n, d)
    if n:
        gated_rms_norm_kernel[(triton.cdiv(n, block_r),)](
            x2, z2, weight, y, n, d, x2.stride(0), z2.stride(0), y.stride(0), eps, BLOCK_R=block_r, BLOCK_D=block_d)
    return y.view(shape)


@triton.jit
def layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, D, stride_x, stride_y, eps,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    o_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_r[:, None] < N) & (o_d[None, :] < D)
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_mean = tl.sum(b_x, axis=1) / D
    b_c = tl.where(m, b_x - b_mean[:, None], 0.)
    b_rstd = tl.math.rsqrt(tl.sum(b_c * b_c, axis=1) / D + eps)
    b_w = tl.load(w_ptr + o_d, mask=o_d < D, other=0.).to(tl.float32)
    b_b = tl.load(b_ptr + o_d, mask=o_d < D, other=0.).to(tl.float32)
    b_y = b_c * b_rstd[:, None] * b_w[None, :] + b_b[None, :]
    tl.store(y_ptr + o_r[:, None] * stride_y + o_d[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


def layer_norm(x, weight, bias, eps):
    shape, d = x.shape, x.shape[-1]
    x2 = rows2d(x)
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block_r, block_d = _row_blocks(n, d)
    if n:
        layer_norm_kernel[(triton.cdiv(n, block_r),)](
            x2, weight, bias, y, n, d, x2.stride(0), y.stride(0), eps, BLOCK_R=block_r, BLOCK_D=block_d)
    return y.view(shape)


register("rms_norm", "triton", rms_norm)
register("gated_rms_norm", "triton", gated_rms_norm)
register("layer_norm", "triton", layer_norm)
