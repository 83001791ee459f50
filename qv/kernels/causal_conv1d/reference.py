"""fp32 causal conv1d with state: the oracle of causal_conv1d (arguments as in __init__.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state, activation=True,
                  max_query_len=None):
    width = weight.shape[1]
    out = torch.empty_like(x)
    wf = weight.float()
    cu = cu_seqlens.tolist()
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        slot = int(state_slots[i])
        prev = conv_state[slot].float() if bool(has_initial_state[i]) else x.new_zeros(width - 1, x.shape[1], dtype=torch.float32)
        seq = torch.cat([prev, x[s:e].float()], dim=0)  # [width-1+L, C]
        if e > s:
            windows = seq.unfold(0, width, 1)  # [L, C, width]
            y = (windows * wf[None]).sum(-1)
            out[s:e] = (F.silu(y) if activation else y).to(x.dtype)
        conv_state[slot] = seq[seq.shape[0] - (width - 1) :].to(conv_state.dtype)
    return out
