"""MP4 and WebM files (qv/engine/video_file.py) against transformers: clips encoded here with PyAV
(h264 and mpeg4 in MP4, vp8 and vp9 in WebM), read by qv (header, packet count, only the sampled
frames decoded) and by transformers in a separate process (hf_processor_oracle.py): its own PyAV
reader (`load_video(backend="pyav")`) sampling with Qwen3VLVideoProcessor's `sample_frames`, or,
for WebM, whose header gives that reader no frame count, every frame decoded and the processor
sampling them. Then every refusal of a video file, at the engine and at the server's media stage."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from vision_cases import BARE_VID, chat, expand
from video_clips import audio_only, clip, one_black_frame, webm_declaring, webm_growing

from qv.engine.media import VideoLimits, decode_video, frame_picker, open_media, preprocess
from qv.errors import MediaError
from qv.model.vision_processor import VisionProcessor

# name: (container, codec, frames, width, height, fps, readers transformers runs, extra clip arguments)
CLIPS = {
    "mp4-h264": ("mp4", "libx264", 23, 72, 50, 12, ("hf-pyav", "all-frames"), {}),  # 4 sampled: 2 temporal patches
    "mp4-h264-faststart-aac": ("mp4", "libx264", 30, 64, 48, 10, ("hf-pyav",), {"faststart": True, "audio": True}),
    "mp4-mpeg4": ("mp4", "mpeg4", 40, 96, 64, 8, ("hf-pyav", "all-frames"), {}),  # 10 sampled
    "mp4-h264-long": ("mp4", "libx264", 200, 64, 48, 20, ("hf-pyav",), {}),  # 20 wanted, max_frames 16
    "webm-vp8": ("webm", "libvpx", 31, 80, 60, 10, ("all-frames", "hf-pyav"), {}),  # 6 sampled
    "webm-vp9": ("webm", "libvpx-vp9", 90, 160, 120, 15, ("all-frames",), {}),  # 12 sampled, over the pixel budget
    "webm-vp8-opus": ("webm", "libvpx", 25, 64, 64, 5, ("all-frames",), {"audio": True}),  # 10 sampled
}


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory) -> dict[str, tuple[bytes, str]]:
    root = tmp_path_factory.mktemp("clips")
    out = {}
    for i, (name, (fmt, codec, n, w, h, fps, _, extra)) in enumerate(CLIPS.items()):
        data = clip(fmt, codec, n, w, h, fps, seed=i, **extra)
        path = root / f"{name}.{fmt}"
        path.write_bytes(data)
        out[name] = (data, str(path))
    return out


@pytest.fixture(scope="module")
def hf_clips(vision_dir, side_torchvision, clip_files, tmp_path_factory) -> dict:
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    cases = [dict(name=f"{name}/{reader}", text=chat(f"x {BARE_VID} y"), video_file=(clip_files[name][1], reader))
             for name, spec in CLIPS.items() for reader in spec[6]]
    work = tmp_path_factory.mktemp("hf-clips")
    with open(work / "in.pkl", "wb") as f:
        pickle.dump(cases, f)
    script = Path(__file__).with_name("hf_processor_oracle.py")
    r = subprocess.run([sys.executable, str(script), str(vision_dir), str(side_torchvision), str(work / "in.pkl"),
                        str(work / "out.pkl")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"HF processor oracle failed:\n{r.stderr[-4000:]}"
    with open(work / "out.pkl", "rb") as f:
        return pickle.load(f)


def qv_item(proc: VisionProcessor, data: bytes, limits: VideoLimits = VideoLimits()):
    return preprocess(proc, open_media(data, "video", frame_picker(proc), limits))


CASES = [(name, reader) for name, spec in CLIPS.items() for reader in spec[6] if (name, reader) != ("webm-vp8", "hf-pyav")]


@pytest.mark.parametrize("name,reader", CASES)
def test_video_file_equals_hf(name, reader, vision_dir, tokenizer, clip_files, hf_clips):
    """Same sampled frames, frame count and fps as transformers read; bit-equal pixel values,
    equal grid and prompt tokens (the timestamps included)."""
    ref = hf_clips[f"{name}/{reader}"]
    assert "error" not in ref, ref.get("error")
    data = clip_files[name][0]
    proc = VisionProcessor.from_dir(vision_dir)
    opened = open_media(data, "video", frame_picker(proc))
    video = opened.image
    frames, fps, indices = decode_video(opened, frame_picker(proc))
    assert (indices, video.total_frames, fps) == ref["sampled"]
    assert frames.shape == (len(indices), CLIPS[name][4], CLIPS[name][3], 3)
    assert opened.frames == len(indices) and opened.pixels == len(indices) * video.width * video.height
    item = qv_item(proc, data)
    assert [list(item.grid_thw)] == ref["video_grid_thw"].tolist()
    pv = ref["pixel_values_videos"]
    assert item.pixel_values.dtype == pv.dtype == torch.float32
    assert torch.equal(item.pixel_values, pv), f"max |diff| {(item.pixel_values - pv).abs().max().item()}"
    assert expand(tokenizer, vision_dir, chat(f"x {BARE_VID} y"), [item]) == ref["input_ids"][0].tolist()


def test_frames_equal_a_plain_decode(vision_dir, clip_files):
    """The sampled frames are the source frames at those indices of a plain PyAV decode of every
    frame (fresh check of the frame-selective loop, repeats allowed), and the clip's sizes."""
    import av

    from qv.engine.video_file import decode, probe

    for name, (data, _) in clip_files.items():
        with av.open(io.BytesIO(data)) as c:
            every = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        video = probe(data)
        assert video.total_frames == len(every) == CLIPS[name][2], name
        assert (video.height, video.width) == every.shape[1:3] == (CLIPS[name][4], CLIPS[name][3])
        want = [0, 0, 3, len(every) - 2, len(every) - 1, len(every) - 1]
        assert np.array_equal(decode(video, want), every[want]), name
        with pytest.raises(MediaError, match="frame indices must lie in"):
            decode(video, [len(every)])


def test_transformers_reader_cannot_sample_webm(hf_clips):
    """Why the WebM oracle decodes every frame: transformers' PyAV reader takes the frame count
    from the header, which WebM does not carry (PyAV reports 0); qv counts the packets."""
    assert "error" in hf_clips["webm-vp8/hf-pyav"]


@pytest.fixture(scope="module")
def bad_files() -> dict[str, bytes]:
    good_mp4 = clip("mp4", "libx264", 30, 64, 48, 10, faststart=True)
    good_webm = clip("webm", "libvpx-vp9", 30, 64, 48, 10)
    long_mp4 = clip("mp4", "mpeg4", 5000, 32, 32, 30, still=True, faststart=True)
    return {
        "truncated mp4 (header first)": good_mp4[: len(good_mp4) * 2 // 3],
        "truncated mp4 (header last)": clip("mp4", "libx264", 30, 64, 48, 10)[:5000],
        "truncated webm": good_webm[: len(good_webm) // 2],
        "mp4 signature then garbage": good_mp4[:32] + bytes(range(256)) * 20,
        "5000 frames": long_mp4,
        "5000 frames, header only": long_mp4[:40000],
        "webm declaring 5000 s": webm_declaring(good_webm, 5000.0),
        "8200x8200 frame": one_black_frame(8200, 8200),
        "audio-only mp4": audio_only("mp4"),
        "audio-only webm": audio_only("webm"),
        "frames growing in mid-stream": webm_growing((64, 48), (256, 192)),
        "hls playlist": b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.1:9/a.ts\n#EXT-X-ENDLIST\n",
    }


REFUSALS = {  # name: message fragment
    "truncated mp4 (header first)": "is corrupt (a truncated or damaged file)",
    "truncated mp4 (header last)": "could not decode the video (InvalidDataError)",
    "truncated webm": "of the 3.00 s its header declares (truncated?)",
    "mp4 signature then garbage": "could not decode the video (InvalidDataError)",
    "5000 frames": "video header declares 5000 frames, over the 4096-frame limit (media_max_video_frames)",
    "5000 frames, header only": "video header declares 5000 frames, over the 4096-frame limit",
    "webm declaring 5000 s": "declares 5000.0 s at 10 fps (50000 frames), over the 4096-frame limit",
    "8200x8200 frame": "video of 8200x8200 pixels is over the 67108864-pixel limit of one frame",
    "audio-only mp4": "the file has no video stream (audio only?)",
    "audio-only webm": "the file has no video stream (audio only?)",
    "frames growing in mid-stream": "video frame 4 is 256x192; the header says 64x48",
    "hls playlist": "could not decode the video: qv reads MP4 and WebM files, and animated GIF, WebP or PNG",
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_bad_video_files_refused(name, vision_dir, bad_files):
    """Each damaged, oversized or audio-only file: a MediaError naming the cause (the server's
    400); the header refusals before any frame is decoded (`open_media` alone raises them)."""
    proc = VisionProcessor.from_dir(vision_dir)
    with pytest.raises(MediaError) as e:
        qv_item(proc, bad_files[name])
    assert REFUSALS[name] in str(e.value), str(e.value)
    if name == "frames growing in mid-stream":  # its header is sound: refused while decoding
        assert open_media(bad_files[name], "video", frame_picker(proc)).image.total_frames == 8
        return
    with pytest.raises(MediaError) as before:
        open_media(bad_files[name], "video", frame_picker(proc))
    assert str(before.value) == str(e.value)


def test_decoder_holds_frames_to_the_pixel_limit(vision_dir, bad_files):
    """FFmpeg's own max_pixels is set on the decoder: with the limit below the grown frames, the
    decoder refuses frame 4 itself (before qv sees its size); the small frames before it decode."""
    proc = VisionProcessor.from_dir(vision_dir)
    data = bad_files["frames growing in mid-stream"]
    small = VideoLimits(max_frame_pixels=100 * 100)
    from qv.engine.video_file import decode, probe

    video = probe(data, small)
    assert decode(video, [0, 3]).shape == (2, 48, 64, 3)
    with pytest.raises(MediaError, match=r"could not decode the video at frame 4 \(ArgumentError\)"):
        qv_item(proc, data, small)


def test_frame_count_and_time_limits(vision_dir, clip_files):
    """A WebM whose header understates its duration passes the header check and is refused while
    its packets are counted; a decode past `decode_timeout_s` stops (limits given as levers)."""
    proc = VisionProcessor.from_dir(vision_dir)
    data = clip_files["webm-vp8"][0]  # 31 frames at 10 fps
    with pytest.raises(MediaError, match=r"declares 3.1 s at 10 fps \(31 frames\), over the 20-frame limit"):
        qv_item(proc, data, VideoLimits(max_frames=20))
    with pytest.raises(MediaError, match="video has more than 20 frames"):
        qv_item(proc, webm_declaring(data, 1.0), VideoLimits(max_frames=20))
    assert qv_item(proc, webm_declaring(data, 1.0), VideoLimits(max_frames=31)).grid_thw[0] == 3  # 6 frames
    with pytest.raises(MediaError, match=r"decoding the video took over 1e-09 s \(media_video_decode_timeout_s\)"):
        qv_item(proc, data, VideoLimits(decode_timeout_s=1e-9))


@pytest.fixture(scope="module")
def inputs(tiny_dirs):
    from transformers import AutoTokenizer

    from qv.config import ModelConfig
    from qv.engine.multimodal import MultimodalInputs

    d = tiny_dirs("tiny")
    return MultimodalInputs(d, ModelConfig.from_dir(d), AutoTokenizer.from_pretrained(d))


def test_server_media_stage_counts_sampled_frames(inputs, clip_files):
    """The request's pixel budget (`media_max_pixels`) counts the frames the processor samples
    (4 of the 23 frames of 72x50): one pixel less is a 400 from the header, before decoding; the
    levers reach the decoder (a 400 past the decode time limit)."""
    from qv.config import EngineConfig
    from qv.server.errors import APIError
    from qv.server.media import ServerMedia

    data = clip_files["mp4-h264"][0]
    sampled = 4 * 72 * 50
    item = asyncio.run(ServerMedia(EngineConfig(media_max_pixels=sampled), inputs).load(data, "v", "video"))
    assert torch.equal(item.pixel_values, qv_item(inputs.processor, data).pixel_values)
    with pytest.raises(APIError) as e:
        asyncio.run(ServerMedia(EngineConfig(media_max_pixels=sampled - 1), inputs).load(data, "v", "video"))
    assert e.value.status == 400 and f"have {sampled} pixels in all" in e.value.message
    with pytest.raises(APIError) as e:
        asyncio.run(ServerMedia(EngineConfig(media_video_decode_timeout_s=1e-9), inputs).load(data, "part", "video"))
    assert e.value.status == 400 and e.value.message.startswith("part: decoding the video took over 1e-09 s")
    with pytest.raises(APIError) as e:
        asyncio.run(ServerMedia(EngineConfig(media_max_video_frames=22), inputs).load(data, "part", "video"))
    assert "declares 23 frames, over the 22-frame limit (media_max_video_frames)" in e.value.message
