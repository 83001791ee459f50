"""ModelConfig parsing (HF config.json) and EngineConfig levers (pydantic-settings, levers files, the
state directory): what parses, and that every bad input raises ConfigError naming its cause (the field,
value or lever, and for a levers file its line)."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Literal, get_args, get_origin

import pytest

from qv import config
from qv.config import ConfigError, EngineConfig, ModelConfig, env_name, read_env_file, use_state_dir
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
    ("layer_types length", lambda raw: text(raw)["layer_types"].pop(), ["layer_types", "3 entries"]),
    ("layer_types value", lambda raw: text(raw)["layer_types"].__setitem__(1, "sliding_attention"),
     ["sliding_attention"]),
    ("rope type", _rope(rope_type="yarn"), ["rope_type", "yarn"]),
    ("contiguous mrope_section", _rope(mrope_section=[4, 4, 4], mrope_interleaved=False), ["mrope_section"]),
    ("kv heads", _set("num_key_value_heads", 4), ["num_key_value_heads"]),
    ("gdn heads", _set("linear_num_key_heads", 3), ["linear_num_key_heads"]),
    ("gptq bits", _quant(bits=3), ["bits=3"]),
    ("gptq format", _quant(checkpoint_format="marlin"), ["checkpoint_format", "marlin"]),
    ("quant method", _quant(quant_method="bitsandbytes"), ["quant_method", "bitsandbytes"]),
    ("awq bits", _quant(quant_method="awq", bits=8), ["AWQ bits=8"]),
    ("awq version", _quant(quant_method="awq", bits=4, version="gemv"), ["version", "gemv"]),
    ("awq zero point", _quant(quant_method="awq", bits=4, zero_point=False), ["zero_point"]),
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

FIELDS = EngineConfig.model_fields


def _of(kind) -> list[str]:
    return [n for n, f in FIELDS.items() if f.annotation is kind]


CHOICES = [n for n, f in FIELDS.items() if get_origin(f.annotation) is Literal]


def _bounds(name: str) -> dict:
    return {a: getattr(m, a) for m in FIELDS[name].metadata for a in ("ge", "gt", "le", "lt") if hasattr(m, a)}


BOUNDED = [n for n in FIELDS if _bounds(n)]


def test_env_and_overrides():
    e = EngineConfig.from_env({"QV_MAX_NUM_SEQS": "7", "QV_CUDA_GRAPHS": "off", "QV_KV_DTYPE": "int8", "QV_PORT": ""},
                              max_num_seqs=9, block_size=None)
    assert (e.max_num_seqs, e.cuda_graphs, e.kv_dtype, e.port, e.block_size) == (9, False, "int8", 8000, 16)
    assert EngineConfig.from_env({}) == EngineConfig()
    assert [env_name(n) for n in FIELDS] == ["QV_" + n.upper() for n in FIELDS]


def test_declared_env_name_must_be_the_derived_one(monkeypatch):
    """`lever(default, doc, "QV_NAME")` (the older style) is checked against QV_ + the field name."""
    monkeypatch.setattr(FIELDS["port"], "json_schema_extra", {"env": "QV_PORTS", "expect": None})
    with pytest.raises(TypeError, match="lever port: its environment variable is QV_PORT, not QV_PORTS"):
        config._check_env_names()


def test_unknown_environment_names_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="qv"):
        assert EngineConfig.from_env({"QV_MAX_NUM_SEQ": "3", "HOME": "/x"}) == EngineConfig()
    assert [r.getMessage() for r in caplog.records] == [
        "QV_MAX_NUM_SEQ in the environment is no qv lever and is ignored (see docs/LEVERS.md)"]


def test_constructor_takes_keywords_only(monkeypatch):
    """EngineConfig(...) is the defaults plus its keywords whatever the environment; from_env reads it."""
    monkeypatch.setenv("QV_MAX_NUM_SEQS", "3")
    assert EngineConfig().max_num_seqs == 64 and EngineConfig(block_size=8).max_num_seqs == 64
    assert EngineConfig.from_env().max_num_seqs == 3


@pytest.mark.parametrize("name", CHOICES)
def test_bad_choice_names_the_lever_and_the_choices(name):
    choices = get_args(FIELDS[name].annotation)
    for bad in ({}, {name: "no-such-choice"}), ({env_name(name): "no-such-choice"}, {}):
        with pytest.raises(ConfigError) as e:
            EngineConfig.from_env(bad[0], **bad[1])
        assert name in str(e.value) and ", ".join(choices) in str(e.value)
        if bad[0]:
            assert env_name(name) in str(e.value)
    for choice in choices:
        assert getattr(EngineConfig.from_env({env_name(name): choice}), name) == choice


@pytest.mark.parametrize("name", _of(int) + _of(float) + _of(bool))
def test_unparsable_env_names_the_variable(name):
    with pytest.raises(ConfigError, match=env_name(name)):
        EngineConfig.from_env({env_name(name): "not-a-number"})


@pytest.mark.parametrize("name", BOUNDED)
def test_out_of_range_names_the_lever_and_bound(name):
    """Just past each bound is refused with the bound in the message; the bound itself (ge/le) passes."""
    kind = FIELDS[name].annotation
    for attr, limit in _bounds(name).items():
        step = 1 if kind is int else 0.5
        past = {"ge": limit - step, "gt": limit, "le": limit + step, "lt": limit}[attr]
        with pytest.raises(ConfigError, match=name) as e:
            EngineConfig.from_env({}, **{name: kind(past)})
        assert {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[attr] + f" {limit}" in str(e.value)
        if attr in ("ge", "le"):
            assert getattr(EngineConfig(**{name: kind(limit)}), name) == limit


def test_device_pattern():
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert EngineConfig(device=good).device == good
    for bad in ("gpu", "cuda:", "cuda:x", "cpu0"):
        with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
            EngineConfig(device=bad)


def test_bool_words_as_before():
    words = {"1": True, "TRUE": True, "yes": True, " on ": True, "0": False, "False": False, "no": False, "off": False}
    for word, value in words.items():
        assert EngineConfig.from_env({"QV_CUDA_GRAPHS": word}).cuda_graphs is value
    for word in ("t", "y", "2", "enabled"):
        with pytest.raises(ConfigError, match="QV_CUDA_GRAPHS"):
            EngineConfig.from_env({"QV_CUDA_GRAPHS": word})


@pytest.mark.parametrize("name,value", [("max_num_seqs", True), ("max_num_seqs", 7.5), ("max_num_seqs", "1e3"),
                                        ("shutdown_grace_s", float("inf")), ("body_read_timeout_s", "nan"),
                                        ("gpu_memory_utilization", False)])
def test_not_numbers_are_refused(name, value):
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**{name: value})


def test_paths_and_numeric_strings_parse(tmp_path):
    e = EngineConfig(state_dir=tmp_path, model=tmp_path, max_num_seqs=" 12 ", gpu_memory_utilization="0.5")
    assert (e.state_dir, e.model, e.max_num_seqs, e.gpu_memory_utilization) == (str(tmp_path), str(tmp_path), 12, 0.5)


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="max_num_seq_typo"):
        EngineConfig.from_env({}, max_num_seq_typo=3)
    with pytest.raises(ConfigError, match="max_num_seq_typo"):
        EngineConfig(max_num_seq_typo=3)


def test_replace_copies_and_checks():
    e = EngineConfig(max_num_seqs=5)
    f = e.replace(block_size=32)
    assert (f.max_num_seqs, f.block_size, e.block_size) == (5, 32, 16)
    with pytest.raises(ConfigError, match="block_size"):
        e.replace(block_size=0)
    with pytest.raises(ConfigError, match="kv_dtype"):
        e.kv_dtype = "int4"  # assignment is checked too


# ---- levers files -------------------------------------------------------------------------------

LEVERS_FILE = """\
# production levers, the original stack's format

export QV_MAX_NUM_SEQS=8
QV_API_KEY="se cret#1"   # quoted: the # is the key's
QV_KV_DTYPE='int8'
QV_HOST=0.0.0.0 # an inline comment
QV_SERVED_MODEL_NAME=
"""


def test_env_file_format(tmp_path):
    path = tmp_path / "prod.env"
    path.write_text(LEVERS_FILE)
    assert read_env_file(path) == {"QV_MAX_NUM_SEQS": ("8", 3), "QV_API_KEY": ("se cret#1", 4),
                                   "QV_KV_DTYPE": ("int8", 5), "QV_HOST": ("0.0.0.0", 6),
                                   "QV_SERVED_MODEL_NAME": ("", 7)}
    e, origins = EngineConfig.resolve({}, path)
    assert (e.max_num_seqs, e.api_key, e.kv_dtype, e.host, e.served_model_name) == (8, "se cret#1", "int8", "0.0.0.0", "")
    assert origins == {"max_num_seqs": f"QV_MAX_NUM_SEQS in {path}:3", "api_key": f"QV_API_KEY in {path}:4",
                       "kv_dtype": f"QV_KV_DTYPE in {path}:5", "host": f"QV_HOST in {path}:6"}


def test_precedence_flags_over_file_over_environment(tmp_path, caplog):
    path = tmp_path / "l.env"
    path.write_text("QV_MAX_NUM_SEQS=8\nQV_BLOCK_SIZE=32\n")
    environ = {"QV_MAX_NUM_SEQS": "4", "QV_SPEC_K": "5", "QV_BLOCK_SIZE": "32"}
    with caplog.at_level(logging.WARNING, logger="qv"):
        e, origins = EngineConfig.resolve(environ, path, block_size=64)
    assert (e.max_num_seqs, e.spec_k, e.block_size) == (8, 5, 64)
    assert origins == {"max_num_seqs": f"QV_MAX_NUM_SEQS in {path}:1", "spec_k": "QV_SPEC_K in the environment",
                       "block_size": "argument"}
    # the environment value the file overrides is said once, and only where the two differ
    assert [r.getMessage() for r in caplog.records] == [f"QV_MAX_NUM_SEQS=4 in the environment is overridden by QV_MAX_NUM_SEQS=8 in {path}:1"]


@pytest.mark.parametrize("text,needles", [
    ("QV_MAX_NUM_SEQ=3\n", [":1:", "QV_MAX_NUM_SEQ ", "did you mean QV_MAX_NUM_SEQS"]),
    ("# ok\nMAX_NUM_SEQS=3\n", [":2:", "MAX_NUM_SEQS", "not a QV_* lever"]),
    ("CUDA_VISIBLE_DEVICES=0\n", [":1:", "CUDA_VISIBLE_DEVICES", "not a QV_* lever"]),
    ("QV_PORT=1\n\nQV_PORT=2\n", [":3:", "QV_PORT", "twice", "line 1"]),
    ("QV_PORT\n", [":1:", "QV_PORT", "KEY=value"]),
    ("just words\n", [":1:", "just words", "KEY=value"]),
    ("QV_PORT=eighty\n", [":1", "port", "QV_PORT", "an integer"]),
])
def test_env_file_errors_name_file_line_and_key(tmp_path, text, needles):
    path = tmp_path / "bad.env"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_env({}, path)
    assert str(path) in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_missing_env_file(tmp_path):
    with pytest.raises(ConfigError, match="levers file .*nope.env"):
        EngineConfig.from_env({}, tmp_path / "nope.env")


# ---- the state directory ------------------------------------------------------------------------


def test_state_dir_points_the_kernel_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "_SET_HERE", {})
    for var in config.KERNEL_CACHES:
        monkeypatch.delenv(var, raising=False)
    assert config.state_path("") == config.Path.home() / ".cache" / "qv"
    assert use_state_dir(str(tmp_path / "a")) == {"TRITON_CACHE_DIR": str(tmp_path / "a" / "triton"),
                                                  "CUPY_CACHE_DIR": str(tmp_path / "a" / "cupy")}
    assert (tmp_path / "a").is_dir()
    use_state_dir(str(tmp_path / "b"))  # a later state dir re-points what qv set
    assert os.environ["CUPY_CACHE_DIR"] == str(tmp_path / "b" / "cupy")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the operator's own stays
    assert use_state_dir(str(tmp_path / "c"))["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    # what a start with another state dir would use, without setting it (dry run, doctor)
    assert config.kernel_cache_dirs(str(tmp_path / "d")) == {"TRITON_CACHE_DIR": str(tmp_path / "mine"),
                                                            "CUPY_CACHE_DIR": str(tmp_path / "d" / "cupy")}
    assert os.environ["CUPY_CACHE_DIR"] == str(tmp_path / "c" / "cupy")
