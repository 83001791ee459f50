"""PEFT adapters -> qv deltas: PEFT's own per-module scaling (r, lora_alpha, rslora, rank/alpha
patterns), the right Linear and column range whether the checkpoint modules are fused or not,
rows outside delta_rows untouched, no base weight copied, and clear refusals of what qv cannot apply."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from qv.clef.adapters import (AdapterModule, ClefLayoutError, attach, clef_layout, load_clef, locate,
                              read_peft_adapter)
from qv.model.layers import FusedLinear, Linear
from qv.model.qwen3_5 import load_text_model


@pytest.mark.parametrize("config", [
    dict(r=8, lora_alpha=16, rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 5, "in_proj_b": 3}),
    dict(r=4, lora_alpha=8, use_rslora=True),
    dict(r=3, lora_alpha=7),
])
def test_scaling_is_peft_scaling(clef_dirs, tmp_path, config):
    from clef_finetune.model import discover_lora_targets, targets_regex
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    base = clef_dirs["adapters"]
    backbone = Qwen3_5ForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(backbone, LoraConfig(target_modules=targets_regex(discover_lora_targets(backbone)),
                                                     bias="none", **config))
    peft_model.save_pretrained(tmp_path)
    ours = {m.name: m for m in read_peft_adapter(tmp_path)}
    theirs = {name.removeprefix("base_model.model."): mod for name, mod in peft_model.named_modules()
              if hasattr(mod, "lora_A") and "default" in mod.lora_A}
    assert set(ours) == set(theirs) and len(ours) > 20
    for name, mod in theirs.items():
        assert ours[name].scale == pytest.approx(mod.scaling["default"], rel=1e-12), name
        assert torch.equal(ours[name].a, mod.lora_A["default"].weight.detach())
        assert torch.equal(ours[name].b, mod.lora_B["default"].weight.detach())


def _release_model(clef_dirs):
    return load_text_model(str(clef_dirs["release"]))


def _check_delta(fused_like, x, rows, column_check):
    """Output with delta rows vs without: rows outside `rows` bit-identical, inside as expected."""
    plain = fused_like(x, None)
    out = fused_like(x, rows)
    others = torch.ones(x.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[others], plain[others])
    column_check(out[rows], plain[rows])


@pytest.mark.parametrize("fused", [True, False])
def test_module_lands_on_its_columns(clef_dirs, fused):
    model = _release_model(clef_dirs)
    cfg = model.cfg
    layer = cfg.attention_layer_ids[0]
    mixer = model.layers[layer].mixer
    if not fused:  # a bias keeps fuse_linears from fusing: the layout mixed-format checkpoints get
        wq, wk, wv = mixer.qkv.parts[0].weight.split(mixer.qkv.sizes)
        mixer.qkv = FusedLinear([Linear(wq), Linear(wk, torch.zeros(wk.shape[0])), Linear(wv)], mixer.qkv.sizes)
        assert len(mixer.qkv.parts) == 3
    name = f"model.language_model.layers.{layer}.self_attn.k_proj"
    linear, start, end = locate(model, name)
    q_out, kv = mixer.qkv.sizes[0], mixer.qkv.sizes[1]
    assert (start, end) == ((q_out, q_out + kv) if fused else (0, kv))
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, cfg.hidden_size, generator=gen), torch.randn(kv, 3, generator=gen)
    attach(model, [AdapterModule(name, a, b, 0.7)])
    x = torch.randn(9, cfg.hidden_size, generator=gen)
    rows = torch.tensor([1, 4, 8])
    wk = (mixer.qkv.parts[0].weight[q_out:q_out + kv] if fused else mixer.qkv.parts[1].weight)

    def check(out_rows, plain_rows):
        expect = x[rows] @ (wk + 0.7 * b @ a).t()
        assert torch.allclose(out_rows[:, q_out:q_out + kv], expect, atol=1e-5)
        assert torch.equal(out_rows[:, :q_out], plain_rows[:, :q_out])  # q and v columns untouched
        assert torch.equal(out_rows[:, q_out + kv:], plain_rows[:, q_out + kv:])

    _check_delta(mixer.qkv.concat, x, rows, check)


def test_every_checkpoint_module_has_a_place(clef_dirs):
    """Each PEFT target name of both layer kinds resolves, with the checkpoint module's shape."""
    from qv.model.tiny import tensor_shapes

    model = _release_model(clef_dirs)
    config = json.loads((clef_dirs["release"] / "config.json").read_text())
    for name, shape in tensor_shapes(config).items():
        module = name.removesuffix(".weight")
        if len(shape) != 2 or not module.split(".")[-1].endswith("proj") or ".layers." not in name or "visual" in name:
            continue
        linear, start, end = locate(model, module)
        assert (end - start, linear.weight.shape[1]) == shape, module


def test_load_clef_copies_no_base_weight(clef_dirs):
    model = load_text_model(str(clef_dirs["adapters"]))
    before = {id(lin): (lin.weight.data_ptr(), lin.weight.clone()) for lin in _all(model)}
    assets = load_clef(clef_dirs["adapters"], model)
    assert assets.layout == "adapters" and assets.lora_modules > 0 and assets.deabl_modules > 0
    held = 0
    for lin in _all(model):
        ptr, w = before[id(lin)]
        assert lin.weight.data_ptr() == ptr and torch.equal(lin.weight, w)
        held += 0 if lin.bank is None else lin.bank.nbytes
    assert held == assets.delta_bytes > 0
    assert load_clef(clef_dirs["release"], _release_model(clef_dirs)).delta_bytes == 0


def _all(model):
    from qv.clef.adapters import all_linears

    return all_linears(model)


def _write_adapter(folder, tensors: dict, **config):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **config}))
    return folder


def _pair(module: str, r: int, k: int, n: int) -> dict:
    p = f"base_model.model.{module}"
    return {f"{p}.lora_A.weight": torch.zeros(r, k), f"{p}.lora_B.weight": torch.zeros(n, r)}


REFUSALS = [
    ("dora", dict(use_dora=True), "DoRA"),
    ("bias", dict(bias="all"), "bias='all'"),
    ("fan-in-fan-out", dict(fan_in_fan_out=True), "fan_in_fan_out"),
    ("modules-to-save", dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ("rank-mismatch", dict(r=4), "has rank 2 but adapter_config.json says 4"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_unsupported_adapter_options_are_refused(tmp_path, case):
    _, config, fragment = case
    folder = _write_adapter(tmp_path / "a", _pair("model.language_model.layers.1.mlp.down_proj", 2, 160, 96), **config)
    with pytest.raises(ClefLayoutError, match=fragment.replace("(", r"\(")):
        read_peft_adapter(folder)


@pytest.mark.parametrize("module, fragment", [
    ("lm_head", "not supported"),
    ("model.visual.blocks.0.attn.qkv", "not supported"),
    ("model.language_model.embed_tokens", "not supported"),
    ("model.language_model.layers.0.self_attn.q_proj", "layer 0 is a linear_attention layer"),
    ("model.language_model.layers.3.linear_attn.in_proj_qkv", "layer 3 is a full_attention layer"),
    ("model.language_model.layers.9.mlp.down_proj", "the model has 4 layers"),
])
def test_modules_qv_cannot_place_are_refused(clef_dirs, module, fragment):
    model = _release_model(clef_dirs)
    with pytest.raises(ClefLayoutError, match=fragment):
        attach(model, [AdapterModule(module, torch.zeros(1, 8), torch.zeros(8, 1), 1.0)])
    assert not any(lin.bank is not None for lin in _all(model))  # nothing half-attached


def test_broken_layouts_are_refused(clef_dirs, tmp_path):
    folder = _write_adapter(tmp_path / "b", {"base_model.model.model.layers.1.mlp.down_proj.lora_A.weight": torch.zeros(2, 4)})
    with pytest.raises(ClefLayoutError, match="lacks lora_B"):
        read_peft_adapter(folder)
    deabl = _write_adapter(tmp_path / "d", _pair("model.language_model.layers.1.mlp.down_proj", 2, 160, 96))
    with pytest.raises(ClefLayoutError, match="must be rank 1"):
        read_peft_adapter(deabl, rank=1)
    with pytest.raises(ClefLayoutError, match="no adapter_config.json"):
        read_peft_adapter(tmp_path / "missing")
    assert clef_layout(tmp_path) is None and load_clef(tmp_path, None) is None
    both = tmp_path / "both"
    (both / "clef").mkdir(parents=True)
    (both / "joint_head.safetensors").write_bytes(b"")
    (both / "clef" / "joint_head.safetensors").write_bytes(b"")
    with pytest.raises(ClefLayoutError, match="both a Clef release head and clef/"):
        clef_layout(both)
