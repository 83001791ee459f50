"""MP4 and WebM `video_url` parts through the real server with the official openai client: as a
data URL and as a file from a loopback HTTP server, the same prompt tokens and answer as the
offline engine given every frame of the clip and its fps (the processor samples them there, the
path tests/vision/ holds equal to transformers); a video file and an image together. Every bad
file is a 400 with an OpenAI-style body naming the part, never a 500, and the server stays healthy:
truncated, corrupt, a header declaring 5000 frames or 5000 s, an 8200x8200 frame, audio only,
frames growing in mid-stream, three videos."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from conftest import start_server
from PIL import Image
from video_clips import audio_only, clip, one_black_frame, webm_declaring, webm_growing

from qv import LLM, SamplingParams

MP4 = clip("mp4", "libx264", 23, 72, 50, 12, seed=3)  # 4 frames sampled: 2 temporal patches
WEBM = clip("webm", "libvpx-vp9", 31, 80, 60, 10, seed=4)  # 6 sampled: 3 patches
MODEL = "tiny-0-0"
QUESTION = "What happens in the video?"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        body = {"/clip.mp4": MP4, "/clip.webm": WEBM}.get(self.path, b"")
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "video/webm" if self.path.endswith("webm") else "video/mp4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def video_host():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads, srv.block_on_close = True, False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def video_server(tiny_model):
    running, stop = start_server(tiny_model, media_allowed_networks="127.0.0.0/8")
    yield running
    stop()


@pytest.fixture(scope="module")
def client(video_server):
    import openai

    return openai.OpenAI(base_url=video_server.v1, api_key="unused", max_retries=0, timeout=120)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def chat(client, *parts, text=QUESTION):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": text}, *parts]}], max_tokens=6,
        temperature=0, logprobs=True, extra_body={"return_token_ids": True})


def every_frame(data: bytes) -> tuple[np.ndarray, float]:
    import av

    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(stream)]), float(stream.average_rate)


def answer(r) -> tuple:
    choice = r.choices[0]
    return r.prompt_token_ids, choice.token_ids, [t.logprob for t in choice.logprobs.content]


def test_video_files_agree_with_the_engine(client, video_host, tiny_model):
    """MP4 and WebM, each as a data URL and over http: the same answer both ways, and the offline
    engine's answer for every frame of the clip with its fps."""
    llm = LLM(model=str(tiny_model))
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "video"}]}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False)
    pad = llm.engine.model_config.video_token_id
    for name, data, mime, patches in (("clip.mp4", MP4, "video/mp4", 2), ("clip.webm", WEBM, "video/webm", 3)):
        by_data = chat(client, video_part(data_url(data, mime)))
        by_http = chat(client, video_part(f"{video_host}/{name}"))
        assert answer(by_http) == answer(by_data), name
        frames, fps = every_frame(data)
        offline = llm.generate({"prompt": text, "multi_modal_data": {"video": [(frames, fps)]}},
                               SamplingParams(temperature=0, max_tokens=6))[0]
        assert by_data.prompt_token_ids == offline.prompt_token_ids, name
        assert by_data.choices[0].token_ids == offline.outputs[0].token_ids, name
        item = llm.engine.multimodal.processor.video(frames, fps)
        assert item.grid_thw[0] == patches and offline.prompt_token_ids.count(pad) == item.num_tokens, name


def test_video_file_with_an_image(client):
    """An image then an MP4 in one message: 200; another clip of the same size changes the logprobs."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    image = {"type": "image_url", "image_url": {"url": data_url(buf.getvalue(), "image/png")}}
    a = chat(client, image, video_part(data_url(MP4, "video/mp4")), text="Describe both.")
    b = chat(client, image, video_part(data_url(clip("mp4", "libx264", 23, 72, 50, 12, seed=9), "video/mp4")),
             text="Describe both.")
    assert a.prompt_token_ids == b.prompt_token_ids  # same sizes, same tokens: only the pixels differ
    assert answer(a)[2] != answer(b)[2]


@pytest.fixture(scope="module")
def bad_videos() -> list[tuple[str, list, str, str]]:
    """(name, video parts, param, message fragment)."""
    faststart = clip("mp4", "libx264", 30, 64, 48, 10, faststart=True)
    long_mp4 = clip("mp4", "mpeg4", 5000, 32, 32, 30, still=True, faststart=True)
    one = "messages[0].content[1]"

    def part(data: bytes, mime: str = "video/mp4") -> list:
        return [video_part(data_url(data, mime))]

    return [
        ("truncated mp4", part(faststart[: len(faststart) * 2 // 3]), one, "(a truncated or damaged file)"),
        ("truncated mp4, header last", part(clip("mp4", "libx264", 30, 64, 48, 10)[:5000]), one,
         "could not decode the video (InvalidDataError)"),
        ("truncated webm", part(WEBM[: len(WEBM) // 2], "video/webm"), one, "its header declares (truncated?)"),
        ("corrupt mp4", part(faststart[:32] + bytes(range(256)) * 20), one, "could not decode the video"),
        ("5000 frames", part(long_mp4[:40000]), one, "video header declares 5000 frames, over the 4096-frame limit"),
        ("5000 s", part(webm_declaring(WEBM, 5000.0), "video/webm"), one, "declares 5000.0 s at 10 fps"),
        ("8200x8200", part(one_black_frame(8200, 8200)), one, "video of 8200x8200 pixels is over the 67108864-pixel"),
        ("audio-only mp4", part(audio_only("mp4")), one, "the file has no video stream (audio only?)"),
        ("audio-only webm", part(audio_only("webm"), "audio/webm"), one, "the file has no video stream"),
        ("growing frames", part(webm_growing((64, 48), (256, 192)), "video/webm"), one,
         "video frame 4 is 256x192; the header says 64x48"),
        ("3 videos", part(MP4) * 3, "messages", "at most 2 videos per request (media_max_videos); got 3"),
    ]


def test_bad_videos_are_clear_400s(client, video_server, bad_videos):
    import openai

    for name, parts, param, fragment in bad_videos:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, *parts)
        assert e.value.status_code == 400, name
        err = e.value.response.json()["error"]
        assert fragment in err["message"] and err["param"] == param, (name, err)
        assert err["type"] == "BadRequestError" and err["code"] == 400, (name, err)
        if param != "messages":
            assert err["message"].startswith(f"{param}: "), (name, err)
        assert httpx.get(video_server.url + "/health", timeout=30).status_code == 200, name
    two = chat(client, video_part(data_url(MP4, "video/mp4")), video_part(data_url(WEBM, "video/webm")))
    assert two.choices[0].finish_reason == "length"
