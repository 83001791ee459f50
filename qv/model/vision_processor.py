"""Image and video preprocessing equal to the checkpoint's Hugging Face processor
(Qwen2VLImageProcessor for images, Qwen3VLVideoProcessor for videos, as `AutoProcessor` builds
them when torchvision is present, which is how vLLM and transformers serve Qwen3.5), without
torchvision: torchvision's tensor resize is `torch.nn.functional.interpolate` on the uint8 image
(antialiased bicubic, native uint8 kernel on CPU), which is what we call.

Output per item: `pixel_values` [t*h*w, C*tp*p*p] fp32 in HF's flattened patch order (patches of
one spatial-merge block contiguous, so the tower's merger groups rows 4 by 4) and `grid_thw`.
`expand_vision_tokens` turns each `<|image_pad|>` / `<|video_pad|>` of a prompt into the item's
tokens as Qwen3VLProcessor does (videos: per temporal patch `<t.t seconds>` text, then
`<|vision_start|> pads <|vision_end|>`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from qv.errors import ConfigError, MediaError

# HF class defaults, used only for keys a checkpoint's processor config leaves out.
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_IMAGE_DEFAULTS = dict(patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=_OPENAI_CLIP_MEAN,
                       image_std=_OPENAI_CLIP_STD, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
_VIDEO_DEFAULTS = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=(0.5, 0.5, 0.5),
                       image_std=(0.5, 0.5, 0.5), size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
                       fps=2, min_frames=4, max_frames=768, num_frames=None, do_sample_frames=True,
                       cap_pixels_per_frame=False, max_video_tokens=768)
# PIL resample code -> interpolate mode. Qwen's processors use 3 (bicubic), the one mode whose uint8
# CPU kernel torchvision calls on every CPU; others would need torchvision's per-CPU fallbacks.
_RESAMPLE = {3: "bicubic"}
MAX_ASPECT_RATIO = 200  # both HF smart_resize functions refuse more extreme images


@dataclass(frozen=True)
class ProcessorConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    do_convert_rgb: bool
    resample: str
    # video only
    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768
    num_frames: int | None = None
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768


def _parse(raw: dict, defaults: dict, what: str) -> ProcessorConfig:
    r = dict(defaults)
    r.update({k: v for k, v in raw.items() if v is not None})
    size = dict(r["size"])
    if "min_pixels" in raw:  # Qwen2-VL's legacy keys override size, as in HF's __init__
        size["shortest_edge"] = raw["min_pixels"]
    if "max_pixels" in raw:
        size["longest_edge"] = raw["max_pixels"]
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise ConfigError(f"{what}: size needs shortest_edge and longest_edge, got {size}")
    resample = int(r.get("resample", 3))
    if resample not in _RESAMPLE:
        raise ConfigError(f"{what}: resample={resample} unsupported (qv implements 3, bicubic)")
    return ProcessorConfig(
        patch_size=int(r["patch_size"]), temporal_patch_size=int(r["temporal_patch_size"]),
        merge_size=int(r["merge_size"]), min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
        image_mean=tuple(float(x) for x in r["image_mean"]), image_std=tuple(float(x) for x in r["image_std"]),
        rescale_factor=float(r.get("rescale_factor", 1 / 255)), do_resize=bool(r.get("do_resize", True)),
        do_rescale=bool(r.get("do_rescale", True)), do_normalize=bool(r.get("do_normalize", True)),
        do_convert_rgb=bool(r.get("do_convert_rgb", True)), resample=_RESAMPLE[resample],
        fps=r.get("fps"), min_frames=int(r.get("min_frames", 4)), max_frames=int(r.get("max_frames", 768)),
        num_frames=r.get("num_frames"), do_sample_frames=bool(r.get("do_sample_frames", True)),
        cap_pixels_per_frame=bool(r.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(r.get("max_video_tokens", 768)),
    )


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def missing_processor_config(model_dir: str | Path) -> str | None:
    """What the folder lacks for VisionProcessor.from_dir (the image processor's settings, where
    transformers reads them), in words naming the file; None when nothing is missing."""
    d = Path(model_dir)
    nested = d / "processor_config.json"
    if (d / "preprocessor_config.json").is_file():
        return None
    try:
        if (_read_json(nested) or {}).get("image_processor"):
            return None
    except (ValueError, AttributeError):
        return "its processor_config.json is not a JSON object, and it has no preprocessor_config.json"
    also = ", and its processor_config.json has no image_processor section" if nested.is_file() else ""
    return f"its folder has no preprocessor_config.json (the image processor's settings){also}"


# ---------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------


def _check_aspect(height: int, width: int) -> None:
    if min(height, width) < 1:
        raise MediaError(f"image of size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image rule: both sides multiples of `factor`, area within [min, max], aspect kept."""
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video rule: like images, but small frames are scaled up first and the area
    budget counts all frames (rounded to the temporal patch)."""
    if num_frames < temporal_factor:
        raise MediaError(f"video has {num_frames} frames after sampling; at least {temporal_factor} are needed")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---------------------------------------------------------------------------------------------
# items
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionItem:
    """One preprocessed image or video, ready for the tower."""

    kind: str  # "image" or "video"
    pixel_values: torch.Tensor  # [t*h*w, C*tp*p*p] fp32
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    merge_size: int
    timestamps: tuple[float, ...] = ()  # videos: seconds of each temporal patch (shown to the model as text)

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2] // self.merge_size**2

    @property
    def num_tokens(self) -> int:
        """Pad tokens (= tower output rows) of this item."""
        return self.grid_thw[0] * self.tokens_per_frame


def _image_to_rgb_array(image) -> np.ndarray:
    """PIL image or HWC uint8 array -> HWC uint8 RGB, transparency composited onto white (as HF)."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise MediaError(f"image arrays must be HxWx3 uint8, got {image.dtype} {image.shape}")
        return image
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise MediaError(f"unsupported image type {type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return np.array(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB"))
    return np.array(image.convert("RGB"))


class VisionProcessor:
    """Preprocessing for one checkpoint. `image(img)` and `video(frames, fps)` return VisionItems."""

    def __init__(self, image_cfg: ProcessorConfig, video_cfg: ProcessorConfig):
        self.image_cfg, self.video_cfg = image_cfg, video_cfg

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "VisionProcessor":
        """Read the nested sections of processor_config.json (newer checkpoints ship one file) or
        preprocessor_config.json / video_preprocessor_config.json."""
        d = Path(model_dir)
        nested = _read_json(d / "processor_config.json") or {}
        # HF's priority: the nested section, then the separate file
        image = nested.get("image_processor") or _read_json(d / "preprocessor_config.json")
        video = nested.get("video_processor") or _read_json(d / "video_preprocessor_config.json")
        if image is None:
            raise ConfigError(f"{d}: {missing_processor_config(d)}")
        # without a video file HF builds the video processor from preprocessor_config.json (legacy layout)
        video = video if video is not None else image
        return cls(_parse(image, _IMAGE_DEFAULTS, "image processor"), _parse(video, _VIDEO_DEFAULTS, "video processor"))

    # -- images -------------------------------------------------------------------------------
    def image(self, image) -> VisionItem:
        c = self.image_cfg
        rgb = _image_to_rgb_array(image) if c.do_convert_rgb else np.asarray(image)
        x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]  # [1, C, H, W] uint8
        if c.do_resize:
            h, w = smart_resize(x.shape[-2], x.shape[-1], c.patch_size * c.merge_size, c.min_pixels, c.max_pixels)
            x = _resize(x, h, w, c.resample)
        x = _rescale_normalize(x, c)
        x = x.expand(c.temporal_patch_size, -1, -1, -1)  # an image is tp identical frames
        pixels, grid = _patchify(x, c)
        return VisionItem("image", pixels, grid, c.merge_size)

    # -- videos -------------------------------------------------------------------------------
    def sample_indices(self, total_frames: int, source_fps: float | None) -> np.ndarray:
        """Which source frames the processor keeps (Qwen3VLVideoProcessor.sample_frames)."""
        c = self.video_cfg
        if not c.do_sample_frames:
            return np.arange(total_frames)
        num = c.num_frames
        if num is not None and c.fps is not None:
            raise ConfigError("video processor: num_frames and fps are mutually exclusive")
        if num is None and c.fps is not None:
            num = int(total_frames / source_fps * c.fps)
            num = min(max(num, c.min_frames), c.max_frames, total_frames)
        if num is None:
            num = min(max(total_frames, c.min_frames), c.max_frames)
        return np.linspace(0, total_frames - 1, num).round().astype(int)

    def video(self, frames, fps: float | None, indices: Sequence[int] | None = None) -> VisionItem:
        """`frames`: THW3 uint8 array or a list of PIL images / HW3 arrays, all one size; `fps`: the
        source frame rate (None means 24, as HF assumes without metadata). With `indices`, the
        frames are already the sampled ones (a decoder that asked `sample_indices` first, so it
        never holds the whole video) and `indices` their numbers in the source."""
        c = self.video_cfg
        arr = _frames_to_array(frames)
        source_fps = 24.0 if fps is None else float(fps)
        if source_fps <= 0:
            raise MediaError(f"video fps must be positive, got {fps}")
        if indices is None:
            indices = self.sample_indices(arr.shape[0], source_fps)
            arr = arr[indices]
        elif len(indices) != arr.shape[0]:
            raise MediaError(f"{arr.shape[0]} frames given for {len(indices)} sampled indices")
        x = torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2)  # [T, C, H, W] uint8
        factor = c.patch_size * c.merge_size
        if c.do_resize:
            max_pixels = c.max_pixels
            if c.cap_pixels_per_frame:  # qwen-vl-utils' per-frame budget, when the config asks for it
                per_frame = max(min(c.max_video_tokens * factor * factor, c.max_pixels // x.shape[0]),
                                int(c.min_pixels * 1.05))
                max_pixels = per_frame * x.shape[0]
            h, w = smart_resize_video(x.shape[0], x.shape[-2], x.shape[-1], c.temporal_patch_size, factor,
                                      c.min_pixels, max_pixels)
            x = _resize(x, h, w, c.resample)
        x = _rescale_normalize(x, c)
        if pad := -x.shape[0] % c.temporal_patch_size:  # repeat the last frame to fill the temporal patch
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        pixels, grid = _patchify(x, c)
        return VisionItem("video", pixels, grid, c.merge_size, _timestamps(np.asarray(indices), source_fps, c.temporal_patch_size))


def _frames_to_array(frames) -> np.ndarray:
    if isinstance(frames, np.ndarray):
        arr = frames
    else:
        arr = np.stack([_image_to_rgb_array(f) for f in frames]) if len(frames) else np.zeros((0, 1, 1, 3), np.uint8)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3:
        raise MediaError(f"video frames must be TxHxWx3 uint8, got {arr.dtype} {arr.shape}")
    if arr.shape[0] == 0:
        raise MediaError("video has no frames")
    return arr


def _timestamps(indices: np.ndarray, fps: float, tp: int) -> tuple[float, ...]:
    """Seconds of each temporal patch: the mean of its first and last frame's time
    (Qwen3VLProcessor._calculate_timestamps)."""
    idx = [int(i) for i in indices]
    if len(idx) % tp:
        idx.extend(idx[-1] for _ in range(tp - len(idx) % tp))
    secs = [i / fps for i in idx]
    return tuple((secs[i] + secs[i + tp - 1]) / 2 for i in range(0, len(secs), tp))


def _resize(x: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize on a CPU uint8 batch [N, C, H, W]: the same
    interpolate call (align_corners=False, antialias=True) on the uint8 tensor, no float round trip."""
    if (height, width) == tuple(x.shape[-2:]):
        return x  # torchvision returns the input unchanged
    return F.interpolate(x, size=[height, width], mode=mode, align_corners=False, antialias=True)


def _rescale_normalize(x: torch.Tensor, c: ProcessorConfig) -> torch.Tensor:
    """uint8 -> fp32; rescale and normalize fused as HF does ((x - 255 mean) / (255 std)), so the
    rounding matches bit for bit."""
    if c.do_rescale and c.do_normalize:
        mean = torch.tensor(c.image_mean) * (1.0 / c.rescale_factor)
        std = torch.tensor(c.image_std) * (1.0 / c.rescale_factor)
        return x.to(torch.float32).sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    if c.do_normalize:
        return x.to(torch.float32).sub(torch.tensor(c.image_mean).view(-1, 1, 1)).div_(
            torch.tensor(c.image_std).view(-1, 1, 1))
    if c.do_rescale:
        return x * c.rescale_factor
    return x.to(torch.float32)


def _patchify(x: torch.Tensor, c: ProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, C, H, W] (T a multiple of tp) -> rows ordered (t, h-block, w-block, h-in, w-in), each row
    (C, tp, p, p) flattened: Conv3d's weight order, and merge blocks contiguous for the merger."""
    t, ch, height, width = x.shape
    p, tp, m = c.patch_size, c.temporal_patch_size, c.merge_size
    if height % (p * m) or width % (p * m):
        raise MediaError(f"frame size {width}x{height} is not a multiple of {p * m} (enable do_resize)")
    gt, gh, gw = t // tp, height // p, width // p
    v = x.reshape(gt, tp, ch, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return v.reshape(gt * gh * gw, ch * tp * p * p).contiguous(), (gt, gh, gw)


# ---------------------------------------------------------------------------------------------
# prompt expansion
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionTokenIds:
    image: int
    video: int
    vision_start: int
    vision_end: int


def expand_vision_tokens(prompt_ids: Sequence[int], items: Sequence[VisionItem], ids: VisionTokenIds,
                         encode: Callable[[str], list[int]]) -> list[int]:
    """Replace the i-th media pad of the prompt with item i's tokens. `items` are in prompt order;
    `encode` tokenizes plain text (the video timestamps) without special tokens.

    A video written `<|vision_start|><|video_pad|><|vision_end|>` (as the chat template does) is
    replaced whole, as Qwen3-VL's own processor and vLLM do: each temporal patch brings its own
    start/end markers. (transformers 5.24 replaces the bare pad only and so nests the markers; a
    prompt with a bare `<|video_pad|>` gets the same tokens from both.)
    """
    out: list[int] = []
    it = iter(items)
    i, n, count = 0, len(prompt_ids), 0
    while i < n:
        tok = prompt_ids[i]
        i += 1
        if tok not in (ids.image, ids.video):
            out.append(tok)
            continue
        item, k = next(it, None), count
        count += 1
        kind = "image" if tok == ids.image else "video"
        if item is None:
            raise MediaError(f"the prompt has more media placeholders than the {k} images/videos given")
        if item.kind != kind:
            raise MediaError(f"media placeholder {k} in the prompt is for a {kind}, but media item {k} is a {item.kind}")
        if kind == "image":
            out.extend([ids.image] * item.num_tokens)
            continue
        if out and out[-1] == ids.vision_start and i < n and prompt_ids[i] == ids.vision_end:
            out.pop()  # the template's markers give way to the per-patch ones
            i += 1
        for ts in item.timestamps:  # one temporal patch per timestamp
            out.extend(encode(f"<{ts:.1f} seconds>"))
            out.append(ids.vision_start)
            out.extend([ids.video] * item.tokens_per_frame)
            out.append(ids.vision_end)
    if next(it, None) is not None:
        raise MediaError("more images/videos were given than the prompt has placeholders for")
    return out
