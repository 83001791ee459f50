"""The int8 lm_head (lever QV_LM_HEAD_INT8, `qv quantize --lm-head`): the vocabulary projection held as int8
codes with one symmetric scale per vocabulary row, i.e. a GPTQWeight of 8 bits, no zero points and one group
spanning the hidden size. The sampler's logits then run through the existing GPTQ GEMV/GEMM (K.linear), and
the MTP drafter's fused top-1 ranks and re-scores against the same codes (qv/kernels/lm_head_top1).

Each row's scale is rounded up to the model dtype before the codes are chosen, so the stored (bf16) scale is
the one the codes were rounded with and the row's largest weight is never clipped. Per row v and hidden state
x the logit error is then at most scale_v / 2 * ||x||_1 (each weight within half a step); the measured errors,
top-1 agreement and the logprob bound a client sees are in docs/VALIDATION.md ("int8 lm_head").
"""

from __future__ import annotations

import torch

from qv.errors import ConfigError
from qv.kernels.linear import GPTQWeight
from qv.model.layers import Linear

CHUNK_ROWS = 16384  # vocabulary rows quantized at a time: their fp32 copy is the only temporary


def quantize_rows_int8(w: torch.Tensor, scale_dtype: torch.dtype | None = None,
                       chunk_rows: int = CHUNK_ROWS) -> GPTQWeight:
    """Dense [V, H] -> row-int8 GPTQWeight: codes uint8 [H, V] (code 128 is zero), scales [1, V] in
    `scale_dtype` (default w's dtype), scale_v >= amax_v / 127 as stored."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"quantize_rows_int8: a float [V, H] weight expected, got {w.dtype} {tuple(w.shape)}")
    v, h = w.shape
    scale_dtype = scale_dtype or w.dtype
    codes = torch.empty(h, v, dtype=torch.uint8, device=w.device)
    scales = torch.empty(1, v, dtype=scale_dtype, device=w.device)
    for r0 in range(0, v, chunk_rows):
        rows = w[r0:r0 + chunk_rows].float()
        s = (rows.abs().amax(1) / 127).clamp_min(2.0**-24)
        s = _round_up(s, scale_dtype)
        q = torch.clamp(torch.round(rows / s.float()[:, None]), -127, 127) + 128
        codes[:, r0:r0 + chunk_rows] = q.t().to(torch.uint8)
        scales[0, r0:r0 + chunk_rows] = s
    return GPTQWeight(codes, scales, None, torch.zeros(h, dtype=torch.int32, device=w.device), h, 8, sequential=True)


def _round_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s in `dtype`, not below s (so amax / scale <= 127 after the cast): where rounding went down, s raised by
    2^-7 (bf16's widest relative spacing) rounds to a value above s, since half a spacing is at most 2^-8."""
    t = s.to(dtype)
    return torch.where(t.float() < s, (s * (1 + 2.0**-7)).to(dtype), t)


def lm_head_int8(lm_head: Linear) -> Linear:
    """The model's lm_head with its dense weight replaced by the row-int8 one (in place: a vocabulary-parallel
    head keeps its class, shard and gather, each rank quantizing its own rows, which per-row scales allow). A
    tied head gets its own int8 copy; the embedding stays dense. A head that is already quantized is refused
    by name (a checkpoint's GPTQ lm_head is used as it is)."""
    w = lm_head.weight
    if not isinstance(w, torch.Tensor):
        raise ConfigError("lm_head_int8: the lm_head is already quantized in the checkpoint; QV_LM_HEAD_INT8 "
                         "quantizes a dense one")
    if lm_head.bias is not None:
        raise ConfigError("lm_head_int8: an lm_head with a bias is not built for the int8 path")
    lm_head.weight = quantize_rows_int8(w)
    return lm_head
