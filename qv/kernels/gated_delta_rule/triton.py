"""Gated DeltaNet ops: causal depthwise conv1d with state, and the gated delta rule.

Both work on a packed varlen batch (`cu_seqlens`) whose sequences own one slot each in a state
pool (`state_slots`); a sequence with `has_initial_state` false starts from zeros. Decode is the
same call with one token per sequence; `max_query_len` (a host int, at least every sequence's
length: kernels rely on it) lets kernels pick a path without a device sync.
"""

from __future__ import annotations

import torch

from qv.kernels import gdn_conv as _gdn_conv  # noqa: F401  (registers the Triton conv)
from qv.kernels.gdn_chunk import gdn_chunked
from qv.kernels.gdn_recurrent import gdn_recurrent
from qv.kernels.registry import impl, register

RECURRENT_MAX_LEN = 16  # longest query a decode-style (token by token) launch handles


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


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     state_slots: torch.Tensor, has_initial_state: torch.Tensor, scale: float | None = None,
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
                                              has_initial_state, scale, state_scale, intermediate_states,
                                              max_query_len)


def _gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state,
                             scale=None, state_scale=None, intermediate_states=None, max_query_len=None, *,
                             config=None):
    """Token-by-token kernel for decode (its one-token path at max_query_len 1), verification
    (per-position states) and short queries; the chunked kernels otherwise (also when max_query_len is
    unknown: no host sync)."""
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    if state.stride(-1) != 1:
        raise ValueError("gated_delta_rule: the state pool needs a unit inner stride")
    args = (q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale, state_scale)
    if intermediate_states is not None or (max_query_len is not None and max_query_len <= RECURRENT_MAX_LEN):
        return gdn_recurrent(*args, intermediate_states, config=config, one_token=max_query_len == 1)
    return gdn_chunked(*args, config=config)


register("gated_delta_rule", "triton", _gated_delta_rule_triton)
