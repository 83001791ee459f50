"""fp32 gated delta rule, token by token: the oracle of gated_delta_rule (arguments as in __init__.py).
The state slots are read and written as the kernels do, int16 pools on their uniform grid included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qv.kernels.gated_delta_rule import INT16_MAX


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
    cu = cu_seqlens.tolist()
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
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
