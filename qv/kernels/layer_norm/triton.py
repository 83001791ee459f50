"""Triton LayerNorm: BLOCK_R rows a program, held whole in registers; mean and variance in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import jit_per_step, row_blocks, rows2d


@jit_per_step("N")
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
    block_r, block_d = row_blocks(n, d)
    if n:
        layer_norm_kernel[(triton.cdiv(n, block_r),)](
            x2, weight, bias, y, n, d, x2.stride(0), y.stride(0), eps, BLOCK_R=block_r, BLOCK_D=block_d)
    return y.view(shape)
