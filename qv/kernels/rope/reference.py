"""fp32 RoPE / mRoPE: the oracle of rope. `rotate` is shared with rotary_embed's reference."""

from __future__ import annotations

import torch


def rope_angles(positions, rotary_dim, theta, mrope_section=None, mrope_interleaved=False):
    """Angles [T, rotary_dim // 2] (fp32) for 1-D positions [T] or (t, h, w) positions [3, T]."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim))
    inv_freq = inv_freq.float()
    if positions.dim() == 1:
        return positions.float()[:, None] * inv_freq[None, :]
    freqs = positions.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, half]
    if mrope_section is None:
        return freqs[0]
    axis = torch.zeros(half, dtype=torch.long, device=positions.device)
    if mrope_interleaved:  # slots T H W T H W ... ; H and W only within 3 * their section
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset : mrope_section[dim] * 3 : 3] = dim
    else:  # contiguous sections [T | H | W]
        axis[mrope_section[0] : mrope_section[0] + mrope_section[1]] = 1
        axis[mrope_section[0] + mrope_section[1] :] = 2
    return freqs.gather(0, axis[None, None, :].expand(1, freqs.shape[1], half))[0]


def rotate(x, cos, sin, rotary_dim):
    xf = x.float()
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1).to(x.dtype)


def rope(q, k, positions, rotary_dim, theta, mrope_section=None, mrope_interleaved=False):
    ang = rope_angles(positions, rotary_dim, theta, mrope_section, mrope_interleaved)
    emb = torch.cat([ang, ang], dim=-1)[:, None, :]  # [T, 1, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    return rotate(q, cos, sin, rotary_dim), rotate(k, cos, sin, rotary_dim)
