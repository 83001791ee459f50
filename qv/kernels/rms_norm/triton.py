"""Triton RMSNorm (+ residual add, zero-centred or plain weight): one program normalises BLOCK_R rows
held whole in registers (D <= 16K); statistics in fp32, results cast to the input dtype like the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import jit_per_step, row_blocks, rows2d


@jit_per_step("N")
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
    block_r, block_d = row_blocks(n, d)
    if n:
        rms_norm_kernel[(triton.cdiv(n, block_r),)](
            x2, r2, weight, y, s, n, d, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=4 if block_d <= 4096 else 8)
    if residual is None:
        return y.view(shape)
    return y.view(shape), s.view(shape)
