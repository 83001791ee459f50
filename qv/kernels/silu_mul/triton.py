"""Triton SiLU-mul: one program per (row, BLOCK columns of the output)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import next_pow2, rows2d


@triton.jit
def silu_mul_kernel(x_ptr, o_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    o_i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o_i < I
    b_g = tl.load(x_ptr + i_r * stride_x + o_i, mask=m, other=0.).to(tl.float32)
    b_u = tl.load(x_ptr + i_r * stride_x + I + o_i, mask=m, other=0.).to(tl.float32)
    tl.store(o_ptr + i_r * stride_o + o_i, (b_g * tl.sigmoid(b_g) * b_u).to(o_ptr.dtype.element_ty), mask=m)


def silu_mul(x):
    shape = x.shape
    x2 = rows2d(x)
    n, half = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((n, half), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(half))
    if n and half:
        silu_mul_kernel[(n, triton.cdiv(half, block))](x2, out, half, x2.stride(0), out.stride(0), BLOCK=block)
    return out.view(*shape[:-1], half)
