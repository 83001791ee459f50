"""Block-FP8 checkpoints in Qwen's layout (tests/fp8_checkpoint.py writes them from the tiny presets): logits
against transformers on the dequantized twin (transformers runs no FP8 on the CPU), what stays dense, the
loader's refusals, random FP8 weights (`--load-format random --quantization fp8`) loading like the checkpoint
they would be, Clef deltas on FP8 linears and the MTP head from FP8 tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fp8_checkpoint import dense_twin, quantize_blocks, write_fp8
from hf_oracle import assert_matches_hf
from qv.clef.adapters import AdapterModule, attach
from qv.config import ConfigError, ModelConfig
from qv.kernels.linear import FP8Weight
from qv.llm import LLM, SamplingParams
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from qv.model.random_weights import RANDOM_QUANT, RandomReader
from qv.model.weights import CheckpointError
from test_quantize import read_all
from util import assert_close

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _logits(model, ids, delta_rows=None):
    t = ids.numel()
    batch = build_step_batch([t], [t], [[0, 1, 2]], [0], 16, logits_rows=list(range(t)), delta_rows=delta_rows)
    cache = allocate_cache(model.cfg, 3, 16, 1, torch.float32, torch.float32, torch.float32, "cpu")
    return model.compute_logits(model.forward(ids, torch.arange(t), batch, cache)[batch.logits_indices])


@pytest.mark.parametrize("preset,block", [("tiny", (32, 64)), ("gqa3", (16, 16))])
def test_fp8_logits_match_transformers(tiny_dirs, tmp_path, preset, block):
    """qv on the FP8 folder against transformers (float64) on its dequantized twin: the same bound as dense
    checkpoints, so the e4m3 values, the block scales (partial blocks at the edges: 96 inputs in 64-wide
    blocks) and what stays dense all load as the checkpoint means them."""
    fp8 = write_fp8(tiny_dirs(preset), tmp_path / "fp8", block)
    twin = dense_twin(fp8, tmp_path / "twin")
    ids = torch.randint(0, ModelConfig.from_dir(fp8).vocab_size, (23,), generator=torch.Generator().manual_seed(7))
    err, _ = assert_matches_hf(fp8, twin, ids, f"{preset} FP8 {block}")
    print(f"{preset} FP8 {block}: rel err {err:.2e}")


def test_fp8_quantized_and_dense_modules(tiny_dirs, tmp_path):
    """FP8 where the checkpoint stores e4m3, dense where modules_to_not_convert keeps it; q/k/v and gate/up
    fuse into one FP8 weight each, in_proj_qkv/z fuse beside the dense gates."""
    model = load_text_model(str(write_fp8(tiny_dirs("tiny"), tmp_path / "fp8", (32, 32))))
    gdn, attn = model.layers[0], model.layers[3]
    assert attn.kind == "full_attention"
    assert [type(p.weight) for p in attn.mixer.qkv.parts] == [FP8Weight]
    assert [type(p.weight) for p in attn.mlp.gate_up.parts] == [FP8Weight]
    assert [type(p.weight) for p in gdn.mixer.in_proj.parts] == [FP8Weight, torch.Tensor]
    assert isinstance(gdn.mixer.out_proj.weight, FP8Weight) and isinstance(attn.mixer.o_proj.weight, FP8Weight)
    assert isinstance(model.lm_head.weight, torch.Tensor) and model.embed_tokens.dtype == torch.float32
    fused = attn.mixer.qkv.parts[0].weight
    assert fused.weight.dtype == torch.float8_e4m3fn and fused.scale_inv.shape == (-(-fused.out_features // 32), 3)


def _mutate(folder, tmp_path, tensors=None, quant=None):
    out = tmp_path / "bad"
    out.mkdir()
    raw = read_all(folder)
    if tensors:
        tensors(raw)
    save_file(raw, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if quant:
        quant(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


LAYER3 = "model.language_model.layers.3.self_attn."
O_PROJ = LAYER3 + "o_proj"


@pytest.mark.parametrize("tensors,quant,error,needles", [
    (lambda t: t.update({O_PROJ + ".weight_scale_inv": t[O_PROJ + ".weight_scale_inv"][:1]}), None,
     CheckpointError, ["o_proj.weight_scale_inv", "shape"]),
    (lambda t: t.update({O_PROJ + ".weight": t[O_PROJ + ".weight"].float()}), None, CheckpointError,
     ["o_proj.weight", "float8_e4m3fn"]),
    (lambda t: t.update({O_PROJ + ".input_scale": torch.ones(1)}), None, CheckpointError, ["input_scale", "static"]),
    (None, lambda q: q["modules_to_not_convert"].append(O_PROJ), CheckpointError, ["o_proj", "excludes"]),
    (lambda t: t.update(zip(("lm_head.weight", "lm_head.weight_scale_inv"),
                            quantize_blocks(t["lm_head.weight"], (32, 32)))),
     lambda q: q["modules_to_not_convert"].remove("lm_head"), CheckpointError, ["lm_head", "not built"]),
    (None, lambda q: q.update(activation_scheme="static"), ConfigError, ["activation_scheme", "static"]),
    (None, lambda q: q.pop("weight_block_size"), ConfigError, ["weight_block_size"]),
    (None, lambda q: q.update(quant_method="gptq", bits=8), CheckpointError, ["weight_scale_inv", "fp8"]),
    (lambda t: t.update({LAYER3 + "k_proj.weight": t[LAYER3 + "k_proj.weight"]
                         .float() * t.pop(LAYER3 + "k_proj.weight_scale_inv").max()}), None,
     CheckpointError, ["k_proj", "dense", "excludes"]),
])
def test_fp8_checkpoint_errors(tiny_dirs, tmp_path, tensors, quant, error, needles):
    fp8 = write_fp8(tiny_dirs("tiny"), tmp_path / "fp8", (32, 32))
    with pytest.raises(error) as e:
        load_text_model(str(_mutate(fp8, tmp_path, tensors, quant)))
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_random_fp8_weights_load_like_the_checkpoint_they_would_be(tiny_dirs, tmp_path):
    """RandomReader's FP8 tensors written in Qwen's layout and read back give identical logits; the dense
    modules are the ones Qwen's releases keep dense."""
    src = tiny_dirs("tiny")
    cfg = ModelConfig.from_dir(src)
    cfg = cfg.__class__(**{**cfg.__dict__, "quant": RANDOM_QUANT["fp8"].__class__(
        **{**RANDOM_QUANT["fp8"].__dict__, "weight_block_size": (32, 32), "group_size": 32})})
    reader = RandomReader(cfg, seed=5)
    from_random = load_text_model(str(src), cfg, reader=reader)
    tensors, not_converted = {}, []
    writer = RandomReader(cfg, seed=5)
    for name, shape in writer.shapes.items():
        module = name.removesuffix(".weight")
        if name.startswith("mtp."):
            continue
        if writer.has(module + ".weight_scale_inv") and name.endswith(".weight"):
            w = writer.linear(module, shape[0], shape[1], torch.float32)
            tensors.update({name: w.weight, module + ".weight_scale_inv": w.scale_inv})
        else:
            tensors[name] = writer.tensor(name)
            if len(shape) == 2:
                not_converted.append(module)
    text = {m.rsplit(".", 1)[-1] for m in not_converted if ".visual." not in m}
    assert text == {"embed_tokens", "lm_head", "in_proj_a", "in_proj_b"}
    out = tmp_path / "ckpt"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32],
                                     "modules_to_not_convert": not_converted}
    (out / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([3, 17, 99, 4, 250]) % cfg.vocab_size
    a, b = _logits(from_random, ids), _logits(load_text_model(str(out)), ids)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_forced_fp8_on_a_dense_config(tmp_path):
    """`load_format=random, quantization=fp8` on a config-only folder: 128x128 FP8 weights, generation runs."""
    from test_random_weights import SHAPE_128, write_config

    folder = write_config(tmp_path / "m", preset="random-128", **SHAPE_128)
    llm = LLM(model=str(folder), load_format="random", quantization="fp8")
    layers = llm.engine.runner.model.layers
    weights = [layers[0].mixer.in_proj.parts[0].weight, layers[0].mixer.out_proj.weight,
               layers[3].mixer.qkv.parts[0].weight, layers[3].mlp.gate_up.parts[0].weight]
    assert all(isinstance(w, FP8Weight) and w.block == (128, 128) for w in weights)
    assert isinstance(layers[0].mixer.in_proj.parts[1].weight, torch.Tensor)  # the GDN gates stay dense
    assert len(llm.generate(["hello"], GREEDY)[0].outputs[0].token_ids) == 8


def test_clef_deltas_on_an_fp8_model(tiny_dirs, tmp_path):
    """Clef's low-rank deltas on FP8 linears: the FP8 model with deltas equals its dense twin with them."""
    fp8_dir = write_fp8(tiny_dirs("gqa3"), tmp_path / "fp8", (16, 16))
    fp8, dense = load_text_model(str(fp8_dir)), load_text_model(str(dense_twin(fp8_dir, tmp_path / "twin")))
    gen = torch.Generator().manual_seed(11)
    modules = [AdapterModule(name, torch.randn(4, k, generator=gen) * 0.3, torch.randn(n, 4, generator=gen) * 0.3, 0.5)
               for name, n, k in [("model.layers.0.mlp.up_proj", 96, 48),
                                  ("model.layers.0.linear_attn.out_proj", 48, 48),
                                  ("model.layers.1.self_attn.o_proj", 48, 96)]]
    for model in (fp8, dense):
        attach(model, modules)
    ids = torch.arange(5, 30) % fp8.cfg.vocab_size
    rows = list(range(3, 17))
    got, want = _logits(fp8, ids, rows), _logits(dense, ids, rows)
    assert_close("FP8 model with Clef deltas vs its dense twin", got, want, 1e-5)
    plain = _logits(fp8, ids)
    assert (got - plain).abs().max() > 1e-2  # the deltas changed the logits (so the comparison can fail)


def test_mtp_head_from_fp8_tensors_drafts(tiny_dirs, tmp_path):
    """The MTP head's fc and layer loaded from FP8 tensors; speculation leaves greedy output unchanged."""
    fp8 = write_fp8(tiny_dirs("tiny", mtp=True), tmp_path / "fp8mtp", (32, 32))
    prompts = ["one two three", "a b a b a b"]
    base = [o.outputs[0].token_ids for o in LLM(model=str(fp8)).generate(prompts, GREEDY)]
    llm = LLM(model=str(fp8), spec="mtp", spec_k=2)
    head = llm.engine.spec.head
    assert all(isinstance(w, FP8Weight) for w in (head.fc.weight, head.layer.mlp.gate_up.parts[0].weight))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == base
