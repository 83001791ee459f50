"""Media bytes -> VisionItems, every size known before a pixel is decoded.

- `open_media(data, kind, pick, limits)` reads the header only: width, height and, for a video,
  its frame count. An image over MAX_IMAGE_PIXELS or a video over `limits.max_frames` is refused
  here, so a decompression bomb (a 20000x20000 PNG of 389 kB) never reaches the decoder.
  `OpenedMedia.pixels` is what decoding it would produce; a caller sums it over a request against
  its own budget before it decodes anything.
- `preprocess(processor, opened)` decodes one item and runs the checkpoint's processor on it
  (resize, normalize, patching): CPU work for a worker thread, never the event loop.

Images (and animated images) are read with Pillow, whose own guard (`Image.MAX_IMAGE_PIXELS`) is
set to the same limit; its DecompressionBombError is a MediaError like every other refusal: the
caller answers 400.

Videos: MP4 and WebM (and other ISO-BMFF / Matroska files, by their signature) are read with
PyAV (qv/engine/video_file.py: header checks, packet count, bounded decoding of the sampled
frames only); animated GIF, WebP and APNG with Pillow, frames plus the frame rate from their
frame durations.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from qv.engine import video_file
from qv.engine.video_file import MAX_FRAME_PIXELS, VideoFile, VideoLimits, container_format, probe
from qv.errors import MediaError

if TYPE_CHECKING:  # the processor (and torch) load only when something is decoded, not with the server
    from qv.model.vision_processor import VisionItem, VisionProcessor

__all__ = ["MAX_IMAGE_PIXELS", "MAX_VIDEO_FRAMES", "MediaError", "OpenedMedia", "VideoLimits", "open_media",
           "preprocess", "decode_image", "decode_video", "frame_picker"]

MAX_IMAGE_PIXELS = MAX_FRAME_PIXELS  # one image and one video frame are held to the same limit
MAX_VIDEO_FRAMES = VideoLimits().max_frames
KINDS = ("image", "video")
VIDEO_FORMATS = "MP4 and WebM files, and animated GIF, WebP or PNG"


# The decoders untrusted bytes may reach: Pillow's others (EPS runs Ghostscript, and TGA, ICO, TIFF,
# FITS and the rest are rarely fuzzed) are refused by name. Videos are MP4/WebM through PyAV.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def format_of(data: bytes) -> str | None:
    """The Pillow format whose signature `data` carries, among those it has but qv does not decode
    (a prefix check only: no plugin of theirs opens the data)."""
    Image = _pil()
    Image.init()
    prefix = data[:64]
    for name, (_, accept) in Image.OPEN.items():
        if name in IMAGE_FORMATS or accept is None:
            continue
        try:
            if accept(prefix):
                return name
        except Exception:  # noqa: BLE001 - a plugin's signature check on odd bytes: not this format
            continue
    return None


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
    image: Any  # the lazily opened PIL image, or a probed VideoFile (MP4/WebM)
    frames: int  # frames decoded: 1 for an image, all of an animated image, the sampled ones of a video file

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height

    @property
    def pixels(self) -> int:
        """Pixels decoding produces: animated images decode every frame in sequence; a video
        file holds the sampled frames (decoding the others is bounded by frames and time)."""
        return self.width * self.height * self.frames

    def close(self) -> None:
        self.image.close()


def _undecodable(what: str, exc: BaseException) -> MediaError:
    return MediaError(f"could not decode the {what} ({type(exc).__name__})")


Pick = Callable[[int, float | None], Sequence[int]]  # (total frames, source fps) -> the frames kept


def open_media(data: bytes, kind: str, pick: Pick | None = None, limits: VideoLimits = VideoLimits()) -> OpenedMedia:
    """The header of an image or a video (MediaError: not decodable, too large, not animated).
    `pick` (see `frame_picker`) says which frames of a video file will be decoded, so that
    `pixels` counts those only; without it, all."""
    if kind not in KINDS:
        raise MediaError(f"media kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "video" and container_format(data) is not None:
        video = probe(data, limits)
        frames = video.total_frames if pick is None else len(pick(video.total_frames, video.fps))
        return OpenedMedia("video", video, frames)
    Image = _pil()
    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError(f"{kind} is over the {MAX_IMAGE_PIXELS}-pixel limit (by more than twice)") from None
    except Exception as exc:  # untrusted bytes: any decoder failure is the data's fault
        other = format_of(data)
        if other is not None:
            raise MediaError(f"{other} {kind}s are not read here: qv decodes {', '.join(IMAGE_FORMATS)} images"
                             + (f" and {VIDEO_FORMATS}" if kind == "video" else "")) from None
        if kind == "video":
            raise MediaError(f"could not decode the video: qv reads {VIDEO_FORMATS}") from None
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
        raise MediaError(f"a still image is not a video: qv reads {VIDEO_FORMATS}")
    if n > limits.max_frames:
        im.close()
        raise MediaError(f"video has {n} frames, over the {limits.max_frames}-frame limit (media_max_video_frames)")
    return OpenedMedia("video", im, n)


def decode_image(opened: OpenedMedia):
    """The decoded PIL image (its first frame)."""
    try:
        opened.image.load()
    except Exception as exc:  # truncated or corrupt pixel data
        raise _undecodable("image", exc) from None
    return opened.image


def decode_video(opened: OpenedMedia, pick: Pick | None = None):
    """(frames, fps, indices): RGB frames of one size (a list of PIL images, or a THW3 uint8
    array for a video file), the source frame rate (None when the file gives none) and which
    source frames they are; `pick(total_frames, fps)` chooses the frames to keep (all when
    None), so a long video is never held whole."""
    if isinstance(opened.image, VideoFile):
        video = opened.image
        indices = list(range(video.total_frames)) if pick is None else [int(i) for i in pick(video.total_frames, video.fps)]
        return video_file.decode(video, indices), video.fps, indices
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


def frame_picker(processor: VisionProcessor) -> Pick:
    """The frames the processor keeps of a video (no fps in the file: 24, as transformers assumes)."""
    def pick(total: int, fps: float | None):
        return processor.sample_indices(total, 24.0 if fps is None else fps)

    return pick


def preprocess(processor: VisionProcessor, opened: OpenedMedia) -> VisionItem:
    """Decode one opened item and preprocess it for the tower (MediaError on any refusal)."""
    try:
        if opened.kind == "image":
            return processor.image(decode_image(opened))
        return processor.video(*decode_video(opened, frame_picker(processor)))  # decode only the frames it keeps
    finally:
        opened.close()
