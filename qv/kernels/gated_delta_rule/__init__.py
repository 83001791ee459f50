"""The gated delta rule with gating and q/k l2norm fused (Gated DeltaNet), over a packed varlen batch.

Sequences own one slot each in a state pool (`state_slots`); a sequence with `has_initial_state` false
starts from zeros. Decode is the same call with one token per sequence; `max_query_len` (a host int, at
least every sequence's length: kernels rely on it) lets kernels pick a path without a device sync.
"""

from __future__ import annotations

import torch

from qv.kernels.registry import impl

# int16 state pools hold codes in [-INT16_MAX, INT16_MAX] times one fp32 scale per (slot, head, column)
INT16_MAX = 32767.0


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     state_slots: torch.Tensor, has_initial_state: torch.Tensor, *, scale: float | None = None,
                     state_scale: torch.Tensor | None = None, intermediate_states: torch.Tensor | None = None,
                     max_query_len: int | None = None) -> torch.Tensor:
    """The gated delta rule with gating and q/k l2norm fused; updates each slot's state in place.

    q, k [T, Hk, dk] (before l2norm); v [T, Hv, dv]; a, b [T, Hv] (raw projections);
    A_log, dt_bias [Hv]; g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
    Value head h reads q/k head h // (Hv / Hk). state [S, Hv, dk, dv] (fp32, fp16 or int16 codes
    with state_scale [S, Hv, dv]: value = code * scale). scale defaults to dk ** -0.5.
    Per token: S = S * exp(g); S += k (beta (v - k^T S)); o = q^T S.
    intermediate_states [B, Lmax, Hv, dk, dv] (optional) receives the state after each position
    (speculative verification commits the accepted one). Returns o [T, Hv, dv].
    """
    if q.shape != k.shape or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1]:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if state.shape[1:] != (v.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"gated_delta_rule: state {tuple(state.shape)} != [S, {v.shape[1]}, {q.shape[2]}, {v.shape[2]}]")
    if state.dtype == torch.int16 and state_scale is None:
        raise ValueError("gated_delta_rule: an int16 state needs its state_scale table")
    return impl("gated_delta_rule", q.device)(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots,
                                              has_initial_state, scale=scale, state_scale=state_scale,
                                              intermediate_states=intermediate_states, max_query_len=max_query_len)
