"""qv's op table. Every op has a reference (qv/kernels/reference.py) and kernels selected per
device and backend (see registry.py). Model code calls only these functions."""

from qv.kernels import elementwise as _elementwise  # noqa: F401  (registers Triton kernels)
from qv.kernels import linear_gptq as _linear_gptq  # noqa: F401
from qv.kernels import norms as _norms  # noqa: F401
from qv.kernels import reference as _reference  # noqa: F401  (registers the reference ops)
from qv.kernels.attention import paged_attention, varlen_attention, write_kv
from qv.kernels.fused import gated_rms_norm, gelu, layer_norm, rms_norm, rope, rotary_embed, sigmoid_mul, silu_mul
from qv.kernels.gdn import causal_conv1d, gated_delta_rule
from qv.kernels.linear import GPTQWeight, linear, lora_delta
from qv.kernels.registry import backend, get_backend, ops, set_backend

__all__ = [
    "GPTQWeight", "backend", "causal_conv1d", "gated_delta_rule", "gated_rms_norm", "gelu", "get_backend",
    "layer_norm", "linear", "lora_delta", "ops", "paged_attention", "rms_norm", "rope", "rotary_embed",
    "set_backend", "sigmoid_mul", "silu_mul", "varlen_attention", "write_kv",
]
