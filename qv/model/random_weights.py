"""Random weights made on the device (vLLM's `--load-format dummy`): a folder with only a config.json
serves, for benchmarks at the full model's size without writing or reading its checkpoint.

`RandomReader` answers the calls `CheckpointReader` answers (has, tensor, linear, used, unused), for
the tensor names and shapes a real checkpoint of the config would hold, so the model is built by the
same code and lands in the same runtime layout: GPTQ-Int8 codes, scales and group indices where the
quantization config would quantize a module, dense weights where it would not. Each tensor is seeded
by its name, so the same config and seed give the same weights whatever the load order.

Value ranges follow the fixtures (`qv.model.tiny.random_tensor`): unit-scale embeddings, linears with
fan_in^-1/2 (GPTQ: uniform codes whose scales give that spread), norms near their identity, A_log and
dt_bias in the ranges of real checkpoints, so activations stay finite through every layer.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from pathlib import Path

import torch

from qv.errors import ConfigError
from qv.kernels.linear import FP8Weight, GPTQWeight
from qv.model.tiny import random_tensor, tensor_shapes, weight_std
from qv.model.weights import CheckpointError, CheckpointReader, QuantRules
from qv.model_config import ModelConfig, QuantConfig

# what `quantization=gptq-int8|gptq-int4|awq` gives a config without a quantization_config
# (every text linear but the lm_head; the vision tower stays dense, as in Qwen's own GPTQ releases)
GPTQ_INT8 = QuantConfig(bits=8, group_size=128, sym=True, desc_act=False, checkpoint_format="gptq_v2",
                        dynamic={"-:.*visual.*": {}}, modules_to_not_convert=(), lm_head=False)
# 4 bits: the GDN gates in_proj_a/b ([Hv, H]) stay dense too, as `qv quantize` and 4-bit uploads keep them
RANDOM_QUANT = {
    "gptq-int8": GPTQ_INT8,
    "gptq-int4": dataclasses.replace(GPTQ_INT8, bits=4, dynamic={"-:.*visual.*": {}, r"-:.*in_proj_[ab]$": {}}),
    "awq": dataclasses.replace(GPTQ_INT8, bits=4, sym=False, dynamic={},
                               modules_to_not_convert=("visual", "in_proj_a", "in_proj_b"), method="awq"),
    # Qwen's FP8 releases: 128x128 blocks; embeddings, lm_head, the GDN gates and the vision tower unquantized
    "fp8": QuantConfig(bits=8, group_size=128, sym=True, desc_act=False, checkpoint_format="fp8", dynamic={},
                       modules_to_not_convert=("lm_head", "embed_tokens", "visual", "in_proj_a", "in_proj_b"),
                       lm_head=False, method="fp8", weight_block_size=(128, 128)),
}
GPTQ_SUFFIXES = (".qweight", ".scales", ".g_idx")
EMBEDDINGS = ("embed_tokens", "pos_embed")


def checkpoint_reader(model_dir: str | Path, cfg: ModelConfig, load_format: str = "auto", seed: int = 0,
                      device: torch.device | str = "cpu"):
    """The reader that `load_format` names: the folder's safetensors, or random weights on `device`."""
    if load_format == "random":
        return RandomReader(cfg, seed, device)
    return CheckpointReader(model_dir, cfg)


def with_quantization(cfg: ModelConfig, quantization: str, load_format: str) -> ModelConfig:
    """`cfg` with the GPTQ/AWQ settings `quantization` names, in place of the config's own (random weights
    only: a real checkpoint's stored tensors decide what it holds)."""
    if quantization == "auto":
        return cfg
    if load_format != "random":
        raise ConfigError(f"quantization={quantization} applies to load_format=random; a checkpoint's own "
                              "quantization_config says how its weights are stored")
    if quantization not in RANDOM_QUANT:
        raise ConfigError(f"quantization={quantization!r}: expected auto or one of {', '.join(RANDOM_QUANT)}")
    return dataclasses.replace(cfg, quant=RANDOM_QUANT[quantization])


def shape_config(cfg: ModelConfig) -> dict:
    """The config.json fields `tensor_shapes` reads, from a parsed ModelConfig."""
    text = {k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "tie_word_embeddings")}
    text["layer_types"] = list(cfg.layer_types)
    if cfg.architecture != "Qwen3_5ForConditionalGeneration":
        return text
    out = {"text_config": text, "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.vision is not None:
        out["vision_config"] = dataclasses.asdict(cfg.vision)
    return out


class RandomReader:
    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"):
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self.shapes = tensor_shapes(shape_config(cfg), mtp=cfg.mtp_num_hidden_layers > 0)
        self.rules = QuantRules(cfg.quant, cfg.architecture) if cfg.quant is not None else None
        self.used: set[str] = set()

    def _quantized(self, module: str) -> bool:
        """Whether a checkpoint under this quantization config stores `module` as GPTQ codes: linears
        only (embedding tables are lookups, never GPTQ layers), unless a rule excludes them."""
        shape = self.shapes.get(f"{module}.weight")
        if self.rules is None or shape is None or len(shape) != 2 or module.endswith(EMBEDDINGS):
            return False
        mq = self.rules.resolve(module)
        if mq.excluded_by is None and mq.bits not in (4, 8):
            raise CheckpointError(f"{module}: bits={mq.bits} (from quantization_config); qv loads 8- and 4-bit GPTQ")
        return mq.excluded_by is None

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def nbytes(self) -> int:
        """Bytes the weights take (as stored in fp16/bf16; codes are smaller): what the progress bar measures."""
        return 2 * sum(math.prod(s) for s in self.shapes.values())

    @property
    def fp8(self) -> bool:
        return self.cfg.quant is not None and self.cfg.quant.method == "fp8"

    def has(self, name: str) -> bool:
        module, _, _ = name.rpartition(".")
        if name.endswith(GPTQ_SUFFIXES):
            return not self.fp8 and self._quantized(module)
        if name.endswith(".weight_scale_inv"):
            return self.fp8 and self._quantized(module)
        if name.endswith(".weight") and not self.fp8 and self._quantized(module):
            return False
        return name in self.shapes

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def tensor(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if not self.has(name):
            raise CheckpointError(f"a checkpoint of this config has no tensor {name!r}")
        stored = self.shapes[name]
        if shape is not None and tuple(shape) != tuple(stored):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(stored)}, expected {tuple(shape)}")
        self.used.add(name)
        dtype = dtype or torch.float32
        device = torch.device(device)
        if len(stored) == 2 and name.endswith(".weight"):  # the large matrices: made where they live
            out = torch.randn(stored, generator=self._generator(name, device), device=device, dtype=dtype)
            return out.mul_(weight_std(name, stored))
        return random_tensor(name, stored, self._generator(name, torch.device("cpu")), dtype, device)

    def linear(self, prefix: str, out_features: int, in_features: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor | GPTQWeight:
        if not self._quantized(prefix):
            return self.tensor(f"{prefix}.weight", dtype, device, shape=(out_features, in_features))
        shape = self.shapes[f"{prefix}.weight"]
        if tuple(shape) != (out_features, in_features):
            raise CheckpointError(f"{prefix}: shape {tuple(shape)}, expected {(out_features, in_features)}")
        if self.fp8:
            return self._fp8(prefix, out_features, in_features, torch.device(device))
        mq = self.rules.resolve(prefix)
        k, n = in_features, out_features
        group = k if mq.group_size == -1 else mq.group_size
        pack, levels = 32 // mq.bits, 1 << mq.bits
        if k % group or k % pack or n % pack:
            raise CheckpointError(f"{prefix}: {mq.bits}-bit GPTQ with group {group} needs in/out features {k}/{n} "
                                  f"that it divides, in multiples of {pack}")
        device = torch.device(device)
        gen = self._generator(prefix + ".qweight", device)
        # uniform codes: at 4 bits each byte is two uniform nibbles
        qweight = torch.randint(0, 256, (k * mq.bits // 8, n), generator=gen, device=device, dtype=torch.uint8)
        # scales vary by (group, column) as real ones do; their mean gives the weight fan_in^-1/2
        spread = torch.rand((k // group, n), generator=gen, device=device, dtype=torch.float32) * 0.5 + 0.75
        code_std = math.sqrt((levels**2 - 1) / 12)  # spread of uniform codes around the middle one
        scales = (spread * (weight_std(prefix + ".weight", shape) / code_std)).to(dtype)
        zeros = None
        if not self.cfg.quant.sym:
            mid, span = levels // 2, max(1, levels // 32)
            zeros = torch.randint(mid - span, mid + span + 1, (k // group, n), generator=gen, device=device).to(dtype)
        g_idx = torch.arange(k, dtype=torch.int32, device=device) // group
        self.used.update(prefix + s for s in GPTQ_SUFFIXES)
        return GPTQWeight(qweight, scales, zeros, g_idx, group, mq.bits)

    def _fp8(self, prefix: str, n: int, k: int, device: torch.device) -> FP8Weight:
        """Gaussian e4m3 values (the format's fine steps near one, coarse ones in the tails) with block scales
        that vary by block and give the weight its fan_in^-1/2 spread."""
        bn, bk = self.cfg.quant.weight_block_size
        gen = self._generator(prefix + ".weight", device)
        weight = torch.randn((n, k), generator=gen, device=device, dtype=torch.float32).to(torch.float8_e4m3fn)
        spread = torch.rand((-(-n // bn), -(-k // bk)), generator=gen, device=device, dtype=torch.float32) * 0.5 + 0.75
        self.used.update((prefix + ".weight", prefix + ".weight_scale_inv"))
        return FP8Weight(weight, spread * weight_std(prefix + ".weight", (n, k)), (bn, bk))

    def unused(self, ignore_prefixes: tuple[str, ...] = ()) -> list[str]:
        return []  # every name is made on request: nothing is left over by construction
