"""Depthwise causal conv1d with per-slot state over a packed varlen batch (Gated DeltaNet input mixing).

Sequences own one slot each in a state pool (`state_slots`); a sequence with `has_initial_state` false
starts from zeros. Decode is the same call with one token per sequence; `max_query_len` (a host int, at
least every sequence's length) lets kernels pick a path without a device sync.
"""

from __future__ import annotations

import torch

from qv.kernels.registry import impl


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                  state_slots: torch.Tensor, has_initial_state: torch.Tensor, activation: bool = True,
                  max_query_len: int | None = None) -> torch.Tensor:
    """Depthwise causal conv over each sequence, SiLU fused; updates each slot's state in place.

    x [T, C] (pre-conv inputs), weight [C, W]; conv_state [S, W-1, C] holds the last W-1 inputs
    of each slot; cu_seqlens [B+1] int32; state_slots [B] int; has_initial_state [B] bool.
    Returns y [T, C]. After the call, conv_state[slot] = the last W-1 inputs of (state ++ x_seq).
    """
    if x.dim() != 2 or weight.shape[0] != x.shape[1] or conv_state.shape[1:] != (weight.shape[1] - 1, x.shape[1]):
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, state {tuple(conv_state.shape)}")
    return impl("causal_conv1d", x.device)(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state,
                                           activation, max_query_len)
