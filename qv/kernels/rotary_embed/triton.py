"""Triton full-dim rotary with given cos/sin (the two halves of the angles may differ): one program
per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import next_pow2


@triton.jit
def rotary_embed_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, H, stride_xt, stride_xh, stride_ct, stride_st,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H).to(tl.int64)
    o_f = tl.arange(0, BLOCK_F)
    m_f = o_f < HALF
    m = (o_h[:, None] < H) & m_f[None, :]
    # the given angles may differ between the two halves, so both halves of cos/sin are read
    b_c1 = tl.load(cos_ptr + i_t * stride_ct + o_f, mask=m_f, other=0.).to(tl.float32)
    b_c2 = tl.load(cos_ptr + i_t * stride_ct + HALF + o_f, mask=m_f, other=0.).to(tl.float32)
    b_s1 = tl.load(sin_ptr + i_t * stride_st + o_f, mask=m_f, other=0.).to(tl.float32)
    b_s2 = tl.load(sin_ptr + i_t * stride_st + HALF + o_f, mask=m_f, other=0.).to(tl.float32)
    p_x = x_ptr + i_t * stride_xt + o_h[:, None] * stride_xh + o_f[None, :]
    b_x1 = tl.load(p_x, mask=m, other=0.).to(tl.float32)
    b_x2 = tl.load(p_x + HALF, mask=m, other=0.).to(tl.float32)
    b_y1 = b_x1 * b_c1[None, :] - b_x2 * b_s1[None, :]
    b_y2 = b_x2 * b_c2[None, :] + b_x1 * b_s2[None, :]
    p_o = o_ptr + i_t * H * 2 * HALF + o_h[:, None] * 2 * HALF + o_f[None, :]
    tl.store(p_o, b_y1.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(p_o + HALF, b_y2.to(o_ptr.dtype.element_ty), mask=m)


def rotary_embed(x, cos, sin):
    t, h, d = x.shape
    if d % 2:
        raise ValueError(f"rotary_embed: odd head dim {d}")
    xc = x if x.stride(-1) == 1 else x.contiguous()
    cos_ = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin_ = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        rotary_embed_kernel[(t,)](xc, cos_, sin_, out, h, xc.stride(0), xc.stride(1), cos_.stride(0),
                                  sin_.stride(0), HALF=d // 2, BLOCK_H=next_pow2(h), BLOCK_F=next_pow2(d // 2))
    return out
