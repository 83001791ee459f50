"""MP4 and WebM (ISO-BMFF and Matroska files) read with PyAV, every size known before a frame is
decoded, and decoding bounded.

- `probe(data, limits)` opens the container with its demuxer named by the bytes' signature: no
  other FFmpeg demuxer ever sees the bytes, so a playlist, a concat script or an external
  reference cannot make FFmpeg open another file or URL. It takes the first video stream (an
  audio-only file is refused) and refuses by header: a codec outside VIDEO_CODECS, a frame over
  `max_frame_pixels`, a declared frame count (MP4's sample table; where the container has none,
  as WebM, its duration times the frame rate) over `max_frames`. Then it counts the stream's
  packets, demuxing only (no decoding), which gives the frame count sampling uses, exact for
  WebM too, and refuses a file that holds fewer frames than its header declares (truncated).
- `decode(video, indices)` decodes in presentation order up to the last sampled frame and writes
  the sampled ones as RGB (PyAV's `to_ndarray(format="rgb24")`, as transformers' PyAV reader)
  into one preallocated array. The decoder refuses frames over `max_frame_pixels` itself
  (FFmpeg's max_pixels, so a size change in mid-stream cannot allocate more), every frame must
  have the header's size, and past `decode_timeout_s` decoding stops.

Every refusal is a MediaError (the server answers 400). Decoding uses one thread per video: the
server runs it in its media pool (`media_decode_threads`), never on the event loop.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from qv.errors import MediaError

# Codecs qv decodes (FFmpeg's names): what cameras, phones and browsers write. Other decoders are
# refused, so the attack surface is these few.
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide")  # first box of an MP4/MOV file
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska and WebM
MAX_FRAME_PIXELS = 1 << 26  # 67M pixels: past any camera's frame, far short of a decompression bomb
_MAX_STREAMS = 64  # per-stream decoder options are given to this many streams (more is refused)
# Truncation shows as packets ending before the declared duration; this much slack (in frames)
# absorbs rounding of container timestamps.
_DURATION_SLACK_FRAMES = 1.5


@dataclass(frozen=True)
class VideoLimits:
    max_frames: int = 4096  # frames of one video (declared, counted and decoded)
    decode_timeout_s: float = 60.0  # wall time of one video's decoding
    max_frame_pixels: int = MAX_FRAME_PIXELS  # pixels of one frame


def container_format(data: bytes) -> str | None:
    """FFmpeg's demuxer for the bytes ("mov" for MP4/MOV, "matroska" for WebM/MKV), or None."""
    if data[4:8] in _ISO_BOXES:
        return "mov"
    if data[:4] == _EBML_MAGIC:
        return "matroska"
    return None


@dataclass(eq=False)
class VideoFile:
    """One probed video file: its header's facts and the packet count, nothing decoded."""

    data: bytes
    demuxer: str
    width: int
    height: int
    total_frames: int  # counted packets of the video stream
    fps: float | None  # average frame rate (transformers' PyAV reader uses the same); None: unknown
    limits: VideoLimits

    def close(self) -> None:
        self.data = b""  # the bytes are the only thing held; each decode opens its own container


def _av():
    try:
        import av
    except ImportError:
        raise MediaError("could not decode the video: MP4/WebM need PyAV (pip install 'qv[server]')") from None
    return av


def _decoder_options(limits: VideoLimits) -> dict[str, str]:
    return {"max_pixels": str(limits.max_frame_pixels), "threads": "1"}


def _open(data: bytes, demuxer: str, limits: VideoLimits):
    """The container; the decoders FFmpeg opens to probe its streams are held to one thread and
    `max_frame_pixels` (as `decode`'s own is)."""
    av = _av()
    return av.open(io.BytesIO(data), format=demuxer, stream_options=[_decoder_options(limits)] * _MAX_STREAMS,
                   metadata_errors="ignore")


def _undecodable(exc: BaseException) -> MediaError:
    return MediaError(f"could not decode the video ({type(exc).__name__})")


def _frame_rate(stream) -> float | None:
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate and rate > 0:
            return float(rate)
    return None


def _declared_seconds(container, stream) -> float | None:
    """The video stream's duration from the header: its own (MP4), its DURATION tag (Matroska as
    FFmpeg and mkvmerge write it), or the file's when the video is the only stream."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    if tag:
        try:
            h, m, s = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(s)
        except ValueError:
            pass
    if container.duration and len(container.streams) == 1:
        return container.duration / 1e6
    return None


def _video_stream(container):
    if len(container.streams) > _MAX_STREAMS:
        raise MediaError(f"video file has {len(container.streams)} streams, over the limit of {_MAX_STREAMS}")
    if not container.streams.video:
        raise MediaError("the file has no video stream (audio only?)")
    stream = container.streams.video[0]
    codec = stream.codec_context.codec.canonical_name if stream.codec_context is not None else None
    if codec not in VIDEO_CODECS:
        raise MediaError(f"video codec {codec or 'unknown'!r} is not supported ({', '.join(VIDEO_CODECS)})")
    return stream


def _check_header(container, stream, limits: VideoLimits, fps: float | None) -> tuple[int, float | None]:
    """Refuse by header: frame size, declared frames (or duration x rate). (The declared frame count, 0 where
    there is none; the declared seconds or None.)"""
    w, h = stream.codec_context.width, stream.codec_context.height
    if w < 1 or h < 1:
        raise MediaError(f"video frame size {w}x{h} is empty")
    if w * h > limits.max_frame_pixels:
        raise MediaError(f"video of {w}x{h} pixels is over the {limits.max_frame_pixels}-pixel limit of one frame")
    declared = int(stream.frames or 0)
    if declared > limits.max_frames:
        raise MediaError(f"video header declares {declared} frames, over the {limits.max_frames}-frame limit "
                         "(media_max_video_frames)")
    seconds = _declared_seconds(container, stream)
    if not declared and seconds and fps and seconds * fps > limits.max_frames:
        raise MediaError(f"video header declares {seconds:.1f} s at {fps:g} fps ({seconds * fps:.0f} frames), over "
                         f"the {limits.max_frames}-frame limit (media_max_video_frames)")
    return declared, seconds


def _count_packets(container, stream, limits: VideoLimits) -> tuple[int, int, float]:
    """(frames shown, packets in all, end time in seconds) of the stream, by demuxing only."""
    shown = total = 0
    end = Fraction(0)
    for packet in container.demux(stream):
        if not packet.size:  # the demuxer's flush packet
            continue
        if packet.is_corrupt:
            raise MediaError(f"video packet {total} is corrupt (a truncated or damaged file)")
        total += 1
        shown += not packet.is_discard
        if shown > limits.max_frames:
            raise MediaError(f"video has more than {limits.max_frames} frames (media_max_video_frames)")
        if packet.pts is not None and packet.time_base:
            end = max(end, (packet.pts + (packet.duration or 0)) * packet.time_base)
    return shown, total, float(end)


def probe(data: bytes, limits: VideoLimits = VideoLimits()) -> VideoFile:
    """The header and frame count of an MP4/WebM file (MediaError: not one, too large, damaged)."""
    demuxer = container_format(data)
    if demuxer is None:
        raise MediaError("not an MP4 or WebM file")
    try:
        with _open(data, demuxer, limits) as container:
            stream = _video_stream(container)
            fps = _frame_rate(stream)
            declared, seconds = _check_header(container, stream, limits, fps)
            start = float(stream.start_time * stream.time_base) if stream.start_time and stream.time_base else 0.0
            width, height = stream.codec_context.width, stream.codec_context.height
            shown, total, end = _count_packets(container, stream, limits)
    except MediaError:
        raise
    except Exception as exc:  # untrusted bytes: any demuxer failure is the data's fault
        raise _undecodable(exc) from None
    if shown == 0:
        raise MediaError("the video stream has no frames")
    if declared and total < declared:
        raise MediaError(f"the file holds {total} of the {declared} frames its header declares (truncated?)")
    if not declared and seconds and fps and end - start < seconds - _DURATION_SLACK_FRAMES / fps:
        raise MediaError(f"the file's frames end at {end - start:.2f} s of the {seconds:.2f} s its header declares "
                         "(truncated?)")
    return VideoFile(data, demuxer, width, height, shown, fps, limits)


def decode(video: VideoFile, indices) -> np.ndarray:
    """The frames at `indices` (source frame numbers, ascending; repeats allowed) as one
    [len(indices), H, W, 3] uint8 RGB array."""
    want = [int(i) for i in indices]
    if not want or min(want) < 0 or max(want) >= video.total_frames:
        raise MediaError(f"frame indices must lie in [0, {video.total_frames}), got {want[:1]}..{want[-1:]}")
    slots: dict[int, list[int]] = {}
    for pos, i in enumerate(want):
        slots.setdefault(i, []).append(pos)
    out = np.empty((len(want), video.height, video.width, 3), np.uint8)
    last, limits, seen = max(want), video.limits, -1
    t0 = time.monotonic()
    try:
        with _open(video.data, video.demuxer, limits) as container:
            stream = container.streams.video[0]
            stream.codec_context.options = _decoder_options(limits)  # before the decoder opens
            for frame in container.decode(stream):
                seen += 1
                if (frame.width, frame.height) != (video.width, video.height):
                    raise MediaError(f"video frame {seen} is {frame.width}x{frame.height}; the header says "
                                     f"{video.width}x{video.height}")
                if seen in slots:
                    out[slots[seen]] = frame.to_ndarray(format="rgb24")
                if seen >= last:
                    break
                if time.monotonic() - t0 > limits.decode_timeout_s:
                    raise MediaError(f"decoding the video took over {limits.decode_timeout_s:g} s "
                                     "(media_video_decode_timeout_s)")
    except MediaError:
        raise
    except Exception as exc:  # untrusted bytes: any decoder failure is the data's fault (or a frame over the limit)
        raise MediaError(f"could not decode the video at frame {seen + 1} ({type(exc).__name__})") from None
    if seen < last:
        raise MediaError(f"video decoded to {seen + 1} frames; its {video.total_frames} packets promised more "
                         "(a damaged file)")
    return out
