"""Triton GELU over the flattened tensor, 1024 elements a program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gelu_kernel(x_ptr, o_ptr, N, TANH: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_x = tl.load(x_ptr + o, mask=m, other=0.).to(tl.float32)
    if TANH:
        b_u = 0.7978845608028654 * (b_x + 0.044715 * b_x * b_x * b_x)
        b_t = 2.0 * tl.sigmoid(2.0 * b_u) - 1.0  # tanh without libdevice (the interpreter lacks it)
        b_y = 0.5 * b_x * (1.0 + b_t)
    else:
        b_y = 0.5 * b_x * (1.0 + tl.math.erf(b_x * 0.7071067811865476))
    tl.store(o_ptr + o, b_y.to(o_ptr.dtype.element_ty), mask=m)


def gelu(x, approximate="none"):
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        gelu_kernel[(triton.cdiv(n, 1024),)](xc, out, n, TANH=approximate == "tanh", BLOCK=1024)
    return out
