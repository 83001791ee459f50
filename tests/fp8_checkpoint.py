"""Tiny block-FP8 checkpoints in Qwen's layout (e4m3 `weight`, fp32 `weight_scale_inv` per block, the unquantized
modules named one by one in `modules_to_not_convert`), and their dense twins (the same values dequantized in
fp32, no quantization_config) for oracles that cannot run FP8 themselves, such as transformers on the CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from test_quantize import read_all

FP8_MAX = 448.0
# Qwen's FP8 releases keep these unquantized: embeddings, lm_head, the GDN gates, the vision tower
NOT_CONVERTED = r"(embed_tokens|lm_head|linear_attn\.in_proj_[ab]|visual\..*|pos_embed)$"


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block's largest magnitude at 448."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = codes.shape
    bn, bk = block
    return codes.float() * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _copy_extras(src: Path, out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():  # tokenizer files, Clef head, ...
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            (out / extra.name).write_bytes(extra.read_bytes())


def write_fp8(src: Path, out: Path, block: tuple[int, int] = (128, 128), skip: str = NOT_CONVERTED) -> Path:
    """The FP8 checkpoint of a dense one: every 2-D `.weight` whose module does not match `skip` in e4m3 with
    block scales; the modules left dense listed by full name in modules_to_not_convert, as Qwen lists them."""
    tensors, not_converted = {}, []
    for name, w in read_all(src).items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or w.dim() != 2:
            tensors[name] = w
            continue
        if re.search(skip, module):
            tensors[name] = w
            not_converted.append(module)
            continue
        tensors[name], tensors[f"{module}.weight_scale_inv"] = quantize_blocks(w, block)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block), "modules_to_not_convert": not_converted}
    _copy_extras(src, out, config)
    return out


def dense_twin(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint's weights dequantized in fp32, without a quantization_config."""
    config = json.loads((fp8_dir / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    raw = read_all(fp8_dir)
    tensors = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = raw.get(name.removesuffix(".weight") + ".weight_scale_inv")
        tensors[name] = t if scale is None else dequantize_blocks(t, scale, block)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_extras(fp8_dir, out, config)
    return out
