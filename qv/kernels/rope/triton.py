"""Triton elementwise ops: SiLU-mul, sigmoid gate, GELU, NeoX RoPE (partial, mRoPE interleaved or
contiguous; in place on q and k) and the vision tower's full-dim rotary with given cos/sin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.registry import register
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


# ---------------------------------------------------------------------------------------------
# rotary
# ---------------------------------------------------------------------------------------------

_rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_table(device, rotary_dim, theta, mrope_section, interleaved):
    """inv_freq [half] fp32 (fp64 powers, like the reference) and the position row of each slot [half]."""
    key = (str(device), rotary_dim, float(theta), tuple(mrope_section or ()), bool(interleaved))
    if key not in _rope_tables:
        half = rotary_dim // 2
        inv = (1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))).float()
        axis = torch.zeros(half, dtype=torch.int32)
        if mrope_section is not None:
            if interleaved:
                for dim, offset in ((1, 1), (2, 2)):
                    axis[offset: mrope_section[dim] * 3: 3] = dim
            else:
                axis[mrope_section[0]: mrope_section[0] + mrope_section[1]] = 1
                axis[mrope_section[0] + mrope_section[1]:] = 2
        _rope_tables[key] = (inv.to(device), axis.to(device))
    return _rope_tables[key]


@triton.jit
def _rotate_heads(x_ptr, i_t, H, stride_t, stride_h, b_cos, b_sin, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr):
    o_h = tl.arange(0, BLOCK_H).to(tl.int64)
    o_f = tl.arange(0, BLOCK_F)
    m = (o_h[:, None] < H) & (o_f[None, :] < HALF)
    p_x1 = x_ptr + i_t * stride_t + o_h[:, None] * stride_h + o_f[None, :]
    b_x1 = tl.load(p_x1, mask=m, other=0.).to(tl.float32)
    b_x2 = tl.load(p_x1 + HALF, mask=m, other=0.).to(tl.float32)
    b_y1 = b_x1 * b_cos[None, :] - b_x2 * b_sin[None, :]
    b_y2 = b_x2 * b_cos[None, :] + b_x1 * b_sin[None, :]
    tl.store(p_x1, b_y1.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(p_x1 + HALF, b_y2.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def rope_kernel(q_ptr, k_ptr, pos_ptr, inv_ptr, axis_ptr, HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_p, HALF: tl.constexpr, MROPE: tl.constexpr, BLOCK_HQ: tl.constexpr,
                BLOCK_HK: tl.constexpr, BLOCK_F: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_f = tl.arange(0, BLOCK_F)
    m_f = o_f < HALF
    b_inv = tl.load(inv_ptr + o_f, mask=m_f, other=0.)
    if MROPE:
        b_axis = tl.load(axis_ptr + o_f, mask=m_f, other=0).to(tl.int64)
        b_pos = tl.load(pos_ptr + b_axis * stride_p + i_t, mask=m_f, other=0).to(tl.float32)
    else:
        b_pos = tl.load(pos_ptr + i_t + o_f * 0).to(tl.float32)
    b_ang = b_pos * b_inv
    b_cos, b_sin = tl.cos(b_ang), tl.sin(b_ang)
    _rotate_heads(q_ptr, i_t, HQ, stride_qt, stride_qh, b_cos, b_sin, HALF, BLOCK_HQ, BLOCK_F)
    _rotate_heads(k_ptr, i_t, HK, stride_kt, stride_kh, b_cos, b_sin, HALF, BLOCK_HK, BLOCK_F)


def rope(q, k, positions, rotary_dim, theta, mrope_section=None, mrope_interleaved=False):
    """Rotates q and k in place (when their inner dim is contiguous) and returns them."""
    q_ = q if q.stride(-1) == 1 else q.contiguous()
    k_ = k if k.stride(-1) == 1 else k.contiguous()
    t, half = q.shape[0], rotary_dim // 2
    mrope = positions.dim() == 2 and mrope_section is not None
    if positions.dim() == 2 and not mrope:
        positions = positions[0]  # (t, h, w) without sections: the temporal row, like the reference
    inv, axis = _rope_table(q.device, rotary_dim, theta, mrope_section if mrope else None, mrope_interleaved)
    pos = positions if positions.stride(-1) == 1 else positions.contiguous()
    if t and half:
        rope_kernel[(t,)](q_, k_, pos, inv, axis, q.shape[1], k.shape[1], q_.stride(0), q_.stride(1),
                          k_.stride(0), k_.stride(1), pos.stride(0) if mrope else 0, HALF=half, MROPE=mrope,
                          BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_HK=next_pow2(k.shape[1]),
                          BLOCK_F=next_pow2(half))
    return q_, k_


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


register("silu_mul", "triton", silu_mul)
register("sigmoid_mul", "triton", sigmoid_mul)
register("gelu", "triton", gelu)
register("rope", "triton", rope)
register("rotary_embed", "triton", rotary_embed)
