"""What `qv bench` runs: a preset written as a config.json alone (its weights are made on the
device, `load_format=random`), and the levers a benchmark needs unless the user set them."""

from __future__ import annotations

import json
from pathlib import Path

from qv.config import ConfigError, EngineConfig
from qv.model.tiny import PRESETS, build_config, write_tokenizer
from qv.model.tiny_tokenizer import tokenizer_json

MAX_POSITION_EMBEDDINGS = 262144  # Qwen3.5's own; a preset serves every row length up to it
# GPTQ-Int8 as Qwen's releases ship it, for the presets with a real model's shapes
GPTQ_INT8 = {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq_v2"}
PREFILL_CHUNK = 8192  # tokens per step: past it prefill GEMMs gain little while activations keep growing


def is_model_shape(preset: str) -> bool:
    """Presets with a real model's geometry (and vocabulary), as opposed to the tiny test fixtures."""
    return "vocab_size" in PRESETS[preset]


def preset_config(preset: str) -> dict:
    """The text-only config.json of `preset` (Qwen3_5ForCausalLM), GPTQ-Int8 for the real shapes."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    _, special = tokenizer_json()
    vocab = (max(special.values()) + 1 + 63) // 64 * 64  # as make_tiny pads it
    config = build_config(preset, vocab, special, mtp=is_model_shape(preset))  # as the real models: one MTP layer
    text = dict(config.get("text_config", config))
    text["architectures"] = ["Qwen3_5ForCausalLM"]
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text["max_position_embeddings"] = MAX_POSITION_EMBEDDINGS
    if is_model_shape(preset):
        text["quantization_config"] = dict(GPTQ_INT8)
        text["dtype"] = "bfloat16"
    return text


def write_preset(preset: str, folder: str | Path) -> Path:
    """`folder` with the preset's config.json and the embedded tiny tokenizer (prompts are token ids)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(preset_config(preset), indent=2) + "\n")
    write_tokenizer(out)
    return out


def levers_set(user: EngineConfig, flags: dict) -> set[str]:
    """Levers the user chose: given as flags, or from the environment (a lever set to its default
    value reads as unset, which only matters for the few the benchmark picks itself)."""
    default = EngineConfig()
    return set(flags) | {name for name in EngineConfig.model_fields if getattr(user, name) != getattr(default, name)}


def bench_config(flags: dict, model: str | None, preset: str | None, max_model_len: int,
                 max_batch: int) -> EngineConfig:
    """The engine's levers: the environment and flags, then what the rows need where the user set
    nothing (max_model_len for the longest row, max_num_seqs for the largest batch, a long-prefill
    step budget; with a preset also random weights, and int8 KV and the model's own max_model_len at a
    real model's shapes)."""
    user = EngineConfig.from_env(**flags)
    chosen = levers_set(user, flags)
    picks = {"max_model_len": max_model_len, "max_num_seqs": max_batch, "max_num_batched_tokens": PREFILL_CHUNK}
    if preset is not None and is_model_shape(preset):
        picks["kv_dtype"] = "int8"
        del picks["max_model_len"]  # served as users serve it: the model's 262,144 (memory plan, graph splits)
    values = {k: v for k, v in picks.items() if k not in chosen}
    if preset is not None:
        values["load_format"] = "random"  # the folder holds a config.json only
    if model is not None:
        values["model"] = model
    return user.replace(**values)
