"""The model's configuration, parsed from a Hugging Face config.json (and quantize_config.json): the text
model's geometry, the optional vision tower and the GPTQ settings. Every bad or unsupported field raises
ConfigError naming it. (The engine levers are in qv/config.py, which re-exports these names.)"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qv.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


@dataclass(frozen=True)
class QuantConfig:
    """GPTQ settings from `quantization_config` (or `quantize_config.json`)."""

    bits: int
    group_size: int  # -1: one group over the whole input dim
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (zero stored minus one) or "gptq_v2" (true zero)
    dynamic: dict[str, dict]  # "-:regex" excludes modules; "+:regex"/"regex" overrides
    modules_to_not_convert: tuple[str, ...]
    lm_head: bool


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    deepstack_visual_indexes: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """The text model's geometry, plus the optional vision tower and quantization settings."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    attn_output_gate: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    mtp_num_hidden_layers: int
    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    vision: VisionConfig | None
    quant: QuantConfig | None
    torch_dtype: str | None

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def weight_prefix(self) -> str:
        """Checkpoint prefix of the text model's tensors."""
        if self.architecture == "Qwen3_5ForConditionalGeneration":
            return "model.language_model."
        return "model."

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        with open(path) as f:
            raw = json.load(f)
        quant = raw.get("quantization_config")
        if quant is None and (Path(model_dir) / "quantize_config.json").is_file():
            with open(Path(model_dir) / "quantize_config.json") as f:
                quant = json.load(f)
        return cls.from_dict(raw, quant_override=quant)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], quant_override: dict | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: qv serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        archs = raw.get("architectures") or [
            "Qwen3_5ForConditionalGeneration" if model_type == "qwen3_5" else "Qwen3_5ForCausalLM"
        ]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}: qv serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type == "qwen3_5":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json of model_type 'qwen3_5' lacks a 'text_config' object")
        else:
            text = raw
        return _parse_text(raw, text, arch, quant_override)


_REQUIRED_TEXT = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _parse_text(top: dict, text: dict, arch: str, quant_override: dict | None) -> ModelConfig:
    missing = [k for k in _REQUIRED_TEXT if k not in text]
    if missing:
        raise ConfigError(f"config.json lacks required text fields: {', '.join(missing)}")
    n_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
        ]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
    bad = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if bad:
        raise ConfigError(f"unknown layer types {bad}: expected 'linear_attention' or 'full_attention'")

    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}: qv implements default/mrope rotary")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json lacks rope_theta (in rope_parameters or the text config)")
    prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section")

    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    if heads % int(text["num_key_value_heads"]):
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if int(text["linear_num_value_heads"]) % int(text["linear_num_key_heads"]):
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if section is not None and 2 * sum(section) != int(head_dim * prf):
        raise ConfigError(
            f"mrope_section {section} sums to {sum(section)}, expected rotary_dim/2 = {int(head_dim * prf) // 2}"
        )

    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    vision = _parse_vision(top.get("vision_config")) if arch == "Qwen3_5ForConditionalGeneration" else None
    quant_raw = quant_override if quant_override is not None else top.get("quantization_config")
    tie = bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=int(text["num_key_value_heads"]),
        head_dim=head_dim,
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        partial_rotary_factor=float(prf),
        mrope_section=tuple(section) if section else None,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        tie_word_embeddings=tie,
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        hidden_act=str(text.get("hidden_act", "silu")),
        eos_token_ids=eos_ids,
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
        image_token_id=top.get("image_token_id"),
        video_token_id=top.get("video_token_id"),
        vision_start_token_id=top.get("vision_start_token_id"),
        vision_end_token_id=top.get("vision_end_token_id"),
        vision=vision,
        quant=_parse_quant(quant_raw) if quant_raw else None,
        torch_dtype=text.get("dtype", text.get("torch_dtype", top.get("dtype", top.get("torch_dtype")))),
    )


def _parse_vision(raw: dict | None) -> VisionConfig | None:
    if not raw:
        return None
    patch = raw.get("patch_size", 16)
    tpatch = raw.get("temporal_patch_size", 2)
    return VisionConfig(
        depth=int(raw.get("depth", raw.get("num_hidden_layers", 27))),
        hidden_size=int(raw.get("hidden_size", 1152)),
        intermediate_size=int(raw.get("intermediate_size", 4304)),
        num_heads=int(raw.get("num_heads", raw.get("num_attention_heads", 16))),
        in_channels=int(raw.get("in_channels", 3)),
        patch_size=int(patch[0] if isinstance(patch, (list, tuple)) else patch),
        temporal_patch_size=int(tpatch[0] if isinstance(tpatch, (list, tuple)) else tpatch),
        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
        out_hidden_size=int(raw.get("out_hidden_size", 3584)),
        num_position_embeddings=int(raw.get("num_position_embeddings", 2304)),
        hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
        deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes") or ()),
    )


def _parse_quant(raw: dict) -> QuantConfig:
    method = raw.get("quant_method", "gptq")
    if method != "gptq":
        raise ConfigError(f"unsupported quant_method {method!r}: qv loads GPTQ checkpoints")
    bits = int(raw.get("bits", 8))
    if bits != 8:
        raise ConfigError(f"GPTQ bits={bits} is not supported: qv loads GPTQ-Int8 (bits=8)")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"unsupported GPTQ checkpoint_format {fmt!r}: expected 'gptq' or 'gptq_v2'")
    group_size = int(raw.get("group_size", 128))
    if group_size == 0 or group_size < -1:
        raise ConfigError(f"GPTQ group_size={group_size}: expected a positive group size or -1 (one group)")
    return QuantConfig(
        bits=bits,
        group_size=group_size,
        sym=_json_bool(raw, "sym", True),
        desc_act=_json_bool(raw, "desc_act", False),
        checkpoint_format=fmt,
        dynamic=dict(raw.get("dynamic") or {}),
        modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()),
        lm_head=_json_bool(raw, "lm_head", False),
    )


def _json_bool(raw: dict, key: str, default: bool) -> bool:
    """A JSON boolean; strings like "false" are refused rather than read as truthy."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"quantization_config.{key}={value!r}: expected true or false")
    return value
