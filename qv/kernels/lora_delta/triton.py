"""Triton low-rank delta over selected rows: a per-row kernel for few rows, two GEMMs for many."""

from __future__ import annotations

import triton
import triton.language as tl

from qv.kernels.lora_delta.configs import LORA_GEMM_ROWS
from qv.kernels.triton_utils import interpreting, next_pow2


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


def lora_delta(y, x, rows, a, b, scale):
    """In place on y (rows must be distinct); returns y. Few rows (decode): one program per (row,
    column block) recomputes x[row] A^T, cheap at small K * r. Many rows (a Clef record's prefill
    chunk, from configs.LORA_GEMM_ROWS on): that recompute costs N/256 * K * r multiply-adds per row on
    CUDA cores, so gather the rows and run (x_rows A^T) B^T as two GEMMs, adding to y in fp32."""
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
