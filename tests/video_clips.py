"""Video files for the tests, encoded here with PyAV: short clips in MP4 (h264, mpeg4) and WebM
(vp8, vp9), audio-only files, and lying ones (a header patched to declare another duration, a
stream whose frames change size in mid-stream)."""

from __future__ import annotations

import re
import struct
from fractions import Fraction
import tempfile
from pathlib import Path

import numpy as np

EXT = {"mp4": "mp4", "webm": "webm"}
CLUSTER_ID = b"\x1f\x43\xb6\x75"  # Matroska: the header elements all come before the first cluster


def frames_of(n: int, w: int, h: int, seed: int) -> np.ndarray:
    """[n, h, w, 3] uint8: a gradient drifting frame to frame plus noise, so that resizing and
    sampling differences show in many pixels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = np.empty((n, h, w, 3), np.uint8)
    for t in range(n):
        base = np.stack([(xx * 255 // max(w - 1, 1) + 9 * t) % 256, (yy * 255 // max(h - 1, 1) + 5 * t) % 256,
                         (xx + yy + 17 * t) % 256], -1)
        out[t] = np.clip(base + rng.integers(-30, 30, (h, w, 3)), 0, 255)
    return out


def clip(fmt: str, codec: str, n: int, w: int, h: int, fps: int, seed: int = 0, *, faststart: bool = False,
         audio: bool = False, still: bool = False) -> bytes:
    """An encoded clip of n frames (yuv420p); `faststart` moves MP4's header before the data,
    `still` repeats the first frame (a long clip of a few bytes per frame)."""
    import av

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"clip.{EXT[fmt]}"
        with av.open(str(path), "w", format=fmt, options={"movflags": "faststart"} if faststart else {}) as out:
            stream = out.add_stream(codec, rate=fps)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            sound = out.add_stream("aac" if fmt == "mp4" else "libopus", rate=48000) if audio else None
            pictures = frames_of(1 if still else n, w, h, seed)
            for t in range(n):
                frame = av.VideoFrame.from_ndarray(pictures[0 if still else t], format="rgb24")
                out.mux(stream.encode(frame))
            out.mux(stream.encode())
            if sound is not None:
                _mux_silence(out, sound, seconds=n / fps)
        return path.read_bytes()


def _mux_silence(out, sound, seconds: float) -> None:
    import av

    frame = av.AudioFrame.from_ndarray(np.zeros((1, int(48000 * seconds)), np.float32), format="fltp", layout="mono")
    frame.sample_rate = 48000
    out.mux(sound.encode(frame))
    out.mux(sound.encode())


def audio_only(fmt: str) -> bytes:
    import av

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"sound.{EXT[fmt]}"
        with av.open(str(path), "w", format=fmt) as out:
            _mux_silence(out, out.add_stream("aac" if fmt == "mp4" else "libopus", rate=48000), seconds=1.0)
        return path.read_bytes()


def _patch_element(data: bytes, element_id: bytes, value: bytes) -> bytes:
    """Overwrite one Matroska header element's payload (same size); the element must be unique there."""
    head = data[: data.index(CLUSTER_ID)]
    size_byte = bytes([0x80 | len(value)])
    at = head.find(element_id + size_byte)
    assert at >= 0 and head.find(element_id + size_byte, at + 1) < 0, f"element {element_id.hex()} not unique"
    at += len(element_id) + 1
    return data[:at] + value + data[at + len(value):]


def webm_declaring(data: bytes, duration_s: float) -> bytes:
    """A WebM whose header declares another duration (the segment's and every stream's tag)."""
    data = _patch_element(data, b"\x44\x89", struct.pack(">d", duration_s * 1000.0))  # in ms (TimestampScale 1e6 ns)
    head = data[: data.index(CLUSTER_ID)]  # and the streams' DURATION tags, "HH:MM:SS.nnnnnnnnn"
    h, rest = divmod(duration_s, 3600)
    tag = f"{int(h):02d}:{int(rest // 60):02d}:{rest % 60:012.9f}".encode()
    return re.sub(rb"\d\d:\d\d:\d\d\.\d{9}", tag, head) + data[len(head):]


def webm_growing(small: tuple[int, int], large: tuple[int, int], n: int = 4, fps: int = 10) -> bytes:
    """A VP8 WebM whose header says `small` (w, h) but whose frames after the first n are `large`
    (a keyframe at the new size, spliced from a second encoder)."""
    import av

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "grow.webm"
        with av.open(str(path), "w", format="webm") as out:
            stream = out.add_stream("libvpx", rate=fps)
            stream.width, stream.height, stream.pix_fmt = small[0], small[1], "yuv420p"
            pts = 0
            for w, h in (small, large):
                enc = av.CodecContext.create("libvpx", "w")
                enc.width, enc.height, enc.pix_fmt, enc.time_base = w, h, "yuv420p", Fraction(1, fps)
                enc.framerate = fps
                for picture in frames_of(n, w, h, seed=w):
                    frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
                    frame.pts, pts = pts, pts + 1
                    for packet in enc.encode(frame):
                        packet.stream = stream
                        out.mux(packet)
                for packet in enc.encode():
                    packet.stream = stream
                    out.mux(packet)
        return path.read_bytes()


def one_black_frame(w: int, h: int) -> bytes:
    """An MP4 (h264, ultrafast) of one black w x h frame: a few hundred kB even past 2^26 pixels."""
    import av

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.mp4"
        with av.open(str(path), "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=1)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            stream.options = {"preset": "ultrafast"}
            frame = av.VideoFrame(w, h, "yuv420p")
            for plane, fill in zip(frame.planes, (16, 128, 128)):  # video-range black
                plane.update(bytes([fill]) * plane.buffer_size)
            out.mux(stream.encode(frame))
            out.mux(stream.encode())
        return path.read_bytes()
