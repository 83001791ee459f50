"""Checkpoint loading: single and sharded files, both text prefixes, bf16/fp16/fp32 storage,
GPTQ zero formats; and every malformed checkpoint raises an error naming the tensor, module,
file or rule at fault. Each error case starts from a checkpoint that loads, so the error is the
mutation's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qv.config import ConfigError, ModelConfig
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from qv.model.quantize import quantize_checkpoint
from qv.model.weights import CheckpointError, CheckpointReader
from test_quantize import pack, read_all

L0 = "model.layers.0."  # gqa1: layer 0 is attention, layer 1 GDN
GDN = "model.layers.1.linear_attn."


def write(folder: Path, tensors: dict, config: dict | None = None, shards: int = 1) -> Path:
    for f in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")):
        f.unlink()
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    else:
        names, weight_map = sorted(tensors), {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k].contiguous() for k in names[i::shards]}, str(folder / fname))
            weight_map.update({k: fname for k in names[i::shards]})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def logits(folder) -> torch.Tensor:
    model = load_text_model(str(folder))
    ids = torch.arange(3, 40) % model.cfg.vocab_size
    t = ids.numel()
    batch = build_step_batch([t], [t], [[0, 1, 2]], [0], 16, logits_rows=list(range(t)))
    cache = allocate_cache(model.cfg, 3, 16, 1, torch.float32, torch.float32, torch.float32, "cpu")
    return model.compute_logits(model.forward(ids, torch.arange(t), batch, cache)[batch.logits_indices])


@pytest.fixture
def dense(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs("gqa1"), tmp_path / "dense")


@pytest.fixture(scope="module")
def gptq_src(tiny_dirs, tmp_path_factory):
    return quantize_checkpoint(tiny_dirs("gqa1"), tmp_path_factory.mktemp("w") / "gptq", group_size=16)


@pytest.fixture
def gptq(gptq_src, tmp_path):
    return shutil.copytree(gptq_src, tmp_path / "gptq")


# ---- what loads ---------------------------------------------------------------------------------


def test_sharded_equals_single(dense, tmp_path):
    ref = logits(dense)
    sharded = write(shutil.copytree(dense, tmp_path / "sh"), read_all(dense), shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    assert torch.equal(logits(sharded), ref)


def test_both_prefixes_load(dense, tiny_dirs, tmp_path):
    ref = logits(dense)  # Qwen3_5ForCausalLM config, tensors renamed to the multimodal prefix
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in read_all(dense).items()}
    assert torch.equal(logits(write(dense, renamed)), ref)
    mm = shutil.copytree(tiny_dirs("tiny"), tmp_path / "mm")  # multimodal config, text-only `model.` tensors
    ref = logits(mm)
    text_only = {("model." + k[21:] if k.startswith("model.language_model.") else k): v
                 for k, v in read_all(mm).items() if not k.startswith("model.visual.")}
    assert torch.equal(logits(write(mm, text_only)), ref)
    both = dict(text_only, **{"model.language_model.embed_tokens.weight": text_only["model.embed_tokens.weight"].clone()})
    with pytest.raises(CheckpointError, match="ambiguous"):
        load_text_model(str(write(mm, both)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_storage(dense, tmp_path, dtype):
    t = read_all(dense)
    rounded = write(shutil.copytree(dense, tmp_path / "r"), {k: v.to(dtype).float() for k, v in t.items()})
    half = write(dense, {k: v.to(dtype) for k, v in t.items()})
    assert torch.equal(logits(half), logits(rounded))  # loaded as the exact stored values, upcast


@pytest.mark.parametrize("fmt,stored,expect", [
    ("gptq", 0xFF, 256),  # v1 zero 0 written as byte 0xFF reads back 256 (exllama), not 0
    ("gptq", 0x7F, None),  # v1 symmetric: stored 127 -> 128 -> no zero tensor
    ("gptq", 0x10, 0x11),
    ("gptq_v2", 0x80, None),
    ("gptq_v2", 0x10, 0x10),
])
def test_zero_point_formats(dense, fmt, stored, expect):
    cfg = ModelConfig.from_dir(dense)
    raw = json.loads((dense / "config.json").read_text())
    raw["quantization_config"] = {"bits": 8, "group_size": -1, "sym": False, "checkpoint_format": fmt}
    k, n = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    t = read_all(dense)
    del t[L0 + "self_attn.k_proj.weight"]
    zeros = torch.full((1, n), stored)
    zeros[0, 0] = 0x7F if fmt == "gptq" else 0x80  # one symmetric column beside the others
    t.update({L0 + "self_attn.k_proj.qweight": pack(torch.randint(0, 256, (k, n)), 0),
              L0 + "self_attn.k_proj.qzeros": pack(zeros, 1), L0 + "self_attn.k_proj.scales": torch.ones(1, n)})
    write(dense, t, raw)
    w = CheckpointReader(dense, ModelConfig.from_dir(dense)).linear(L0 + "self_attn.k_proj", n, k, torch.float32)
    if expect is None:  # all 128: the symmetric case, kept as "no zero tensor"
        assert w.zeros is None
    else:
        assert w.zeros[0, 0] == 128 and bool((w.zeros[0, 1:] == expect).all()), w.zeros


# ---- what fails, and names its cause --------------------------------------------------------------


def _tensors(fn):
    """A mutation of the stored tensors: fn(dict) edits them in place."""
    def mutate(folder: Path):
        t = read_all(folder)
        fn(t)
        write(folder, t)
    return mutate


def _qcfg(**kw):
    def mutate(folder: Path):
        raw = json.loads((folder / "config.json").read_text())
        raw["quantization_config"].update(kw)
        (folder / "config.json").write_text(json.dumps(raw))
    return mutate


def _sharded(then):
    def mutate(folder: Path):
        write(folder, read_all(folder), shards=3)
        then(folder)
    return mutate


def _drop_from_shard(folder: Path):
    """Rewrite the shard holding model.norm.weight without it; the index still points there."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard, t = index["model.norm.weight"], read_all(folder)
    keep = {k: t[k].contiguous() for k, f in index.items() if f == shard and k != "model.norm.weight"}
    save_file(keep, str(folder / shard))


def _duplicate(folder: Path):
    save_file({"model.norm.weight": read_all(folder)["model.norm.weight"]}, str(folder / "extra.safetensors"))


def _untie(folder: Path):
    raw = json.loads((folder / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(raw))


def _set(name, value):
    return _tensors(lambda t: t.__setitem__(name, value))


def _pop(name):
    return _tensors(lambda t: t.pop(name))


DENSE_ERRORS = [
    ("shape", _tensors(lambda t: t.__setitem__(L0 + "mlp.gate_proj.weight", t[L0 + "mlp.gate_proj.weight"][:-1])),
     [L0 + "mlp.gate_proj.weight", "shape"]),
    ("dense dtype", _tensors(lambda t: t.__setitem__(L0 + "mlp.up_proj.weight", t[L0 + "mlp.up_proj.weight"].int())),
     [L0 + "mlp.up_proj.weight", "int32"]),
    ("norm dtype", _set("model.norm.weight", torch.ones(64, dtype=torch.int64)), ["model.norm.weight", "int64"]),
    ("missing tensor", _pop(GDN + "A_log"), [GDN + "A_log"]),
    ("unknown extra tensor", _set("model.layers.0.self_attn.rotary.inv_freq", torch.ones(4)),
     ["model.layers.0.self_attn.rotary.inv_freq"]),
    ("missing shard", _sharded(lambda f: (f / "model-00002-of-00003.safetensors").unlink()),
     ["missing shard", "model-00002-of-00003.safetensors"]),
    ("index points to wrong shard", _sharded(_drop_from_shard), ["model.norm.weight", "does not contain it"]),
    ("bad index", _sharded(lambda f: (f / "model.safetensors.index.json").write_text("{nope")),
     ["model.safetensors.index.json"]),
    ("duplicate", _duplicate, ["model.norm.weight", "extra.safetensors"]),
    ("corrupt file", lambda f: (f / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage"),
     ["model.safetensors"]),
    ("no safetensors", lambda f: ((f / "model.safetensors").rename(f / "pytorch_model.bin")),
     ["no *.safetensors", "pytorch_model.bin"]),
    ("qweight without quantization_config",
     _tensors(lambda t: t.pop(L0 + "mlp.down_proj.weight") is not None
              and t.__setitem__(L0 + "mlp.down_proj.qweight", torch.zeros(32, 64, dtype=torch.int32))),
     [L0 + "mlp.down_proj", "quantization_config"]),
]

GPTQ_ERRORS = [
    ("excluded by dynamic (HF name)", _qcfg(dynamic={r"-:model\.layers\.0\.mlp\.": {}}),
     [L0 + "mlp.gate_proj", r"-:model\.layers\.0\.mlp\."]),
    ("excluded by dynamic (vLLM fused name)", _qcfg(dynamic={r"-:.*gate_up_proj": {}}),
     [L0 + "mlp.gate_proj", "gate_up_proj"]),
    ("excluded by modules_to_not_convert", _qcfg(modules_to_not_convert=["self_attn.o_proj"]),
     [L0 + "self_attn.o_proj", "modules_to_not_convert"]),
    ("dense member of a quantized fused layer",
     _tensors(lambda t: [t.pop(L0 + f"self_attn.k_proj.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")]
              and t.__setitem__(L0 + "self_attn.k_proj.weight", torch.zeros(64, 64))),
     [L0 + "self_attn.k_proj", "q_proj", "v_proj"]),
    ("lm_head quantized with lm_head=false", lambda f: (_set("lm_head.qweight", torch.zeros(1, 4, dtype=torch.int32))(f),
                                                        _untie(f)), ["lm_head", "lm_head=false"]),
    ("dynamic bits override", _qcfg(dynamic={r"+:.*down_proj": {"bits": 3}}), [L0 + "mlp.down_proj", "bits=3"]),
    ("dynamic 4-bit rule on 8-bit codes", _qcfg(dynamic={r"+:.*down_proj": {"bits": 4}}),
     [L0 + "mlp.down_proj.qweight", "shape"]),
    ("bad dynamic regex", _qcfg(dynamic={"-:(": {}}), ["'-:('"]),
    ("group_size 0", _qcfg(group_size=0), ["group_size=0"]),
    ("group does not divide K", _qcfg(group_size=48), ["group_size 48", "in_features 64"]),
    ("qweight dtype", _tensors(lambda t: t.__setitem__(L0 + "mlp.up_proj.qweight", t[L0 + "mlp.up_proj.qweight"].float())),
     [L0 + "mlp.up_proj.qweight", "float32"]),
    ("scales dtype", _tensors(lambda t: t.__setitem__(L0 + "mlp.up_proj.scales", t[L0 + "mlp.up_proj.scales"].int())),
     [L0 + "mlp.up_proj.scales", "int32"]),
    ("scales groups", _tensors(lambda t: t.__setitem__(L0 + "mlp.up_proj.scales", t[L0 + "mlp.up_proj.scales"][:2])),
     [L0 + "mlp.up_proj.scales", "shape"]),
    ("qzeros shape", _tensors(lambda t: t.__setitem__(L0 + "mlp.up_proj.qzeros", t[L0 + "mlp.up_proj.qzeros"][:, :3])),
     [L0 + "mlp.up_proj.qzeros", "shape"]),
    ("g_idx range", _tensors(lambda t: t[L0 + "mlp.up_proj.g_idx"].__setitem__(0, 9)), [L0 + "mlp.up_proj.g_idx", "0..3"]),
    ("desc_act without g_idx", lambda f: (_pop(L0 + "mlp.up_proj.g_idx")(f), _qcfg(desc_act=True)(f)),
     [L0 + "mlp.up_proj", "desc_act", "g_idx"]),
    ("asym without qzeros", lambda f: (_pop(L0 + "mlp.up_proj.qzeros")(f), _qcfg(sym=False)(f)),
     [L0 + "mlp.up_proj", "qzeros"]),
    ("non-zero placeholder bias", _set(L0 + "mlp.up_proj.bias", torch.ones(128)), [L0 + "mlp.up_proj.bias"]),
    ("both dense and quantized", _set(L0 + "mlp.up_proj.weight", torch.zeros(128, 64)),
     [L0 + "mlp.up_proj", "both"]),
]


@pytest.mark.parametrize("mutate,needles", [c[1:] for c in DENSE_ERRORS], ids=[c[0] for c in DENSE_ERRORS])
def test_dense_checkpoint_errors(dense, mutate, needles):
    load_text_model(str(dense))
    mutate(dense)
    with pytest.raises(ValueError) as e:  # CheckpointError (and ConfigError) are ValueErrors
        load_text_model(str(dense))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("mutate,needles", [c[1:] for c in GPTQ_ERRORS], ids=[c[0] for c in GPTQ_ERRORS])
def test_gptq_checkpoint_errors(gptq, mutate, needles):
    load_text_model(str(gptq))
    mutate(gptq)
    with pytest.raises((CheckpointError, ConfigError)) as e:  # quantization_config values: ConfigError
        load_text_model(str(gptq))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_mixed_formats_allowed_when_config_says_so(gptq):
    """The error case above becomes legal once the config excludes the dense member (and GDN
    in_proj_a/b are dense beside quantized in_proj_qkv/z throughout, by qv quantize's default)."""
    t = read_all(gptq)
    for s in ("qweight", "qzeros", "scales", "g_idx"):
        t.pop(L0 + f"self_attn.k_proj.{s}")
    t[L0 + "self_attn.k_proj.weight"] = torch.randn(64, 64) * 0.1
    write(gptq, t)
    _qcfg(modules_to_not_convert=[L0 + "self_attn.k_proj"])(gptq)
    model = load_text_model(str(gptq))
    assert len(model.layers[0].mixer.qkv.parts) == 3  # dense k_proj kept apart from the int8 q/v
    assert model.layers[1].mixer.in_proj.runs == [[0, 1], [2, 3]]  # int8 qkv+z in one GEMV, dense b+a in another


def test_vllm_style_rule_on_multimodal_names(tiny_dirs, tmp_path):
    """A `dynamic` rule written against vLLM's module name (language_model.model.*) is honoured
    for the HF checkpoint name (model.language_model.*)."""
    folder = quantize_checkpoint(tiny_dirs("tiny"), tmp_path / "q", group_size=32)
    load_text_model(str(folder))
    _qcfg(dynamic={r"-:language_model\.model\.layers\.2\.mlp\.down_proj$": {}})(folder)
    with pytest.raises(CheckpointError, match=r"model\.language_model\.layers\.2\.mlp\.down_proj is stored GPTQ"):
        load_text_model(str(folder))
