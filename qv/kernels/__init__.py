"""qv's ops. Model code calls only the functions exported here.

Each op has a folder, qv/kernels/<op>/: its public wrapper with the shape docstring (__init__.py), its fp32
PyTorch reference, the spec and oracle of every kernel (reference.py: float32 throughout, exact softmax,
cast to the activation dtype at the end; ops that update caches or states in place do so there too), one
file per implementation (triton*.py; cuda_sm90.py / cuda_sm70.py with their .cu for the raw-CUDA paths of
sm_90 and of Volta's sm70 chain, the latter listing its shipped instantiations in BUILDS) and, where settings
were chosen by measurement, configs.py. registry.TABLE lists every op's implementation per backend.

The folders share their names with the functions exported here, so `qv.kernels.rms_norm` is the function:
import an op's modules as `from qv.kernels.rms_norm import triton` (not `import qv.kernels.rms_norm.triton`).
"""

from qv.kernels import registry
from qv.kernels.causal_conv1d import causal_conv1d
from qv.kernels.gated_delta_rule import gated_delta_rule
from qv.kernels.gated_rms_norm import gated_rms_norm
from qv.kernels.gelu import gelu
from qv.kernels.layer_norm import layer_norm
from qv.kernels.linear import FP8Weight, GPTQWeight, linear
from qv.kernels.lm_head_top1 import Top1Ranking, build_top1_ranking, lm_head_top1
from qv.kernels.grouped_delta import grouped_delta
from qv.kernels.paged_attention import paged_attention
from qv.kernels.race import race
from qv.kernels.registry import backend, get_backend, ops, set_backend
from qv.kernels.rms_norm import rms_norm
from qv.kernels.rope import rope
from qv.kernels.rotary_embed import rotary_embed
from qv.kernels.sigmoid_mul import sigmoid_mul
from qv.kernels.silu_mul import silu_mul
from qv.kernels.varlen_attention import varlen_attention
from qv.kernels.write_kv import write_kv

registry.load()

__all__ = [
    "FP8Weight", "GPTQWeight", "Top1Ranking", "backend", "build_top1_ranking", "causal_conv1d", "gated_delta_rule",
    "gated_rms_norm", "gelu", "get_backend", "grouped_delta", "layer_norm", "linear", "lm_head_top1", "ops",
    "paged_attention", "race", "rms_norm", "rope", "rotary_embed",
    "set_backend", "sigmoid_mul", "silu_mul", "varlen_attention", "write_kv",
]
