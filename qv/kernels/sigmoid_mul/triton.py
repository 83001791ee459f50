"""Triton sigmoid gate: one program per (row, BLOCK columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import next_pow2, rows2d


@triton.jit
def sigmoid_mul_kernel(x_ptr, g_ptr, o_ptr, D, stride_x, stride_g, stride_o, BLOCK: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o_d < D
    b_x = tl.load(x_ptr + i_r * stride_x + o_d, mask=m, other=0.).to(tl.float32)
    b_g = tl.load(g_ptr + i_r * stride_g + o_d, mask=m, other=0.).to(tl.float32)
    tl.store(o_ptr + i_r * stride_o + o_d, (b_x * tl.sigmoid(b_g)).to(o_ptr.dtype.element_ty), mask=m)


def sigmoid_mul(x, gate):
    shape = x.shape
    x2, g2 = rows2d(x), rows2d(gate)
    n, d = x2.shape
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(d))
    if n and d:
        sigmoid_mul_kernel[(n, triton.cdiv(d, block))](x2, g2, out, d, x2.stride(0), g2.stride(0), out.stride(0),
                                                       BLOCK=block)
    return out.view(shape)
