"""The model's configuration, parsed from a Hugging Face config.json (and quantize_config.json): the text
model's geometry, the optional vision tower and the GPTQ settings. A key the config leaves out takes
transformers' default for Qwen3.5 (TEXT_DEFAULTS and the tables beside it); every bad or unsupported
field raises ConfigError naming it. (The engine levers are in qv/config.py, which re-exports these names.)"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qv.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def read_json_object(path: Path) -> dict[str, Any]:
    """A model folder's JSON file (config.json, quantize_config.json, ...) as a dict; a file that is not a
    JSON object is a ConfigError naming the file, line and column (one line, not json's traceback)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object (it holds a {type(raw).__name__})")
    return raw


@dataclass(frozen=True)
class QuantConfig:
    """GPTQ, AWQ or block-FP8 settings from `quantization_config` (or `quantize_config.json`)."""

    bits: int
    group_size: int  # -1: one group over the whole input dim
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (zero stored minus one) or "gptq_v2" (true zero)
    dynamic: dict[str, dict]  # "-:regex" excludes modules; "+:regex"/"regex" overrides
    modules_to_not_convert: tuple[str, ...]
    lm_head: bool
    method: str = "gptq"  # "gptq", "awq" (AWQ's GEMM layout: codes packed along N, true zeros) or "fp8"
    weight_block_size: tuple[int, int] | None = None  # fp8: (bn, bk) of each weight_scale_inv entry


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
        raw = read_json_object(path)
        quant = raw.get("quantization_config")
        if quant is None and (Path(model_dir) / "quantize_config.json").is_file():
            quant = read_json_object(Path(model_dir) / "quantize_config.json")
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


# Keys a config leaves out take transformers' defaults (transformers 5.24, configuration_qwen3_5.py
# and the Qwen3.5 modeling code that reads the config), so a checkpoint means what it means there.
TEXT_DEFAULTS = {  # Qwen3_5TextConfig
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
}
ROPE_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta
# Qwen3_5TextRotaryEmbedding: rope_parameters.get("mrope_section", [11, 11, 10]); its mRoPE is always
# interleaved (an explicit mrope_interleaved=false is honoured here, as vLLM does; transformers ignores it)
MROPE_SECTION = (11, 11, 10)
TOKEN_DEFAULTS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                  "vision_end_token_id": 248054}  # Qwen3_5Config
VISION_DEFAULTS = {  # Qwen3_5VisionConfig
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
}


def _parse_text(top: dict, text: dict, arch: str, quant_override: dict | None) -> ModelConfig:
    def get(key: str):
        return text.get(key, TEXT_DEFAULTS[key])

    n_layers = int(get("num_hidden_layers"))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(get("full_attention_interval"))
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
    theta = rope.get("rope_theta", text.get("rope_theta", ROPE_THETA))
    prf = rope.get("partial_rotary_factor", get("partial_rotary_factor"))
    section = tuple(rope.get("mrope_section") or MROPE_SECTION)
    interleaved = bool(rope.get("mrope_interleaved", True))

    heads = int(get("num_attention_heads"))
    head_dim = get("head_dim")
    head_dim = int(head_dim) if head_dim is not None else int(get("hidden_size")) // heads
    if heads % int(get("num_key_value_heads")):
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if int(get("linear_num_value_heads")) % int(get("linear_num_key_heads")):
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if not interleaved and 2 * sum(section) != int(head_dim * prf):  # interleaved slots past rotary_dim/2 drop out
        raise ConfigError(
            f"mrope_section {list(section)} sums to {sum(section)}, expected rotary_dim/2 = {int(head_dim * prf) // 2} "
            "for contiguous (mrope_interleaved=false) sections"
        )

    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    multimodal = arch == "Qwen3_5ForConditionalGeneration"
    vision = _parse_vision(top.get("vision_config")) if multimodal else None
    quant_raw = quant_override if quant_override is not None else top.get("quantization_config")
    # transformers ties the multimodal model's lm_head by the top-level flag alone
    tie = bool(top.get("tie_word_embeddings", False) if multimodal else get("tie_word_embeddings"))
    tokens = {k: top.get(k, v) if multimodal else top.get(k) for k, v in TOKEN_DEFAULTS.items()}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads")),
        head_dim=head_dim,
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")),
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(theta),
        partial_rotary_factor=float(prf),
        mrope_section=section,
        mrope_interleaved=interleaved,
        attn_output_gate=bool(text.get("attn_output_gate", True)),  # transformers' Qwen3.5 attention is always gated
        attention_bias=bool(get("attention_bias")),
        tie_word_embeddings=tie,
        max_position_embeddings=int(get("max_position_embeddings")),
        hidden_act=str(get("hidden_act")),
        eos_token_ids=eos_ids,
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),  # not transformers' (it skips mtp.*)
        image_token_id=tokens["image_token_id"],
        video_token_id=tokens["video_token_id"],
        vision_start_token_id=tokens["vision_start_token_id"],
        vision_end_token_id=tokens["vision_end_token_id"],
        vision=vision,
        quant=_parse_quant(quant_raw) if quant_raw else None,
        torch_dtype=text.get("dtype", text.get("torch_dtype", top.get("dtype", top.get("torch_dtype")))),
    )


def _parse_vision(raw: dict | None) -> VisionConfig | None:
    if not raw:
        return None

    def get(key: str, alias: str | None = None):
        return raw.get(key, raw.get(alias, VISION_DEFAULTS[key]) if alias else VISION_DEFAULTS[key])

    patch, tpatch = get("patch_size"), get("temporal_patch_size")
    return VisionConfig(
        depth=int(get("depth", "num_hidden_layers")),
        hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")),
        num_heads=int(get("num_heads", "num_attention_heads")),
        in_channels=int(get("in_channels")),
        patch_size=int(patch[0] if isinstance(patch, (list, tuple)) else patch),
        temporal_patch_size=int(tpatch[0] if isinstance(tpatch, (list, tuple)) else tpatch),
        spatial_merge_size=int(get("spatial_merge_size")),
        out_hidden_size=int(get("out_hidden_size")),
        num_position_embeddings=int(get("num_position_embeddings")),
        hidden_act=str(get("hidden_act")),
        deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes") or ()),
    )


def _parse_quant(raw: dict) -> QuantConfig:
    method = raw.get("quant_method", "gptq")
    if method == "awq":
        return _parse_awq(raw)
    if method == "fp8":
        return _parse_fp8(raw)
    if method != "gptq":
        raise ConfigError(f"unsupported quant_method {method!r}: qv loads GPTQ, AWQ and block-FP8 checkpoints")
    bits = int(raw.get("bits", 8))
    if bits not in (4, 8):
        raise ConfigError(f"GPTQ bits={bits} is not supported: qv loads GPTQ-Int8 and GPTQ-Int4 (bits 8 or 4)")
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


def _parse_awq(raw: dict) -> QuantConfig:
    """AWQ's config (AutoAWQ's quant_config keys w_bit / q_group_size are accepted too): 4 bits, the GEMM
    layout, zero points; the lm_head is never quantized."""
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    if bits != 4:
        raise ConfigError(f"AWQ bits={bits} is not supported: qv loads 4-bit AWQ")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"AWQ version {version!r} is not supported: qv loads AWQ's GEMM layout ('gemm')")
    if not _json_bool(raw, "zero_point", True):
        raise ConfigError("AWQ zero_point=false is not supported: qv loads AWQ with zero points")
    group_size = int(raw.get("group_size", raw.get("q_group_size", 128)))
    if group_size == 0 or group_size < -1:
        raise ConfigError(f"AWQ group_size={group_size}: expected a positive group size or -1 (one group)")
    return QuantConfig(bits=4, group_size=group_size, sym=False, desc_act=False, checkpoint_format="gptq_v2",
                       dynamic={}, modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()),
                       lm_head=False, method="awq")


def _parse_fp8(raw: dict) -> QuantConfig:
    """Block-FP8 (Qwen's and DeepSeek's FP8 releases): e4m3 weights with one `weight_scale_inv` per
    `weight_block_size` block, activations scaled at run time (activation_scheme dynamic)."""
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size={block!r}: qv loads block-FP8 checkpoints, "
                          "which give it as two positive integers [bn, bk] (per-tensor FP8 is not built)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme={scheme!r}: qv scales FP8 activations at run "
                          "time (dynamic); static input scales are not built")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt={fmt!r}: qv loads e4m3 FP8 weights")
    return QuantConfig(bits=8, group_size=block[1], sym=True, desc_act=False, checkpoint_format="fp8", dynamic={},
                       modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()), lm_head=False,
                       method="fp8", weight_block_size=(block[0], block[1]))


def _json_bool(raw: dict, key: str, default: bool) -> bool:
    """A JSON boolean; strings like "false" are refused rather than read as truthy."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"quantization_config.{key}={value!r}: expected true or false")
    return value
