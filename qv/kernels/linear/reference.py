"""fp32 linear over dense or dequantized GPTQ, block-FP8 and W12 weights: the oracle of linear (arguments as in
__init__.py). quantize_rows_fp8 is the spec of the FP8 prefill path's activation quantization."""

from __future__ import annotations

import torch

from qv.kernels.linear import FP8Weight, GPTQWeight, W12Weight

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def dequantize_gptq(w) -> torch.Tensor:
    """fp32 [N, K] weight of a GPTQWeight: w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]."""
    q = w.codes().float()  # [K, N]
    zeros = torch.full_like(w.scales, float(w.symmetric_zero), dtype=torch.float32) if w.zeros is None else w.zeros.float()
    g = w.g_idx.long()
    deq = (q - zeros[g]) * w.scales.float()[g]
    return deq.t()


def dequantize_fp8(w: FP8Weight) -> torch.Tensor:
    """fp32 [N, K] weight of an FP8Weight: w[n, k] = e4m3[n, k] * scale_inv[n // bn, k // bk]."""
    n, k = w.shape
    bn, bk = w.block
    s = w.scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.weight.float() * s


def dequantize_w12(w: W12Weight) -> torch.Tensor:
    """fp32 [N, K] weight of a W12Weight: w[n, k] = code[n, k] * scale[n]."""
    return w.codes().float() * w.scale.float()[:, None]


def quantize_rows_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group activation quantization: x [M, K] -> (e4m3 codes [M, K], fp32 scales [M, ceil(K/group)]),
    each group of `group` inputs of a row scaled so its largest magnitude maps to 448 (x = codes * scale)."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(dim=-1).clamp_min(1e-10) / FP8_MAX
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, groups * group)[:, :k], scale


def linear_w8a8(x, weight: FP8Weight, bias=None):
    """The FP8 prefill path's arithmetic in fp32: activations quantized per token and group of bk inputs
    (quantize_rows_fp8), products of e4m3 values summed per K block, both scales applied per block."""
    bk = weight.block[1]
    codes, scale = quantize_rows_fp8(x.reshape(-1, x.shape[-1]), bk)
    xs = codes.float() * scale.repeat_interleave(bk, 1)[:, :x.shape[-1]]
    y = xs @ dequantize_fp8(weight).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def linear(x, weight, bias=None):
    if isinstance(weight, GPTQWeight):
        w = dequantize_gptq(weight)
    elif isinstance(weight, FP8Weight):
        w = dequantize_fp8(weight)
    elif isinstance(weight, W12Weight):
        w = dequantize_w12(weight)
    else:
        w = weight.float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
