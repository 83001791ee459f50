"""A random Clef folder of the original stack's layout beside a model folder (qv bench serve --preset,
bench/clef.py): the joint head, rank-r LoRA on the last 3/8 of the layers, rank-1 deabl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from qv.clef.head import HeadConfig, expected_shapes
from qv.model import tiny

HEADS = {"27b": (1024, 16), "0.5b": (512, 8), "tiny": (32, 4)}  # head width, heads
RANKS = {"27b": 256, "0.5b": 64, "tiny": 4}
LORA_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
                "linear_attn.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DEABL_MODULES = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj")


def _adapter(folder: Path, shapes: dict, pre: str, layers: list[int], modules: tuple, rank: int, gen) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors, targets = {}, set()
    for i in layers:
        for m in modules:
            name = f"{pre}layers.{i}.{m}"
            if name + ".weight" not in shapes:
                continue  # the other mixer kind
            n, k = shapes[name + ".weight"]
            targets.add(m.split(".")[1])
            tensors[f"base_model.model.{name}.lora_A.weight"] = (torch.randn(rank, k, generator=gen) * k**-0.5)
            tensors[f"base_model.model.{name}.lora_B.weight"] = (torch.randn(n, rank, generator=gen) * 0.01)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(targets), "bias": "none"}))


def add_clef(model_dir: Path, preset: str, seed: int = 0) -> Path:
    """Write model_dir/clef/ (head + LoRA + deabl) unless it is there."""
    clef = model_dir / "clef"
    if (clef / "joint_head.safetensors").is_file():
        return model_dir
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    width, heads = HEADS[preset]
    head = HeadConfig(text["hidden_size"], width, 2, 2, heads, 4 * width)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(head).items():
        if not shape:
            tensors[name] = torch.tensor(1.0)
        elif "norm" in name and name.endswith("weight"):
            tensors[name] = torch.ones(shape)
        elif name.endswith("bias"):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    clef.mkdir(exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(clef / "joint_head.safetensors"))
    (clef / "joint_head_config.json").write_text(json.dumps(head.__dict__, indent=2))
    shapes = tiny.tensor_shapes(cfg)
    pre = "model.language_model." if "text_config" in cfg else "model."
    n = text["num_hidden_layers"]
    _adapter(clef / "adapter", shapes, pre, list(range(n - math.ceil(3 * n / 8), n)), LORA_MODULES, RANKS[preset], gen)
    _adapter(clef / "deabl", shapes, pre, list(range(2, n)), DEABL_MODULES, 1, gen)
    return model_dir
