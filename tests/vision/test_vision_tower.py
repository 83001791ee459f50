"""The vision tower against transformers' Qwen3_5VisionModel on the same checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from util import assert_close

from qv.config import ModelConfig
from qv.model.vision import load_multimodal_model
from qv.model.weights import CheckpointError

BOUND = 1e-5  # fp32 paths (DESIGN.md)
# images of several shapes, a 2-patch video, a 3-patch video: attention must stay inside each frame
GRIDS = [(1, 4, 6), (2, 4, 4), (1, 2, 30), (1, 36, 26), (3, 8, 2), (1, 2, 2)]


@pytest.mark.parametrize("preset", ["tiny", "mixed"])
def test_tower_equals_hf(preset, tiny_dirs):
    from transformers import Qwen3_5ForConditionalGeneration

    d = tiny_dirs(preset)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(d, dtype=torch.float64).eval()  # the exact reference
    _, tower = load_multimodal_model(d)
    vc = ModelConfig.from_dir(d).vision
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(n, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2,
                         generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.model.visual(pixels.double(), grid_thw=torch.tensor(GRIDS)).pooler_output
    out = tower(pixels, GRIDS)
    err = assert_close(f"vision tower ({preset})", out, ref, BOUND)
    print(f"vision tower {preset}: rel err {err:.2e}")
    # one item alone gives its rows of the batched call: no leakage between items
    one = tower(pixels[4 * 6:4 * 6 + 2 * 4 * 4], [GRIDS[1]])
    assert_close("vision tower, one item", one, out[6:6 + 8], BOUND)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tower_half_precision(dtype, tiny_dirs):
    """Weights and activations in bf16/fp16 (what serving uses) stay within DESIGN.md's 1e-2."""
    from transformers import Qwen3_5ForConditionalGeneration

    d = tiny_dirs("tiny")
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(d, dtype=torch.float64).eval()
    _, tower = load_multimodal_model(d, dtype=dtype)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 1536, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf.model.visual(pixels.double(), grid_thw=torch.tensor(GRIDS)).pooler_output
    out = tower(pixels, GRIDS)
    assert out.dtype == dtype
    err = assert_close(f"vision tower {dtype}", out.float(), ref, 1e-2)
    print(f"vision tower {dtype}: rel err {err:.2e}")


def test_tower_rejects_bad_grids(tiny_dirs):
    _, tower = load_multimodal_model(tiny_dirs("tiny"))
    with pytest.raises(ValueError, match="patch rows"):
        tower(torch.zeros(10, 1536), [(1, 2, 4)])
    with pytest.raises(ValueError, match="merge 2"):
        tower(torch.zeros(6, 1536), [(1, 2, 3)])
    assert tower(torch.zeros(0, 1536), []).shape == (0, 96)  # a step without media


def test_loader_checks_every_tensor(tiny_dirs, tmp_path):
    """An unknown model.visual.* tensor, or a missing one, stops the load."""
    import shutil

    src = tiny_dirs("tiny")
    d = tmp_path / "extra"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.visual.blocks.0.attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.visual.blocks.0.attn.extra.weight"):
        load_multimodal_model(d)
    del tensors["model.visual.blocks.0.attn.extra.weight"], tensors["model.visual.merger.norm.bias"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="merger.norm.bias"):
        load_multimodal_model(d)


def test_text_only_checkpoint_has_no_tower(tiny_dirs):
    with pytest.raises(CheckpointError, match="no vision_config"):
        load_multimodal_model(tiny_dirs("gqa1"))


def test_tower_runs_on_the_triton_kernels(tiny_dirs, monkeypatch):
    """The tower's math goes through the op table: under the triton backend (the interpreter on
    CPU) every op it needs is a Triton kernel, and the output equals the reference ops'."""
    from qv.kernels import registry

    _, tower = load_multimodal_model(tiny_dirs("tiny"))
    grids = [(1, 4, 6), (2, 4, 4), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1536, generator=torch.Generator().manual_seed(5))
    ref = tower(pixels, grids)
    used: set[str] = set()
    for op, table in registry.ops().items():
        if "triton" in table:
            monkeypatch.setitem(table, "triton", _recorded(op, table["triton"], used))
    with registry.backend("triton"):
        out = tower(pixels, grids)
    assert used == {"linear", "layer_norm", "gelu", "rotary_embed", "varlen_attention"}
    assert_close("vision tower, triton kernels", out, ref, BOUND)


def _recorded(op, fn, used):
    def wrapper(*args, **kwargs):
        used.add(op)
        return fn(*args, **kwargs)

    return wrapper
