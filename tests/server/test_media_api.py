"""Images and videos through the real server: `image_url` parts as http(s) URLs (a loopback HTTP
server), data URLs and bare base64, `video_url` parts (animated GIF), the chat template's
placeholders expanded to the items' tokens, the same answer as the offline engine; and every
limit or failure (21 images, 3 videos, oversized, undecodable, unreachable within the timeout,
disallowed domain, local file, a decompression bomb, a request over the pixel budget) a clear 400,
with the server healthy after each. With default levers, URLs that resolve inside (loopback, the
metadata address, private ranges, the server's own /metrics, a redirect from an allowed host to
the metadata address) are refused by address before any connection."""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from conftest import start_server
from media_files import blank_png
from PIL import Image

from qv import LLM, SamplingParams

MAX_BYTES, TIMEOUT_S = 20000, 1.5


def png(seed: int, w: int = 40, h: int = 30) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def gif(frames: int = 9, ms: int = 250) -> bytes:
    rng = np.random.default_rng(5)
    ims = [Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    ims[0].save(buf, "GIF", save_all=True, append_images=ims[1:], duration=ms, loop=0)
    return buf.getvalue()


PNG, GIF = png(0), gif()


class Handler(BaseHTTPRequestHandler):
    hits: list = []  # paths requested, in order

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        Handler.hits.append(self.path)
        bodies = {"/img.png": PNG, "/anim.gif": GIF, "/big": b"x" * (MAX_BYTES + 5000), "/text": b"not an image"}
        if self.path == "/slow":
            time.sleep(10 * TIMEOUT_S)  # far past the timeout, so a fetch that waits for the host shows
        body = bodies.get(self.path, PNG if self.path == "/slow" else b"")
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def media_host():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads, srv.block_on_close = True, False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_port
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def media_server(tiny_model):
    running, stop = start_server(tiny_model, media_max_bytes=MAX_BYTES, media_timeout_s=TIMEOUT_S,
                                 media_allowed_domains="127.0.0.1", media_allowed_networks="127.0.0.0/8")
    yield running
    stop()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*parts, text="What is in the picture?", **kw) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "return_token_ids": True, **kw}


def post(server, body) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_image_sources_agree_with_the_engine(media_server, media_host, tiny_model):
    """One PNG as an http URL, a data URL and bare base64 (and streamed): the same expanded prompt
    and the same tokens and logprobs, equal to the offline engine given the decoded image."""
    urls = [f"http://127.0.0.1:{media_host}/img.png", f"data:image/png;base64,{b64(PNG)}", b64(PNG)]
    answers = []
    for url in urls:
        r = post(media_server, ask(image_part(url)))
        assert r.status_code == 200, r.text
        answers.append(r.json())
    first = answers[0]
    for a in answers[1:]:
        assert a["prompt_token_ids"] == first["prompt_token_ids"]
        assert a["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert a["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    llm = LLM(model=str(tiny_model))
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False)
    im = Image.open(io.BytesIO(PNG))
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": im}}, SamplingParams(temperature=0, max_tokens=6))[0]
    assert first["prompt_token_ids"] == out.prompt_token_ids
    assert first["choices"][0]["token_ids"] == out.outputs[0].token_ids
    assert first["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    pad = llm.engine.model_config.image_token_id
    assert out.prompt_token_ids.count(pad) == llm.engine.multimodal.processor.image(im).num_tokens > 1
    with httpx.stream("POST", media_server.v1 + "/chat/completions", json=ask(image_part(urls[1]), stream=True),
                      timeout=120) as r:
        ids = [t for line in r.iter_lines() if line.startswith("data: {")
               for c in __import__("json").loads(line[6:])["choices"] for t in c.get("token_ids") or []]
    assert ids == first["choices"][0]["token_ids"]


def test_video_url_and_images_together(media_server, media_host):
    """A video (animated GIF, http and data URL) after an image: each video expands to its temporal
    patches with their timestamps; a different image changes the answer's logprobs."""
    parts = [image_part(b64(PNG)), {"type": "video_url", "video_url": {"url": f"http://127.0.0.1:{media_host}/anim.gif"}}]
    r = post(media_server, ask(*parts, text="Describe both."))
    assert r.status_code == 200, r.text
    r2 = post(media_server, ask(parts[0], {"type": "video_url", "video_url": {"url": f"data:image/gif;base64,{b64(GIF)}"}},
                                text="Describe both."))
    assert r2.status_code == 200 and r2.json()["choices"][0]["token_ids"] == r.json()["choices"][0]["token_ids"]
    r3 = post(media_server, ask(image_part(b64(png(1))), parts[1], text="Describe both."))
    assert r3.status_code == 200
    assert r3.json()["prompt_token_ids"] == r.json()["prompt_token_ids"]  # same sizes: same tokens, other pixels
    assert r3.json()["choices"][0]["logprobs"] != r.json()["choices"][0]["logprobs"]


def _failures(port: int) -> list[tuple[str, dict, str, str]]:
    """(name, body, param, message fragment)."""
    tiny = f"data:image/png;base64,{b64(png(2, 8, 8))}"
    gif_url = {"type": "video_url", "video_url": {"url": f"data:image/gif;base64,{b64(gif(3))}"}}
    url = f"http://127.0.0.1:{port}"
    one = "messages[0].content[1]"
    return [
        ("21 images", ask(*[image_part(tiny)] * 21), "messages", "at most 20 images per request"),
        ("3 videos", ask(*[gif_url] * 3), "messages", "at most 2 videos per request"),
        ("oversized", ask(image_part(f"{url}/big")), one, f"could not fetch media URL: too large (over the {MAX_BYTES}-byte"),
        ("oversized base64", ask(image_part(b64(b"\0" * (MAX_BYTES + 10)))), one, "byte limit"),
        ("undecodable", ask(image_part(f"{url}/text")), one, "could not decode the image"),
        ("truncated png", ask(image_part(b64(PNG[:60]))), one, "could not decode the image"),
        ("not base64", ask(image_part("%%% not base64 %%%")), one, "not an http(s) URL, a data URL or base64"),
        ("slow", ask(image_part(f"{url}/slow")), one, "could not fetch media URL: timed out (media_timeout_s)"),
        ("missing", ask(image_part(f"{url}/nothing")), one, "could not fetch media URL: HTTP error"),
        ("refused", ask(image_part("http://127.0.0.1:9/x.png")), one, "could not fetch media URL: could not connect"),
        ("disallowed domain", ask(image_part(f"http://localhost:{port}/img.png")), one, "domain not allowed"),
        ("local file", ask(image_part("file:///etc/hostname")), one, "local files are not allowed"),
        ("video not animated", ask({"type": "video_url", "video_url": {"url": b64(PNG)}}), one, "animated GIF"),
        ("placeholder mismatch", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}, image_part(tiny)]}],
            "max_tokens": 2}, "messages", "does not match the request's media"),
    ]


def test_limits_and_failures_are_clear_400s(media_server, media_host):
    for name, body, param, fragment in _failures(media_host):
        t0 = time.time()
        r = post(media_server, body)
        took = time.time() - t0
        assert r.status_code == 400, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert fragment in err["message"] and err["param"] == param, (name, err)
        assert "404" not in err["message"] and ":9" not in err["message"], (name, err)  # no port, no status
        assert took < 30, (name, took)
        if name == "slow":
            assert took < 10 * TIMEOUT_S, took  # the timeout holds: the host answers only after 10x it
        assert httpx.get(media_server.url + "/health", timeout=30).status_code == 200, name
    ok = post(media_server, ask(image_part(b64(PNG))))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_media_only_on_chat_completions(server):
    """The Responses API keeps refusing media parts, clearly."""
    r = httpx.post(server.v1 + "/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": f"data:image/png;base64,{b64(PNG)}"}]}],
        "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "/v1/chat/completions only" in r.json()["error"]["message"], r.text


def test_model_without_vision_refuses_media():
    """A model without a vision tower (ServerMedia without the engine's prompt builder): a 400 naming the part."""
    import asyncio

    from qv.config import EngineConfig
    from qv.server.errors import APIError
    from qv.server.media import ServerMedia

    with pytest.raises(APIError) as e:
        asyncio.run(ServerMedia(EngineConfig(), None).prompt([{"content": [image_part(b64(PNG))]}], [1, 2]))
    assert e.value.status == 400 and "takes no images or videos" in e.value.message
    assert e.value.param == "messages[0].content[0]"


INSIDE = ["http://127.0.0.1:{port}/img.png", "http://localhost:{port}/img.png", "http://[::1]:{port}/img.png",
          "http://[::ffff:127.0.0.1]:{port}/img.png", "http://0.0.0.0:{port}/img.png", "{server}/metrics",
          "http://169.254.169.254/latest/meta-data/", "http://10.0.0.5/a.png", "http://100.64.0.1/a.png",
          "http://192.168.1.1/a.png", "http://[fd00::5]/a.png", "http://[fe80::1]/a.png"]


def test_inside_addresses_refused_by_default(server, media_host):
    """Default levers (the shared server): every URL that resolves inside is refused by address,
    before a connection (the loopback host sees no request), with one message for all."""
    Handler.hits.clear()
    for url in INSIDE:
        url = url.format(port=media_host, server=server.url)
        r = post(server, ask(image_part(url)))
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["message"] == ("messages[0].content[1]: could not fetch media URL: address not "
                                                "allowed (media_allowed_networks)"), (url, r.text)
    assert Handler.hits == []
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_bombs_and_pixel_budget_refused_by_header(server):
    """A 20000x20000 PNG of 389 kB, and twenty 8000x8000 PNGs (a 5 MB body, each image within
    the per-image limit): 400 from the headers, nothing decoded."""
    bomb = blank_png(20000, 20000, 1)
    assert len(bomb) < 400_000
    r = post(server, ask(image_part(b64(bomb))))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[0].content[1]: image is over the 67108864-pixel limit")
    many = [image_part("data:image/png;base64," + b64(blank_png(8000, 8000)))] * 20
    body = ask(*many)
    assert 4_500_000 < len(__import__("json").dumps(body)) < 5_500_000
    t0 = time.time()
    r = post(server, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "have 1280000000 pixels in all, over the 268435456-pixel limit of one request (media_max_pixels)" in \
        r.json()["error"]["message"]
    assert time.time() - t0 < 3  # refused from the headers: decoding the twenty images would take seconds
    ok = post(server, ask(*many[:2]))  # two of them fit the budget: decoded and answered
    assert ok.status_code == 200, ok.text
