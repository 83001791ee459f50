"""PEFT LoRA adapter folders for the tiny checkpoints, written by peft itself (test code only): random A
and B (PEFT starts B at zero), any subset of the projections, alpha scaling and rslora."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hf_oracle import hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
       "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
# name -> (rank, alpha, rslora, target modules): a subset of attention, a GDN + MLP subset, every projection
ADAPTERS = {
    "attn": (8, 16, False, ["q_proj", "v_proj", "down_proj"]),
    "gdn": (4, 8, True, ["in_proj_qkv", "out_proj", "gate_proj"]),
    "every": (16, 8, False, ALL),
}


def peft_model(model_dir: Path, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int):
    """The checkpoint's transformers model (fp32) under a PEFT LoRA of these settings, with random factors."""
    from peft import LoraConfig, get_peft_model

    base = hf_model(model_dir, torch.float32)
    # the text decoder's projections only (the vision tower has none of these names)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                     target_modules=rf".*language_model\.layers\.\d+\..*\.({'|'.join(targets)})$")
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in sorted(model.named_modules()):
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=gen) * a.shape[1] ** -0.5)
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3 / (module.scaling["default"] * math.sqrt(a.shape[0])))
    return model


def write_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    """Every adapter of ADAPTERS saved under out/<name> (peft's save_pretrained: safetensors + config)."""
    paths = {}
    for i, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = out / name
        if not (paths[name] / "adapter_config.json").is_file():
            peft_model(model_dir, rank, alpha, rslora, targets, seed=10 + i).save_pretrained(str(paths[name]))
    return paths


def merged_model(model_dir: Path, adapter: Path):
    """transformers' model with the saved adapter merged into its weights (the oracle), fp32, eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(model_dir, torch.float32), str(adapter)).merge_and_unload().eval()
