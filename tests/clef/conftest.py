"""Clef fixtures: tiny Clef folders of both layouts (built once per session), qv's side (qv's model
with deltas attached, qv's head) and the oracle's side: Cloudflare's `systemone()` on the MERGED
fp32 weights (transformers' Qwen3_5ForConditionalGeneration + their JointSchemaHead)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

# The oracle needs clef-finetune (test extra, --no-deps) and peft. Without them this folder is left
# out of collection (a skip raised in a conftest would abort the whole pytest run instead).
MISSING = [m for m in ("clef_finetune", "peft") if importlib.util.find_spec(m) is None]
if MISSING:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if MISSING:
        return f"tests/clef not collected: {', '.join(MISSING)} missing (pip install -e '.[test]' && pip install --no-deps clef-finetune)"


@pytest.fixture(scope="session")
def jsm():
    from clef_finetune.jsm import load_jsm

    return load_jsm()


@pytest.fixture(scope="session")
def clef_dirs(tmp_path_factory):
    """{"release": layout (a) folder, "adapters": layout (b) folder with LoRA + deabl}."""
    from clef.fixtures import make_clef_adapters, make_clef_release

    root = tmp_path_factory.mktemp("clef")
    return {"release": make_clef_release(root / "release", "tiny", seed=3),
            "adapters": make_clef_adapters(root / "adapters", "mixed", seed=5)}


@pytest.fixture(scope="session")
def tokenizers(clef_dirs):
    from transformers import AutoTokenizer

    return {k: AutoTokenizer.from_pretrained(v) for k, v in clef_dirs.items()}


def _reference_model(jsm, release: Path):
    """Cloudflare's ClefModel on a release folder, fp32 on CPU. (Their load_release_model also
    builds an AutoProcessor, which needs torchvision; systemone() uses only processor.tokenizer
    for text records, so the tokenizer is handed over in a namespace instead.)"""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    backbone = Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32).eval()
    head = jsm.JointSchemaHead(**json.loads((release / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(str(release / "joint_head.safetensors")), strict=True)
    model = jsm.ClefModel(backbone, head.float()).eval()
    return model, types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(release))


@pytest.fixture(scope="session")
def reference_model(jsm):
    """folder -> Cloudflare's (ClefModel, processor) on that release folder."""
    return lambda folder: _reference_model(jsm, Path(folder))


def merge_adapters_release(base: Path, out: Path) -> Path:
    """The merged fp32 release of layout (b), made by the tools the weights come from: PEFT merges
    the rank-1 deabl adapter into the base, then clef-finetune's own `export.merge` merges the
    LoRA checkpoint (clef/adapter + clef/joint_head.safetensors) and writes a release folder."""
    from clef_finetune.export import merge
    from clef_finetune.model import load_backbone
    from peft import PeftModel

    deabl_base = out.parent / (out.name + "-deabl-base")
    backbone = load_backbone(base, torch.float32, "cpu")
    PeftModel.from_pretrained(backbone, base / "clef" / "deabl").merge_and_unload().save_pretrained(deabl_base)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, deabl_base / name)
    shutil.copy(base / "clef" / "joint_head_config.json", deabl_base / "joint_head_config.json")
    return merge(deabl_base, base / "clef", out, dtype="float32", head_dtype="float32")


@pytest.fixture(scope="session")
def references(jsm, clef_dirs, tmp_path_factory):
    merged = merge_adapters_release(clef_dirs["adapters"], tmp_path_factory.mktemp("merged") / "release")
    return {"release": _reference_model(jsm, clef_dirs["release"]), "adapters": _reference_model(jsm, merged)}


@pytest.fixture(scope="session")
def qv_clef(clef_dirs):
    """{layout: (qv text model with the layout's deltas attached, ClefAssets)}, fp32 on CPU."""
    from qv.clef.adapters import load_clef
    from qv.model.qwen3_5 import load_text_model

    out = {}
    for layout, folder in clef_dirs.items():
        model = load_text_model(str(folder))
        out[layout] = (model, load_clef(folder, model))
    return out
