"""Random-weight loading (load_format=random, vLLM's dummy format): a folder with only config.json serves,
the weights land in the layout a real checkpoint loads into (a checkpoint written from the same random
tensors gives identical logits), GPTQ where the quantization config says so, and value ranges like a
real checkpoint's."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import save_file

from qv import LLM, SamplingParams
from qv.config import ConfigError, ModelConfig
from qv.kernels.linear import GPTQWeight
from qv.model import tiny
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.quantize import pack_gptq
from qv.model.qwen3_5 import load_text_model
from qv.model.random_weights import RandomReader
from qv.model.weights import CheckpointError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# every dim a multiple of 128, so GPTQ group 128 applies to every linear (as at the 27B shapes)
SHAPE_128 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=32, partial_rotary_factor=0.25,
                 mrope_section=[2, 1, 1], tie_word_embeddings=False, vision=False, vocab_size=512)


def write_config(folder, preset="gqa1", quant: dict | None = None, **shape):
    if shape:
        tiny.PRESETS[preset] = shape
    _, special = tiny.tokenizer_json()
    config = tiny.build_config(preset, 512, special)
    if quant is not None:
        config["quantization_config"] = dict({"quant_method": "gptq", "bits": 8, "sym": True, "desc_act": False}, **quant)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_config_only_folder_serves_with_the_tiny_tokenizer(tmp_path, caplog):
    folder = write_config(tmp_path / "m")
    with caplog.at_level(logging.WARNING, logger="qv"):
        llm = LLM(model=str(folder), load_format="random")
    assert "no tokenizer files" in caplog.text
    out = llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    assert isinstance(out[0].outputs[0].text, str)


def test_without_random_a_config_only_folder_is_an_error(tmp_path):
    folder = write_config(tmp_path / "m")
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(model=str(folder))
    with pytest.raises(ConfigError, match="load_format=random"):
        LLM(model=str(folder), quantization="gptq-int8")


def test_quantization_config_gives_gptq_codes(tmp_path):
    folder = write_config(tmp_path / "m", preset="tiny", quant={"group_size": 16})
    model = LLM(model=str(folder), load_format="random").engine.runner.model
    down = model.layers[0].mlp.down.weight
    assert isinstance(down, GPTQWeight) and down.qweight.dtype == torch.uint8 and down.group_size == 16
    assert torch.equal(down.g_idx.long(), torch.arange(down.in_features) // 16)
    assert isinstance(model.lm_head.weight, torch.Tensor)  # lm_head=false by default, as in GPTQ configs
    # uniform codes and their scales give the fan_in^-1/2 spread of a dense random weight
    deq = (down.qweight.float() - 128) * down.scales.float().repeat_interleave(16, 0)
    assert abs(deq.std().item() * math.sqrt(down.in_features) - 1) < 0.1


def test_forced_gptq_int8_on_a_dense_config(tmp_path):
    folder = write_config(tmp_path / "m", preset="random-128", **SHAPE_128)
    model = LLM(model=str(folder), load_format="random", quantization="gptq-int8").engine.runner.model
    layers = model.layers
    weights = [layers[0].mixer.in_proj.parts[0].weight, layers[0].mixer.out_proj.weight,
               layers[3].mixer.qkv.parts[0].weight, layers[3].mlp.gate_up.parts[0].weight]
    assert all(isinstance(w, GPTQWeight) and w.group_size == 128 for w in weights)
    assert layers[0].mixer.in_proj.runs == [[0, 1, 2, 3]]  # qkv, z, b and a in one GEMV
    folder_odd = write_config(tmp_path / "odd")  # gqa1's 64-wide hidden size is no multiple of 128
    with pytest.raises(CheckpointError, match="group 128"):
        LLM(model=str(folder_odd), load_format="random", quantization="gptq-int8")


def test_value_ranges_like_a_checkpoint():
    cfg = ModelConfig.from_dict(tiny.build_config("tiny", 512, tiny.tokenizer_json()[1]))
    r = RandomReader(cfg, seed=3)
    p = "model.language_model.layers.0."
    a_log = r.tensor(p + "linear_attn.A_log")
    assert a_log.exp().min() >= 0.5 and a_log.exp().max() <= 8.0
    dt = r.tensor(p + "linear_attn.dt_bias")
    assert dt.abs().max() <= 1.0
    assert abs(r.tensor(p + "input_layernorm.weight").mean()) < 0.3  # (1 + w) norms: w near 0
    assert abs(r.tensor(p + "linear_attn.norm.weight").mean() - 1) < 0.3  # plain-weight norm: near 1
    embed = r.tensor("model.language_model.embed_tokens.weight")
    assert abs(embed.std().item() - 1) < 0.05


def test_same_seed_same_weights_whatever_the_order():
    cfg = ModelConfig.from_dict(tiny.build_config("gqa1", 512, tiny.tokenizer_json()[1]))
    a, b, c = RandomReader(cfg, seed=1), RandomReader(cfg, seed=1), RandomReader(cfg, seed=2)
    names = a.names()
    first = {n: a.tensor(n) for n in names}
    second = {n: b.tensor(n) for n in reversed(names)}
    assert all(torch.equal(first[n], second[n]) for n in names)
    assert not torch.equal(first[names[-1]], c.tensor(names[-1]))


def _write_as_checkpoint(reader: RandomReader, cfg: ModelConfig, folder, config: dict, group: int, bits: int = 8):
    """The reader's tensors as a GPTQ (v1) checkpoint folder, packed the way GPTQ writers pack them."""
    tensors = {}
    for name, shape in reader.shapes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and reader.has(module + ".qweight"):
            w = reader.linear(module, shape[0], shape[1], torch.float32)
            zeros = torch.full(w.scales.shape, w.symmetric_zero, dtype=torch.int32)
            qweight, qzeros = pack_gptq(w.codes(), zeros, bits)
            tensors.update({module + ".qweight": qweight, module + ".qzeros": qzeros, module + ".scales": w.scales,
                            module + ".g_idx": w.g_idx})
        else:
            tensors[name] = reader.tensor(name)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = dict(config, quantization_config={"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True,
                                               "desc_act": False, "checkpoint_format": "gptq"})
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bits", [8, 4])
def test_random_weights_load_like_the_checkpoint_they_would_be(tmp_path, bits):
    """Oracle: the same random tensors written as a GPTQ checkpoint and read back by CheckpointReader give
    identical logits, so the random layout is the layout a real checkpoint loads into."""
    quant = {"group_size": 16, "checkpoint_format": "gptq", "bits": bits}
    if bits == 4:  # the GDN gates ([4, 96]) are too narrow to pack 8 columns a word
        quant["dynamic"] = {r"-:.*in_proj_[ab]$": {}}
    folder = write_config(tmp_path / "rand", preset="tiny", quant=quant)
    config = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_dir(folder)
    from_random = load_text_model(str(folder), cfg, reader=RandomReader(cfg, seed=5))
    _write_as_checkpoint(RandomReader(cfg, seed=5), cfg, tmp_path / "ckpt", config, 16, bits)
    from_disk = load_text_model(str(tmp_path / "ckpt"))
    ids = torch.tensor([3, 17, 99, 4, 250])
    logits = []
    for model in (from_random, from_disk):
        batch = build_step_batch([5], [5], [[0]], [0], 16, logits_rows=list(range(5)))
        cache = allocate_cache(cfg, 1, 16, 1, torch.float32, torch.float32, torch.float32, "cpu")
        logits.append(model.compute_logits(model.forward(ids, torch.arange(5), batch, cache)))
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("quantization", ["gptq-int4", "awq"])
def test_forced_4bit_on_a_dense_config(tmp_path, quantization):
    folder = write_config(tmp_path / "m", preset="random-128", **SHAPE_128)
    llm = LLM(model=str(folder), load_format="random", quantization=quantization)
    layers = llm.engine.runner.model.layers
    weights = [layers[0].mixer.in_proj.parts[0].weight, layers[0].mixer.out_proj.weight,
               layers[3].mixer.qkv.parts[0].weight, layers[3].mlp.gate_up.parts[0].weight]
    assert all(isinstance(w, GPTQWeight) and (w.bits, w.group_size) == (4, 128) for w in weights)
    assert all(w.qweight.shape[0] * 2 == w.in_features for w in weights)
    assert all((w.zeros is None) == (quantization == "gptq-int4") for w in weights)  # AWQ has zero points
    codes = torch.cat([w.codes().flatten() for w in weights]).float()
    assert codes.max() == 15 and abs(codes.mean().item() - 7.5) < 0.1  # uniform nibbles
    out = llm.generate(["hello"], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 6
