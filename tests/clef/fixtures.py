"""Tiny Clef folders of both layouts, random but deterministic, for tests and the CPU demo.

The files are written by the tools that write them for real: Cloudflare's JointSchemaHead
(from clef-finetune's vendored joint_schema_model.py) for the head, PEFT through clef-finetune's
own target discovery (`discover_lora_targets`, `targets_regex`) and checkpoint writer
(`save_checkpoint`) for the LoRA adapter, PEFT's `save_pretrained` for the rank-1 deabl adapter.
So these folders have exactly clef-finetune's layout. Needs the test extra (clef-finetune
installed with --no-deps, peft): test code only, imported as `clef.fixtures` (tests/ is on sys.path).
The embedded default model's head is qv's own (qv/model/tiny.py, write_clef_head).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from qv.model.tiny import make_tiny

# Two layers of each kind so the loops over routing/decoder layers are exercised.
HEAD = {"width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64}
# LoRA on every decoder linear of layers 1.. (GDN and attention projections, MLP), deabl on
# the residual writers (o_proj, out_proj, down_proj) of layers 1.. like the original's "2-63".
LORA = {"r": 4, "alpha": 8, "use_rslora": True, "alpha_pattern": {"in_proj_z": 6}, "first_layer": 1}
DEABL_SUFFIXES = ("o_proj", "out_proj", "down_proj")


def _hidden_size(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg.get("text_config", cfg)["hidden_size"]


def _random_head(hidden_size: int, seed: int):
    """Cloudflare's JointSchemaHead with every parameter random (norm gains and biases included,
    so a missing bias or a swapped norm changes the answers)."""
    from clef_finetune.jsm import load_jsm

    jsm = load_jsm()
    config = dict(hidden_size=hidden_size, **HEAD)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = jsm.JointSchemaHead(**config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 0:
                p.fill_({"prior_logit_scale": 3.5, "joint_logit_scale": 4.0, "residual_gate": 1.0}[name])
            elif "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return head.eval(), config


def make_clef_release(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Layout (a): a tiny backbone with joint_head.safetensors (bf16, like the release) and its config."""
    out = make_tiny(out_dir, preset, seed)
    head, config = _random_head(_hidden_size(out), seed + 100)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()},
              str(out / "joint_head.safetensors"))
    (out / "joint_head_config.json").write_text(json.dumps(config, indent=2))
    return out


def _backbone(model_dir: Path):
    from clef_finetune.model import load_backbone

    return load_backbone(model_dir, torch.float32, "cpu")


def _randomize_lora(peft_model, seed: int) -> None:
    """PEFT starts B at zero (a no-op delta); give A and B values so that scale * B A is about a
    third of the base weight's magnitude."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in sorted(peft_model.named_modules()):
            if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            r, k = a.shape
            a.copy_(torch.randn(a.shape, generator=gen) * k**-0.5)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.35 / (module.scaling["default"] * math.sqrt(r)))


def _targets(backbone, first_layer: int, suffixes=None) -> list[str]:
    from clef_finetune.model import discover_lora_targets

    names = discover_lora_targets(backbone, include_suffixes=list(suffixes) if suffixes else None)
    return [n for n in names if int(n.split("layers.")[1].split(".")[0]) >= first_layer]


def make_clef_adapters(out_dir: str | Path, preset: str = "mixed", seed: int = 0, deabl: bool = True) -> Path:
    """Layout (b): tiny base weights plus clef/ with the head, a clef-finetune checkpoint (PEFT LoRA
    in clef/adapter/) and, when `deabl`, a rank-1 PEFT adapter in clef/deabl/."""
    from clef_finetune.model import targets_regex
    from clef_finetune.train import save_checkpoint
    from peft import LoraConfig, get_peft_model

    out = make_tiny(out_dir, preset, seed)
    clef = out / "clef"
    clef.mkdir(exist_ok=True)
    head, config = _random_head(_hidden_size(out), seed + 200)
    (clef / "joint_head_config.json").write_text(json.dumps(config, indent=2))

    backbone = _backbone(out)
    targets = _targets(backbone, LORA["first_layer"])
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], use_rslora=LORA["use_rslora"],
                      alpha_pattern=LORA["alpha_pattern"], target_modules=targets_regex(targets), bias="none",
                      lora_dropout=0.0)
    peft_model = get_peft_model(backbone, lora)
    _randomize_lora(peft_model, seed + 300)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rng = {"python": None, "torch": torch.get_rng_state()}
    save_checkpoint(clef, peft_model, head, optimizer, scheduler, 0, rng, {"fixture": "qv tiny Clef", "seed": seed})

    if deabl:
        backbone = _backbone(out)
        cfg = LoraConfig(r=1, lora_alpha=1, target_modules=targets_regex(_targets(backbone, 1, DEABL_SUFFIXES)),
                         bias="none", lora_dropout=0.0)
        deabl_model = get_peft_model(backbone, cfg)
        _randomize_deabl(deabl_model, seed + 400)
        deabl_model.save_pretrained(clef / "deabl")
    return out


def _randomize_deabl(peft_model, seed: int) -> None:
    """Rank-1 deltas shaped like de-abliteration: B a unit direction of the residual stream,
    A = 0.5 * direction^T W (restores half of what projecting that direction out removed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in sorted(peft_model.named_modules()):
            if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
                continue
            w = module.get_base_layer().weight  # [N, K]
            direction = torch.randn(w.shape[0], generator=gen)
            direction /= direction.norm()
            module.lora_B["default"].weight.copy_(direction[:, None])
            module.lora_A["default"].weight.copy_(0.5 * (direction @ w)[None, :])
