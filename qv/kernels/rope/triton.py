"""Triton NeoX RoPE (partial, mRoPE interleaved or contiguous), in place on q and k: one program per
token rotates all its q and k heads with angles from a cached inverse-frequency table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import next_pow2


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
