"""Vision fixtures: deterministic media, the cases run through Hugging Face's processor (in a
subprocess, see hf_processor_oracle.py), and HF's model on the tiny folder."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
BARE_VID = "<|video_pad|>"  # transformers 5.24 only gives Qwen's own video layout for a bare pad


def chat(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int, h: int, w: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    # smooth gradients plus noise, so resampling differences show in many pixels
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), (xx + yy) % 256], -1)
    arr = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(arr)
    if mode == "L":
        return im.convert("L")
    if mode == "RGBA":
        im = im.convert("RGBA")
        im.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)))
    return im


def video(seed: int, t: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)


IMAGE_SIZES = {  # name: (h, w)
    "tiny": (5, 7), "exact": (64, 64), "portrait": (100, 70), "huge": (2000, 1500), "wide": (32, 3000),
    "tall": (3000, 20), "odd": (47, 333), "small": (30, 40),
}
VIDEOS = {  # name: (frames, h, w, source fps)
    "short": (7, 48, 64, 4.0),  # 4 sampled frames -> 2 temporal patches
    "odd": (3, 40, 56, 2.0),  # 3 frames: the last is repeated to fill a temporal patch
    "long": (40, 128, 160, 8.0),  # over the pixel budget: downscaled
    "thin": (9, 20, 300, 30.0),  # smaller than one merge block on one side: scaled up first
}


def processor_cases() -> list[dict]:
    cases = []
    for i, (name, (h, w)) in enumerate(IMAGE_SIZES.items()):
        cases.append(dict(name=f"image-{name}", text=chat(f"a {IMG} b"), images=[image(i, h, w)]))
    cases.append(dict(name="image-gray", text=chat(IMG), images=[image(20, 50, 80, "L")]))
    cases.append(dict(name="image-rgba", text=chat(IMG), images=[image(21, 50, 80, "RGBA")]))
    cases.append(dict(name="image-aspect", text=chat(IMG), images=[image(22, 10, 2500)]))
    cases.append(dict(name="images-3", text=chat(f"{IMG} x {IMG}{IMG} y"),
                      images=[image(23, 90, 60), image(24, 33, 200), image(25, 64, 64)]))
    for i, (name, (t, h, w, fps)) in enumerate(VIDEOS.items()):
        cases.append(dict(name=f"video-{name}", text=chat(f"x {BARE_VID} y"), videos=[(video(30 + i, t, h, w), fps)]))
    cases.append(dict(name="video-and-image", text=chat(f"{IMG} then {BARE_VID} end"),
                      images=[image(40, 70, 90)], videos=[(video(41, 10, 64, 48), 5.0)]))
    return cases + generate_cases()


def generate_cases() -> list[dict]:
    """The prompts the greedy tests run: 1, 3 and 20 images, a video, and both kinds together."""
    rng = np.random.default_rng(7)

    def imgs(n, seed):
        return [image(seed + k, int(rng.integers(16, 140)), int(rng.integers(16, 140))) for k in range(n)]

    return [
        dict(name="gen-1", text=chat(f"{IMG}Describe the picture."), images=imgs(1, 100)),
        dict(name="gen-3", text=chat(f"First {IMG} second {IMG} third {IMG} compare."), images=imgs(3, 110)),
        dict(name="gen-20", text=chat("".join(f"{k}:{IMG}" for k in range(20)) + " count"), images=imgs(20, 130)),
        dict(name="gen-video", text=chat(f"{BARE_VID}What happens?"), videos=[(video(150, 12, 64, 80), 6.0)]),
        dict(name="gen-mixed", text=chat(f"{IMG} and {BARE_VID} and {IMG}."), images=imgs(2, 160),
             videos=[(video(170, 5, 48, 48), 2.0)]),
    ]


def _torchvision_dir(cache) -> Path:
    """torchvision's Python code for the oracle, installed beside (not into) the venv: the
    registry's wheels are CUDA builds whose compiled ops cannot load against CPU torch, and a
    torchvision in the venv would make transformers fail to import its models."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    spec = f"torchvision=={major - 2}.{minor + 15}.*"  # torch 2.N pairs with torchvision 0.(N+15)
    target = Path(cache.mkdir(f"qv-oracle-torchvision-{major}.{minor}"))
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
def hf_processed(vision_dir, pytestconfig, tmp_path_factory) -> dict:
    """Case name -> HF processor outputs (or {"error": message}) for every case above."""
    tv = _torchvision_dir(pytestconfig.cache)
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
