"""Vision fixtures: the cases run through Hugging Face's processor (in a subprocess, see
hf_processor_oracle.py) and HF's model on the tiny folder."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from vision_cases import processor_cases


def _torchvision_dir(cache) -> Path:
    """torchvision's Python code for the oracle, installed beside (not into) the venv: the
    registry's wheels are CUDA builds whose compiled ops cannot load against CPU torch, and a
    torchvision in the venv would make transformers fail to import its models."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    spec = f"torchvision=={major - 2}.{minor + 15}.*"  # torch 2.N pairs with torchvision 0.(N+15)
    name = f"qv-oracle-torchvision-{major}.{minor}"
    target = Path(cache.mkdir(name)) if cache is not None else Path(tempfile.gettempdir()) / name  # -p no:cacheprovider
    if not (target / "torchvision" / "transforms").is_dir():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), spec],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.fail(f"could not fetch {spec} for the HF processor oracle:\n{r.stderr[-2000:]}")
    return target


@pytest.fixture(scope="session")
def vision_dir(tiny_dirs) -> Path:
    return tiny_dirs("tiny")


@pytest.fixture(scope="session")
def side_torchvision(pytestconfig) -> Path:
    """The directory the oracle subprocesses import torchvision from."""
    return _torchvision_dir(getattr(pytestconfig, "cache", None))


@pytest.fixture(scope="session")
def hf_processed(vision_dir, side_torchvision, tmp_path_factory) -> dict:
    """Case name -> HF processor outputs (or {"error": message}) for every case above."""
    tv = side_torchvision
    work = tmp_path_factory.mktemp("hf-processor")
    with open(work / "in.pkl", "wb") as f:
        pickle.dump(processor_cases(), f)
    script = Path(__file__).with_name("hf_processor_oracle.py")
    r = subprocess.run([sys.executable, str(script), str(vision_dir), str(tv), str(work / "in.pkl"), str(work / "out.pkl")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"HF processor oracle failed:\n{r.stderr[-4000:]}"
    with open(work / "out.pkl", "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="session")
def hf_model(vision_dir):
    """transformers' model in float64: its own fp32 drifts ~3e-6 from float64 (see
    tests/oracles/test_model_vs_transformers.py), so the bounds measure qv's fp32 error alone."""
    from transformers import Qwen3_5ForConditionalGeneration

    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.float64,
                                                                  output_loading_info=True)
    # a missing key would be random in HF and compared against qv's real tensor
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="session")
def hf_model_fp32(vision_dir):
    """transformers' model in fp32, for generate (its float64 depthwise conv1d is ~100x slower on CPU)."""
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(vision_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vision_dir)
