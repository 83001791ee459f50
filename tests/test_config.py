"""ModelConfig parsing (HF config.json) and EngineConfig levers: what parses, and that every bad
input raises ConfigError naming its cause (the field, value or lever)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from qv.config import ConfigError, EngineConfig, ModelConfig
from qv.model.tiny import build_config
from qv.model.tiny_tokenizer import tokenizer_json

_, SPECIAL = tokenizer_json()


def cfg(preset: str = "tiny") -> dict:
    return copy.deepcopy(build_config(preset, 256, SPECIAL))


def text(raw: dict) -> dict:
    return raw.get("text_config", raw)


# ---- what parses ----------------------------------------------------------------------------


def test_nested_multimodal_config():
    raw = cfg("tiny")
    c = ModelConfig.from_dict(raw)
    t = raw["text_config"]
    assert c.architecture == "Qwen3_5ForConditionalGeneration" and c.weight_prefix == "model.language_model."
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"])
    assert c.linear_key_dim == t["linear_num_key_heads"] * t["linear_key_head_dim"]
    assert c.linear_value_dim == t["linear_num_value_heads"] * t["linear_value_head_dim"]
    assert c.rotary_dim == int(t["head_dim"] * 0.25) and c.mrope_section == tuple(t["rope_parameters"]["mrope_section"])
    assert c.mrope_interleaved and c.vision is not None and c.tie_word_embeddings is False
    assert c.image_token_id == SPECIAL["<|image_pad|>"] and c.quant is None


def test_text_only_config_with_interval_and_tied():
    raw = cfg("gqa3")
    del raw["layer_types"]  # derived from full_attention_interval=2 instead
    raw["full_attention_interval"] = 2
    c = ModelConfig.from_dict(raw)
    assert c.architecture == "Qwen3_5ForCausalLM" and c.weight_prefix == "model."
    assert c.layer_types == ("linear_attention", "full_attention") * 2
    assert c.attention_layer_ids == [1, 3] and c.gdn_layer_ids == [0, 2]
    assert ModelConfig.from_dict(cfg("gqa1")).tie_word_embeddings is True


def test_quantization_config_and_legacy_file(tmp_path):
    raw = cfg("gqa1")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    legacy = {"bits": 8, "group_size": 32, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2",
              "dynamic": {"-:.*mtp.*": {}}, "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "quantize_config.json").write_text(json.dumps(legacy))
    q = ModelConfig.from_dir(tmp_path).quant
    assert (q.bits, q.group_size, q.sym, q.desc_act, q.checkpoint_format) == (8, 32, False, True, "gptq_v2")
    assert q.dynamic == {"-:.*mtp.*": {}} and q.modules_to_not_convert == ("lm_head",)
    raw["quantization_config"] = dict(legacy, group_size=64)  # config.json wins over the legacy file
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(tmp_path).quant.group_size == 64


# ---- model config errors ----------------------------------------------------------------------


def _drop(*keys):
    def f(raw):
        for k in keys:
            del text(raw)[k]
    return f


def _set(key, value, where="text"):
    def f(raw):
        (text(raw) if where == "text" else raw)[key] = value
    return f


def _rope(**kw):
    def f(raw):
        text(raw)["rope_parameters"].update(kw)
    return f


def _quant(**kw):
    def f(raw):
        raw["quantization_config"] = dict({"quant_method": "gptq", "bits": 8, "group_size": 32}, **kw)
    return f


MODEL_ERRORS = [
    ("unknown model_type", _set("model_type", "llama", "top"), ["'llama'", "model_type"]),
    ("unknown architecture", _set("architectures", ["LlamaForCausalLM"], "top"), ["LlamaForCausalLM"]),
    ("no text_config", lambda raw: raw.pop("text_config"), ["text_config"]),
    ("missing fields", _drop("hidden_size", "linear_key_head_dim"), ["hidden_size", "linear_key_head_dim"]),
    ("layer_types length", lambda raw: text(raw)["layer_types"].pop(), ["layer_types", "3 entries"]),
    ("layer_types value", lambda raw: text(raw)["layer_types"].__setitem__(1, "sliding_attention"),
     ["sliding_attention"]),
    ("rope type", _rope(rope_type="yarn"), ["rope_type", "yarn"]),
    ("no rope_theta", lambda raw: text(raw)["rope_parameters"].pop("rope_theta"), ["rope_theta"]),
    ("mrope_section", _rope(mrope_section=[4, 4, 4]), ["mrope_section"]),
    ("kv heads", _set("num_key_value_heads", 4), ["num_key_value_heads"]),
    ("gdn heads", _set("linear_num_key_heads", 3), ["linear_num_key_heads"]),
    ("gptq bits", _quant(bits=4), ["bits=4"]),
    ("gptq format", _quant(checkpoint_format="marlin"), ["checkpoint_format", "marlin"]),
    ("quant method", _quant(quant_method="awq"), ["quant_method", "awq"]),
]


@pytest.mark.parametrize("breaks,needles", [m[1:] for m in MODEL_ERRORS], ids=[m[0] for m in MODEL_ERRORS])
def test_model_config_errors_name_the_cause(breaks, needles):
    raw = cfg("tiny")
    ModelConfig.from_dict(raw)  # valid before the change, so the error below is the change's
    breaks(raw)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


# ---- engine levers ----------------------------------------------------------------------------


def _fields(kind: str):
    return [f for f in dataclasses.fields(EngineConfig) if str(f.type).startswith(kind)]


def test_env_and_overrides():
    e = EngineConfig.from_env({"QV_MAX_NUM_SEQS": "7", "QV_CUDA_GRAPHS": "off", "QV_KV_DTYPE": "int8"},
                              max_num_seqs=9)
    assert (e.max_num_seqs, e.cuda_graphs, e.kv_dtype) == (9, False, "int8")
    assert EngineConfig.from_env({}).max_num_seqs == EngineConfig().max_num_seqs


@pytest.mark.parametrize("f", [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("choices")],
                         ids=lambda f: f.name)
def test_bad_choice_names_the_lever(f):
    with pytest.raises(ConfigError, match=f.name):
        EngineConfig.from_env({}, **{f.name: "no-such-choice"})
    with pytest.raises(ConfigError, match=f.name):
        EngineConfig.from_env({f.metadata["env"]: "no-such-choice"})


@pytest.mark.parametrize("f", _fields("int") + _fields("float") + _fields("bool"), ids=lambda f: f.name)
def test_unparsable_env_names_the_variable(f):
    with pytest.raises(ConfigError, match=f.metadata["env"]):
        EngineConfig.from_env({f.metadata["env"]: "not-a-number"})


@pytest.mark.parametrize("name,value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("block_size", 0), ("spec_k", 0), ("clef_slots", 0),
    ("clef_nmax", 0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", 0.0), ("max_model_len", -1),
    ("kv_cache_bytes", -1),
])
def test_out_of_range_names_the_lever(name, value):
    with pytest.raises(ConfigError, match=name):
        EngineConfig.from_env({}, **{name: value})


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="max_num_seq_typo"):
        EngineConfig.from_env({}, max_num_seq_typo=3)
