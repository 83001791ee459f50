"""Media bytes -> VisionItems, every size known before a pixel is decoded.

- `open_media(data, kind)` reads the header only (Pillow's `Image.open` is lazy): width, height
  and, for a video, its frame count. An image over MAX_IMAGE_PIXELS or a video over
  MAX_VIDEO_FRAMES is refused here, so a decompression bomb (a 20000x20000 PNG of 389 kB) never
  reaches the decoder. `OpenedMedia.pixels` is what decoding it would touch; a caller sums it
  over a request against its own budget before it decodes anything.
- `preprocess(processor, opened)` decodes one item and runs the checkpoint's processor on it
  (resize, normalize, patching): CPU work for a worker thread, never the event loop.

Pillow's own guard (`Image.MAX_IMAGE_PIXELS`) is set to the same limit, and its
DecompressionBombError is a MediaError like every other refusal: the caller answers 400.

Videos: qv has no video-file decoder dependency, so a video is an animated image (GIF, WebP,
APNG) decoded with Pillow into frames plus the frame rate from its frame durations; other
containers get a clear MediaError.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qv.errors import MediaError

if TYPE_CHECKING:  # the processor (and torch) load only when something is decoded, not with the server
    from qv.model.vision_processor import VisionItem, VisionProcessor

__all__ = ["MAX_IMAGE_PIXELS", "MAX_VIDEO_FRAMES", "MediaError", "OpenedMedia", "open_media", "preprocess",
           "decode_image", "decode_video"]

MAX_IMAGE_PIXELS = 1 << 26  # 67M pixels: past any photo a client sends, far short of a decompression bomb
MAX_VIDEO_FRAMES = 4096
KINDS = ("image", "video")


def _pil():
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS != MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
        # open_media refuses everything past the limit itself; Pillow's warning would only repeat it
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    return Image


@dataclass(eq=False)
class OpenedMedia:
    """One item with its header read and nothing decoded."""

    kind: str  # "image" or "video"
    image: Any  # the lazily opened PIL image
    frames: int  # 1 for an image

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height

    @property
    def pixels(self) -> int:
        """Pixels decoding touches: animated formats decode every frame in sequence."""
        return self.width * self.height * self.frames

    def close(self) -> None:
        self.image.close()


def _undecodable(what: str, exc: BaseException) -> MediaError:
    return MediaError(f"could not decode the {what} ({type(exc).__name__})")


def open_media(data: bytes, kind: str) -> OpenedMedia:
    """The header of an image or a video (MediaError: not decodable, too large, not animated)."""
    if kind not in KINDS:
        raise MediaError(f"media kind must be one of {', '.join(KINDS)}, got {kind!r}")
    Image = _pil()
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MediaError(f"{kind} is over the {MAX_IMAGE_PIXELS}-pixel limit (by more than twice)") from None
    except Exception as exc:  # untrusted bytes: any decoder failure is the data's fault
        if kind == "video":
            raise MediaError("could not decode the video: qv reads animated GIF, WebP or PNG (no MP4/WebM decoder "
                             "is installed)") from None
        raise _undecodable(kind, exc) from None
    if im.width * im.height > MAX_IMAGE_PIXELS:
        im.close()
        raise MediaError(f"{kind} of {im.width}x{im.height} pixels is over the {MAX_IMAGE_PIXELS}-pixel limit")
    if kind == "image":
        return OpenedMedia("image", im, 1)
    try:
        n = int(getattr(im, "n_frames", 1)) if getattr(im, "is_animated", False) else 1
    except Exception as exc:
        im.close()
        raise _undecodable("video", exc) from None
    if n < 2:
        im.close()
        raise MediaError("videos must be animated GIF, WebP or PNG (qv has no video-file decoder)")
    if n > MAX_VIDEO_FRAMES:
        im.close()
        raise MediaError(f"video has {n} frames, over the {MAX_VIDEO_FRAMES} limit")
    return OpenedMedia("video", im, n)


def decode_image(opened: OpenedMedia):
    """The decoded PIL image (its first frame)."""
    try:
        opened.image.load()
    except Exception as exc:  # truncated or corrupt pixel data
        raise _undecodable("image", exc) from None
    return opened.image


def decode_video(opened: OpenedMedia, pick=None):
    """(frames, fps, indices): RGB frames of one size, the source frame rate (None when the file
    gives no frame durations) and which source frames they are; `pick(total_frames, fps)` chooses
    the frames to keep (all when None), so a long video is never held whole."""
    im, n = opened.image, opened.frames
    try:
        total_ms = 0.0
        for i in range(n):
            im.seek(i)
            total_ms += float(im.info.get("duration") or 0)
        fps = 1000.0 * n / total_ms if total_ms > 0 else None
        indices = list(range(n)) if pick is None else [int(i) for i in pick(n, fps)]
        frames = []
        for i in indices:
            im.seek(i)
            frames.append(im.convert("RGB"))
    except MediaError:
        raise
    except Exception as exc:
        raise _undecodable("video", exc) from None
    return frames, fps, indices


def preprocess(processor: VisionProcessor, opened: OpenedMedia) -> VisionItem:
    """Decode one opened item and preprocess it for the tower (MediaError on any refusal)."""
    try:
        if opened.kind == "image":
            return processor.image(decode_image(opened))

        def pick(n: int, fps: float | None):  # decode only the frames the processor keeps
            return processor.sample_indices(n, 24.0 if fps is None else fps)

        return processor.video(*decode_video(opened, pick))
    finally:
        opened.close()
