"""Triton gated delta rule: the token-by-token kernel (triton_recurrent.py) or the chunked one
(triton_chunk.py, with its WY prep in triton_prep.py)."""

from __future__ import annotations

from qv.kernels.gated_delta_rule.configs import RECURRENT_MAX_LEN
from qv.kernels.gated_delta_rule.triton_chunk import gdn_chunked
from qv.kernels.gated_delta_rule.triton_recurrent import gdn_recurrent


def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state,
                     scale=None, state_scale=None, intermediate_states=None, max_query_len=None, *, config=None):
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
