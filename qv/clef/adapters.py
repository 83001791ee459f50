"""The two ways Clef's weights arrive, and the low-rank deltas that turn served weights into Clef's.

(a) A Clef release folder: the backbone plus `joint_head.safetensors` and `joint_head_config.json`.
    Chat and Clef share every weight; Clef rows need no delta.
(b) Base weights plus `<model>/clef/`: the head (`joint_head.safetensors`, its config there or
    beside the base), a PEFT LoRA adapter as clef-finetune writes it (`adapter_config.json` +
    `adapter_model.safetensors`, in `clef/` or, as a clef-finetune checkpoint has it, in
    `clef/adapter/`) and optionally `clef/deabl/`: rank-1 deltas in the same PEFT LoRA format
    (r = 1). qv could not find the original stack's on-disk deabl format anywhere (clef-finetune
    has none), so it takes the one format that merge tools and PEFT already read.

Deltas are written into slot 0 of each Linear's DeltaBank (qv/model/delta_bank.py; served LoRA adapters
take the slots after it): a checkpoint module fused into a bigger Linear (q/k/v, in_proj_qkv+z,
in_proj_b+a, gate+up) is one member of it. They act only on a batch's `delta_rows`; no base weight is
copied or changed. Under tensor parallelism every rank attaches its cut of each delta, cut like its weight (qv.model.parallel.delta_shard).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from qv.clef.head import JointHead
from qv.model.joint_head_layout import HEAD_CONFIG, HEAD_WEIGHTS
from qv.model.delta_bank import DeltaBank
from qv.model.layers import FusedLinear, Linear
from qv.model.parallel import delta_shard

# PEFT options that change the math in ways a plain (x A^T) B^T * scale delta does not express.
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "lora_bias",
                "modules_to_save": "modules_to_save", "trainable_token_indices": "trainable_token_indices",
                "target_parameters": "target_parameters", "layer_replication": "layer_replication",
                "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA", "alora_invocation_tokens": "aLoRA"}
_MODULE = re.compile(r"(?:model\.language_model\.|model\.)layers\.(\d+)\.(self_attn|linear_attn|mlp)\.(\w+)")
# checkpoint module -> (attribute path on qv's decoder layer, index among the fused parts or None)
_PLACES = {
    ("self_attn", "q_proj"): ("mixer.qkv", 0), ("self_attn", "k_proj"): ("mixer.qkv", 1),
    ("self_attn", "v_proj"): ("mixer.qkv", 2), ("self_attn", "o_proj"): ("mixer.o_proj", None),
    ("linear_attn", "in_proj_qkv"): ("mixer.in_proj", 0), ("linear_attn", "in_proj_z"): ("mixer.in_proj", 1),
    ("linear_attn", "in_proj_b"): ("mixer.in_proj", 2), ("linear_attn", "in_proj_a"): ("mixer.in_proj", 3),
    ("linear_attn", "out_proj"): ("mixer.out_proj", None),
    ("mlp", "gate_proj"): ("mlp.gate_up", 0), ("mlp", "up_proj"): ("mlp.gate_up", 1), ("mlp", "down_proj"): ("mlp.down", None),
}


class ClefLayoutError(ValueError):
    """A Clef folder qv cannot use; the message names the file or module."""


@dataclass
class AdapterModule:
    """One module's LoRA pair: delta = (x A^T) B^T * scale."""

    name: str  # checkpoint module name, e.g. model.language_model.layers.3.linear_attn.in_proj_qkv
    a: torch.Tensor  # [r, K]
    b: torch.Tensor  # [N, r]
    scale: float


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key
    that matches the end of the module name at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return patterns[key]
    return default


def read_peft_adapter(folder: str | Path, rank: int | None = None) -> list[AdapterModule]:
    """A PEFT LoRA adapter folder -> its modules with PEFT's scaling (lora_alpha / r, or
    lora_alpha / sqrt(r) with use_rslora; rank_pattern and alpha_pattern per module)."""
    folder = Path(folder)
    cfg_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise ClefLayoutError(f"{folder}: no adapter_config.json")
    if not weights_path.is_file():
        hint = " (adapter_model.bin: convert it to safetensors)" if (folder / "adapter_model.bin").is_file() else ""
        raise ClefLayoutError(f"{folder}: no adapter_model.safetensors{hint}")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ClefLayoutError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; qv applies LoRA adapters only")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ClefLayoutError(f"{cfg_path}: {what} ({key}={cfg[key]!r}) is not supported for Clef deltas")
    if cfg.get("bias", "none") != "none":
        raise ClefLayoutError(f"{cfg_path}: bias={cfg['bias']!r}; qv applies bias-free LoRA only (bias='none')")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise ClefLayoutError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight (unsupported adapter part)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    modules = []
    for name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ClefLayoutError(f"{weights_path}: module {name} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ClefLayoutError(f"{weights_path}: {name} has lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}")
        if rank is not None and r != rank:
            raise ClefLayoutError(f"{weights_path}: {name} has rank {r}; this adapter must be rank {rank}")
        r_cfg = _pattern_value(cfg.get("rank_pattern") or {}, name, cfg.get("r", r))
        if r_cfg != r:
            raise ClefLayoutError(f"{weights_path}: {name} has rank {r} but adapter_config.json says {r_cfg}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, name, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules.append(AdapterModule(name, a, b, float(scale)))
    if not modules:
        raise ClefLayoutError(f"{weights_path}: no LoRA tensors")
    return modules


def _place(model, name: str):
    """The module qv computes checkpoint module `name` with (a Linear or FusedLinear), and its index
    among the fused members (None: the whole Linear)."""
    m = _MODULE.fullmatch(name)
    place = _PLACES.get((m.group(2), m.group(3))) if m else None
    if place is None:
        raise ClefLayoutError(f"LoRA on {name!r} is not supported: Clef deltas apply to the text decoder's "
                              f"linear layers ({', '.join(sorted({p[1] for p in _PLACES}))})")
    index = int(m.group(1))
    if index >= len(model.layers):
        raise ClefLayoutError(f"LoRA module {name!r}: the model has {len(model.layers)} layers")
    layer = model.layers[index]
    wants = "full_attention" if m.group(2) == "self_attn" else "linear_attention" if m.group(2) == "linear_attn" else None
    if wants and layer.kind != wants:
        raise ClefLayoutError(f"LoRA module {name!r}: layer {index} is a {layer.kind} layer")
    target = layer
    for attr in place[0].split("."):
        target = getattr(target, attr)
    return target, place[1]


def locate(model, name: str) -> tuple[Linear, int, int]:
    """qv's Linear computing checkpoint module `name`, and the output columns that are its."""
    target, member = _place(model, name)
    if member is None:
        return target, 0, target.out_features
    assert isinstance(target, FusedLinear)
    return target.member(member)  # fused along N: this module is a column range of its part


def _rank_factors(model, mod: AdapterModule, linear: Linear, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mod's A and B as this rank applies them (cut like its Linear under tensor parallelism), once
    the whole factors are checked against the whole weight."""
    tp = getattr(model, "tp", None)
    world = 1 if tp is None or linear.shard is None else tp.world_size
    target, member = _place(model, mod.name)
    pieces = target.member_pieces[member] if member is not None else linear.pieces
    k = linear.weight.shape[1]
    full_k = k * world if linear.shard == "row" else k
    full_n = sum(pieces) if linear.shard == "column" else end - start
    if mod.a.shape[1] != full_k or mod.b.shape[0] != full_n:
        raise ClefLayoutError(f"LoRA module {mod.name}: A {tuple(mod.a.shape)}, B {tuple(mod.b.shape)} do not fit "
                              f"its weight ({full_n} outputs, {full_k} inputs)")
    return delta_shard(mod.a, mod.b, linear.shard, pieces, tp, mod.name)


def place_modules(model, modules: list[AdapterModule]) -> dict[Linear, list]:
    """Each module's (member index, A, B, scale) as this rank applies it, per Linear; every module is checked
    before anything is returned (ClefLayoutError naming the module)."""
    placed: dict[Linear, list] = {}
    for mod in modules:
        linear, start, end = locate(model, mod.name)
        a, b = _rank_factors(model, mod, linear, start, end)
        member = next((m for m in range(len(linear.member_sizes))
                       if sum(linear.member_sizes[:m]) == start and sum(linear.member_sizes[:m + 1]) == end), None)
        if member is None:
            raise ClefLayoutError(f"LoRA module {mod.name}: columns [{start}, {end}) are no member of its Linear")
        placed.setdefault(linear, []).append((member, a, b, mod.scale))
    return placed


def attach(model, modules: list[AdapterModule], dtype: torch.dtype | None = None,
           device: torch.device | str | None = None, pin: bool = False) -> int:
    """Give each Linear these modules' deltas as its bank's slot 0 (sized for exactly them); returns the bytes
    the banks hold. `pin`: keep them in pinned host memory (device "cpu"); the Linear copies them to the
    activations' device per use (QV_CLEF_DELTA_HOST)."""
    placed = place_modules(model, modules)  # check everything before touching the model
    dtype, device = dtype or model.dtype, device or model.device
    total = 0
    for linear, pieces in placed.items():
        k = pieces[0][1].shape[1]
        bank = DeltaBank(k, linear.member_sizes, [sum(a.shape[0] for _, a, _, _ in pieces)],
                         [sum(b.numel() for _, _, b, _ in pieces)], dtype, device, pin=pin)
        bank.write(0, pieces)
        linear.bank = bank
        total += bank.nbytes
    return total


def all_linears(model) -> list[Linear]:
    out = []
    for layer in model.layers:
        for path in {p for p, _ in _PLACES.values()}:
            target = layer
            for attr in path.split("."):
                target = getattr(target, attr, None)
            if isinstance(target, FusedLinear):
                out.extend(target.parts)
            elif isinstance(target, Linear):
                out.append(target)
    return out


def detach_all(model) -> None:
    """Remove every delta bank (the model computes base weights for all rows again)."""
    for linear in all_linears(model):
        linear.bank = None


@dataclass
class ClefAssets:
    layout: str  # "release" or "adapters"
    head: JointHead
    delta_bytes: int
    lora_modules: int
    deabl_modules: int
    # the whole output embedding for the head's lexical vectors where the model's lm_head is a
    # vocabulary shard (tensor parallelism); None: the model's lm_head weight
    output_embedding: object | None = None


def clef_layout(model_dir: str | Path) -> str | None:
    """"release", "adapters" or None (no Clef head: the model serves chat only)."""
    d = Path(model_dir)
    release = (d / HEAD_WEIGHTS).is_file()
    adapters = (d / "clef" / HEAD_WEIGHTS).is_file()
    if release and adapters:
        raise ClefLayoutError(f"{d} holds both a Clef release head and clef/: keep one layout")
    return "release" if release else "adapters" if adapters else None


def load_clef(model_dir: str | Path, model, head_device: torch.device | str | None = None,
              delta_dtype: torch.dtype | None = None, delta_host: bool = False) -> ClefAssets | None:
    """Load the head and attach the deltas the layout calls for; None when the folder has no Clef.
    `delta_host`: deltas stay in host memory (pinned when the model is on a GPU), streamed per use."""
    d = Path(model_dir)
    layout = clef_layout(d)
    if layout is None:
        return None
    head_device = head_device or model.device
    if layout == "release":
        return ClefAssets(layout, JointHead.load(d, head_device), 0, 0, 0)
    clef = d / "clef"
    config_dir = clef if (clef / HEAD_CONFIG).is_file() else d
    if not (config_dir / HEAD_CONFIG).is_file():
        raise ClefLayoutError(f"{clef}: no joint_head_config.json (in clef/ or beside the base weights)")
    head = JointHead.load(clef, head_device, config_dir)
    return ClefAssets(layout, head, *load_clef_deltas(d, model, delta_dtype, delta_host))


def load_clef_deltas(model_dir: str | Path, model, delta_dtype: torch.dtype | None = None,
                     delta_host: bool = False) -> tuple[int, int, int]:
    """Attach layout (b)'s LoRA and deabl deltas (this rank's cut of them under tensor parallelism:
    a worker loads these and no head); (bytes, LoRA modules, deabl modules)."""
    clef = Path(model_dir) / "clef"
    lora_dir = clef if (clef / "adapter_config.json").is_file() else clef / "adapter"
    if not (lora_dir / "adapter_config.json").is_file():
        raise ClefLayoutError(f"{clef}: no LoRA adapter (adapter_config.json in clef/ or clef/adapter/)")
    lora = read_peft_adapter(lora_dir)
    deabl = read_peft_adapter(clef / "deabl", rank=1) if (clef / "deabl").is_dir() else []
    on_gpu = model.device.type == "cuda"
    total = attach(model, lora + deabl, delta_dtype, "cpu" if delta_host else None, pin=delta_host and on_gpu)
    return total, len(lora), len(deabl)
