"""Vision test material: deterministic images and videos, the prompts every vision test runs,
and the small helpers that turn a case into qv's inputs. (A plain module, not conftest.py, so
test files import it by a name no other test directory uses.)"""

from __future__ import annotations

import numpy as np
import torch

from qv.config import ModelConfig
from qv.model.vision_processor import VisionProcessor, VisionTokenIds, expand_vision_tokens

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


def qv_process(proc: VisionProcessor, case: dict) -> list:
    """qv's items for a case, in prompt order (HF takes images and videos as separate lists)."""
    images = [proc.image(im) for im in case.get("images", [])]
    videos = [proc.video(frames, fps) for frames, fps in case.get("videos", [])]
    text, its = case["text"], {"image": iter(images), "video": iter(videos)}
    order = sorted([(i, "image") for i in _find_all(text, "<|image_pad|>")] +
                   [(i, "video") for i in _find_all(text, "<|video_pad|>")])
    return [next(its[kind]) for _, kind in order]


def _find_all(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def token_ids(vision_dir) -> VisionTokenIds:
    cfg = ModelConfig.from_dir(vision_dir)
    return VisionTokenIds(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)


def expand(tokenizer, vision_dir, text: str, items) -> list[int]:
    return expand_vision_tokens(tokenizer(text)["input_ids"], items, token_ids(vision_dir),
                                lambda s: tokenizer(s, add_special_tokens=False)["input_ids"])


def hf_inputs(ref: dict) -> dict:
    """The model inputs among an HF processor output."""
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw")
    return {k: ref[k] for k in keys if k in ref}
