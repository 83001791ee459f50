"""qv's image/video preprocessing and prompt expansion against Hugging Face's processor
(AutoProcessor on the tiny folder: Qwen3VLProcessor, Qwen2VLImageProcessor, Qwen3VLVideoProcessor)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from vision_cases import BARE_VID, VID, expand, processor_cases, qv_process

from qv.model.vision_processor import MediaError, VisionProcessor

CASES = {c["name"]: c for c in processor_cases()}


def test_oracle_uses_the_torchvision_processors(hf_processed):
    assert hf_processed["_classes"] == {"image": "Qwen2VLImageProcessor", "video": "Qwen3VLVideoProcessor"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_processor_equals_hf(name, vision_dir, tokenizer, hf_processed):
    case, ref = CASES[name], hf_processed[name]
    proc = VisionProcessor.from_dir(vision_dir)
    if "error" in ref:
        with pytest.raises(MediaError, match="aspect ratio"):
            qv_process(proc, case)
        assert "aspect ratio" in ref["error"]
        return
    items = qv_process(proc, case)
    for kind, pv_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                   ("video", "pixel_values_videos", "video_grid_thw")):
        mine = [it for it in items if it.kind == kind]
        if not mine:
            assert pv_key not in ref
            continue
        assert [list(it.grid_thw) for it in mine] == ref[grid_key].tolist()
        pv = torch.cat([it.pixel_values for it in mine])
        assert pv.dtype == ref[pv_key].dtype == torch.float32
        assert torch.equal(pv, ref[pv_key]), f"max |diff| {(pv - ref[pv_key]).abs().max().item()}"
    ids = expand(tokenizer, vision_dir, case["text"], items)
    assert ids == ref["input_ids"][0].tolist()
    assert sum(it.num_tokens for it in items) == int((ref["mm_token_type_ids"][0] > 0).sum())


def test_template_video_markers_replaced_whole(vision_dir, tokenizer, hf_processed):
    """`<|vision_start|><|video_pad|><|vision_end|>` (what the chat template writes) becomes
    exactly the tokens HF gives a bare pad: Qwen3-VL's own processor and vLLM's layout."""
    case = CASES["video-short"]
    items = qv_process(VisionProcessor.from_dir(vision_dir), case)
    ids = expand(tokenizer, vision_dir, case["text"].replace(BARE_VID, VID), items)
    assert ids == hf_processed["video-short"]["input_ids"][0].tolist()


def test_expansion_errors(vision_dir, tokenizer):
    proc = VisionProcessor.from_dir(vision_dir)
    img = proc.image(CASES["image-exact"]["images"][0])
    vid = proc.video(*CASES["video-short"]["videos"][0])
    with pytest.raises(MediaError, match="more images/videos"):
        expand(tokenizer, vision_dir, "no media", [img])
    with pytest.raises(MediaError, match="more media placeholders than the 1 images/videos"):
        expand(tokenizer, vision_dir, "<|image_pad|> <|image_pad|>", [img])
    with pytest.raises(MediaError, match="placeholder 0 in the prompt is for a video, but media item 0 is a image"):
        expand(tokenizer, vision_dir, "<|video_pad|>", [img])
    with pytest.raises(MediaError, match="placeholder 1 in the prompt is for a image, but media item 1 is a video"):
        expand(tokenizer, vision_dir, "<|image_pad|><|image_pad|>", [img, vid])


def test_bad_media_rejected(vision_dir):
    import numpy as np

    proc = VisionProcessor.from_dir(vision_dir)
    with pytest.raises(MediaError, match="no frames"):
        proc.video(np.zeros((0, 32, 32, 3), np.uint8), 2.0)
    with pytest.raises(MediaError, match="at least 2 are needed"):
        proc.video(np.zeros((1, 32, 32, 3), np.uint8), 2.0)
    with pytest.raises(MediaError, match="TxHxWx3 uint8"):
        proc.video(np.zeros((4, 32, 32), np.float32), 2.0)
    with pytest.raises(MediaError, match="fps must be positive"):
        proc.video(np.zeros((4, 32, 32, 3), np.uint8), 0)
    with pytest.raises(MediaError, match="3 frames given for 2 sampled indices"):
        proc.video(np.zeros((3, 32, 32, 3), np.uint8), 2.0, indices=[0, 5])
    with pytest.raises(MediaError, match="unsupported image type"):
        proc.image("not an image")


def test_nested_processor_config(vision_dir, tmp_path):
    """processor_config.json with nested sections (newer checkpoints) wins over the separate files."""
    d = tmp_path / "nested"
    shutil.copytree(vision_dir, d)
    image = json.loads((d / "preprocessor_config.json").read_text())
    video = json.loads((d / "video_preprocessor_config.json").read_text())
    image["size"] = {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
    video["max_frames"] = 6
    (d / "processor_config.json").write_text(json.dumps({"image_processor": image, "video_processor": video}))
    (d / "video_preprocessor_config.json").unlink()
    proc = VisionProcessor.from_dir(d)
    assert (proc.image_cfg.min_pixels, proc.image_cfg.max_pixels) == (32 * 32, 128 * 128)
    assert proc.video_cfg.max_frames == 6 and proc.video_cfg.fps == 2


def test_no_torchvision_at_run_time(vision_dir):
    """Preprocessing, the tower and mRoPE import and run without torchvision."""
    code = f"""
import sys, numpy as np
from PIL import Image
from qv.model.vision_processor import VisionProcessor
from qv.model.vision import load_multimodal_model
from qv.model.vision_inputs import mrope_positions
p = VisionProcessor.from_dir({str(vision_dir)!r})
a = p.image(Image.new("RGB", (50, 40), (10, 20, 30)))
b = p.video(np.zeros((6, 40, 40, 3), np.uint8), 3.0)
text, tower = load_multimodal_model({str(vision_dir)!r})
tower(__import__("torch").cat([a.pixel_values, b.pixel_values]), [a.grid_thw, b.grid_thw])
assert not any(m.split(".")[0] == "torchvision" for m in sys.modules), "torchvision was imported"
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_unsupported_resample_is_a_config_error(vision_dir, tmp_path):
    from qv.config import ConfigError

    d = tmp_path / "bilinear"
    shutil.copytree(vision_dir, d)
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    cfg["resample"] = 2
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="resample=2 unsupported"):
        VisionProcessor.from_dir(d)
