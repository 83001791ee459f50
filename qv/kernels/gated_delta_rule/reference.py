"""Pure-PyTorch fp32 definitions of every op. This file IS the spec of each kernel.

Each function has the same name and arguments as its public wrapper in qv.kernels (whose
docstring gives the shapes). Everything is computed in float32 with exact softmax and no
tricks; results are cast to the activation dtype at the end. Ops that update caches or
states in place do so here too, so a kernel and its reference can be compared on both the
output and the updated state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qv.kernels.registry import register

INT16_MAX = 32767.0
INT8_MAX = 127.0


def _ref(fn):
    return register(fn.__name__, "reference", fn)


# ---------------------------------------------------------------------------------------------
# norms and elementwise
# ---------------------------------------------------------------------------------------------


@_ref
def rms_norm(x, weight, eps, residual=None, zero_centered=True):
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    y = y * (1.0 + w) if zero_centered else y * w
    return y.to(x.dtype) if residual is None else (y.to(x.dtype), x)


@_ref
def gated_rms_norm(x, gate, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.float() * F.silu(gate.float())
    return y.to(x.dtype)


@_ref
def silu_mul(x):
    half = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)


@_ref
def sigmoid_mul(x, gate):
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


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


def _rotate(x, cos, sin, rotary_dim):
    xf = x.float()
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1).to(x.dtype)


@_ref
def rope(q, k, positions, rotary_dim, theta, mrope_section=None, mrope_interleaved=False):
    ang = rope_angles(positions, rotary_dim, theta, mrope_section, mrope_interleaved)
    emb = torch.cat([ang, ang], dim=-1)[:, None, :]  # [T, 1, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------


def dequantize_gptq(w) -> torch.Tensor:
    """fp32 [N, K] weight of a GPTQWeight: w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]."""
    q = w.qweight.float()  # [K, N]
    zeros = torch.full_like(w.scales, 128.0, dtype=torch.float32) if w.zeros is None else w.zeros.float()
    g = w.g_idx.long()
    deq = (q - zeros[g]) * w.scales.float()[g]
    return deq.t()


@_ref
def linear(x, weight, bias=None):
    from qv.kernels.linear import GPTQWeight

    w = dequantize_gptq(weight) if isinstance(weight, GPTQWeight) else weight.float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@_ref
def lora_delta(y, x, rows, a, b, scale):
    xs = x[rows].float()  # index_copy, not y[rows] = ...: CPU index_put is ~10x slower at each new shape
    return y.index_copy(0, rows, (y[rows].float() + (xs @ a.float().t()) @ b.float().t() * scale).to(y.dtype))


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------


def _seq_bounds(cu_seqlens):
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


@_ref
def causal_conv1d(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state, activation=True,
                  max_query_len=None):
    width = weight.shape[1]
    out = torch.empty_like(x)
    wf = weight.float()
    for i, (s, e) in enumerate(_seq_bounds(cu_seqlens)):
        slot = int(state_slots[i])
        prev = conv_state[slot].float() if bool(has_initial_state[i]) else x.new_zeros(width - 1, x.shape[1], dtype=torch.float32)
        seq = torch.cat([prev, x[s:e].float()], dim=0)  # [width-1+L, C]
        if e > s:
            windows = seq.unfold(0, width, 1)  # [L, C, width]
            y = (windows * wf[None]).sum(-1)
            out[s:e] = (F.silu(y) if activation else y).to(x.dtype)
        conv_state[slot] = seq[seq.shape[0] - (width - 1) :].to(conv_state.dtype)
    return out


def load_state(state, state_scale, slot):
    """fp32 [H, dk, dv] value of one state slot (int16 codes times their per-column scale)."""
    if state.dtype == torch.int16:
        return state[slot].float() * state_scale[slot][:, None, :]
    return state[slot].float()


def store_state(state, state_scale, slot, value):
    """Write fp32 [H, dk, dv] into a slot; int16 uses a uniform grid with one scale per (head, column)."""
    if state.dtype == torch.int16:
        scale = value.abs().amax(dim=1).clamp_min(1e-30) / INT16_MAX  # [H, dv]
        state_scale[slot] = scale
        state[slot] = torch.round(value / scale[:, None, :]).clamp(-INT16_MAX, INT16_MAX).to(torch.int16)
    else:
        state[slot] = value.to(state.dtype)


@_ref
def gated_delta_rule(
    q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state,
    scale=None, state_scale=None, intermediate_states=None, max_query_len=None,
):
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // hk
    scale = dk**-0.5 if scale is None else scale
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    g_all = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())  # [T, Hv]
    beta_all = torch.sigmoid(b.float())
    for i, (s, e) in enumerate(_seq_bounds(cu_seqlens)):
        slot = int(state_slots[i])
        h = load_state(state, state_scale, slot) if bool(has_initial_state[i]) else torch.zeros(hv, dk, dv, device=v.device)
        qf = q[s:e].float().repeat_interleave(rep, dim=1)
        kf = k[s:e].float().repeat_interleave(rep, dim=1)
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * scale
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
        vf = v[s:e].float()
        for t in range(e - s):
            h = h * torch.exp(g_all[s + t])[:, None, None]
            kv_mem = (h * kf[t][:, :, None]).sum(1)  # [Hv, dv]
            delta = (vf[t] - kv_mem) * beta_all[s + t][:, None]
            h = h + kf[t][:, :, None] * delta[:, None, :]
            out[s + t] = (h * qf[t][:, :, None]).sum(1).to(v.dtype)
            if intermediate_states is not None:
                intermediate_states[i, t] = h.to(intermediate_states.dtype)
        store_state(state, state_scale, slot, h)
    return out


# ---------------------------------------------------------------------------------------------
# attention over the paged KV cache
# ---------------------------------------------------------------------------------------------


@_ref
def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    for src, cache, sc in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if cache.dtype == torch.int8:
            xf = src.float()
            s = xf.abs().amax(-1).clamp_min(1e-30) / INT8_MAX  # [n, Hkv]
            cache[blk, off] = torch.round(xf / s[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            sc[blk, off] = s
        else:
            cache[blk, off] = src.to(cache.dtype)


def gather_kv(cache, scale, block_table, length):
    """fp32 [length, Hkv, D] of one sequence's keys or values from the paged cache."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blk = block_table[pos // block_size].long()
    off = pos % block_size
    vals = cache[blk, off].float()
    if cache.dtype == torch.int8:
        vals = vals * scale[blk, off].float()[..., None]
    return vals


@_ref
def paged_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
    k_scale=None, v_scale=None, max_query_len=None, max_seq_len=None, k_new=None, v_new=None,
):
    # k_new / v_new repeat what the cache holds (a kernel may read them instead): the oracle reads the cache
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    rep = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for i, (s, e) in enumerate(_seq_bounds(cu_seqlens_q)):
        if e == s:
            continue
        n, L = int(seq_lens[i]), e - s
        keys = gather_kv(k_cache, k_scale, block_tables[i], n).permute(1, 2, 0)  # [Hkv, D, n]
        vals = gather_kv(v_cache, v_scale, block_tables[i], n).transpose(0, 1)  # [Hkv, n, D]
        # query head h reads kv head h // rep: group the rep query heads of each kv head as rows
        qf = q[s:e].float().view(L, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * L, d)
        scores = (qf @ keys) * scale  # [Hkv, rep*L, n]
        qpos = torch.arange(n - L, n, device=q.device).repeat(rep)
        hidden = torch.arange(n, device=q.device)[None, :] > qpos[:, None]  # key after query
        p = torch.softmax(scores.masked_fill(hidden[None], float("-inf")), dim=-1)
        o = (p @ vals).view(hkv, rep, L, d).permute(2, 0, 1, 3).reshape(L, hq, d)
        out[s:e] = o.to(q.dtype)
    return out


def dense_attention(q, k, v, cu_seqlens, scale, causal):
    """fp32 attention within each packed sequence (no cache); used by the vision tower."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rep = q.shape[1] // k.shape[1]
    for s, e in _seq_bounds(cu_seqlens):
        qf, kf, vf = q[s:e].float(), k[s:e].float().repeat_interleave(rep, 1), v[s:e].float().repeat_interleave(rep, 1)
        scores = torch.einsum("lhd,nhd->hln", qf, kf) * scale
        if causal:
            n = e - s
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)[None], float("-inf"))
        out[s:e] = torch.einsum("hln,nhd->lhd", torch.softmax(scores, -1), vf).to(q.dtype)
    return out


@_ref
def varlen_attention(q, k, v, cu_seqlens, scale, causal=False, max_seqlen=None):
    return dense_attention(q, k, v, cu_seqlens, scale, causal)


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------------------------
# vision tower ops
# ---------------------------------------------------------------------------------------------


@_ref
def layer_norm(x, weight, bias, eps):
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


@_ref
def gelu(x, approximate="none"):
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


@_ref
def rotary_embed(x, cos, sin):
    return _rotate(x, cos.float()[:, None, :], sin.float()[:, None, :], x.shape[-1])
