"""The media fetcher against a real HTTP server on loopback (opened to it by media_allowed_networks):
formats, limits and failures all end as 400s naming the part, and the fetcher keeps working after
each; the engine's header check and decoders (qv/engine/media.py) on the fetched bytes."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
import pytest
from PIL import Image

from qv.engine.media import MediaError, decode_image, decode_video, open_media
from qv.server.errors import APIError
from qv.server.media_fetch import MAX_REDIRECTS, MediaFetcher

LOOPBACK = "127.0.0.0/8"


def png(w=40, h=30, color=(200, 10, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def gif(frames=13, ms=100) -> bytes:
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    ims[0].save(buf, "GIF", save_all=True, append_images=ims[1:], duration=ms, loop=0)
    return buf.getvalue()


PNG, GIF = png(), gif()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # keep test output clean
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        p = self.path
        if p == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif p == "/anim.gif":
            self._send(200, GIF)
        elif p == "/big":
            self._send(200, b"x" * 5000)
        elif p == "/big-chunked":  # no Content-Length: the cap must hold while streaming
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"3e8\r\n" + b"y" * 1000 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif p == "/slow":
            time.sleep(3)
            self._send(200, PNG)
        elif p.startswith("/hop/"):
            n = int(p.split("/")[2])
            self._send(302, headers={"Location": "/img.png" if n == 0 else f"/hop/{n - 1}"})
        elif p == "/away":  # redirect to another host name (same server)
            self._send(302, headers={"Location": f"http://localhost:{self.server.server_port}/img.png"})
        elif p == "/to-metadata":  # an allowed host sending the fetch inside
            self._send(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
        elif p == "/to-self":
            self._send(302, headers={"Location": f"http://[::ffff:127.0.0.1]:{self.server.server_port}/img.png"})
        elif p == "/text":
            self._send(200, b"this is not an image")
        else:
            self._send(404, b"no")


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def fetcher(**kw) -> MediaFetcher:
    args = dict(max_bytes=4000, timeout_s=20.0, allowed_networks=LOOPBACK)  # generous: loaded CI machines are slow
    args.update(kw)
    return MediaFetcher(**args)


def run(coro):
    return asyncio.run(coro)


def bad(coro, match: str):
    with pytest.raises(APIError) as e:
        run(coro)
    assert e.value.status == 400 and "part[0]" in str(e.value.message), e.value.message
    assert match in e.value.message, e.value.message


def test_sources(server, tmp_path):
    f = fetcher(local_dir=str(tmp_path))
    b64 = base64.b64encode(PNG).decode()
    assert run(f.fetch_bytes(f"{server}/img.png", "part[0]")) == PNG
    assert run(f.fetch_bytes(f"data:image/png;base64,{b64}", "part[0]")) == PNG
    assert run(f.fetch_bytes(b64, "part[0]")) == PNG
    assert run(f.fetch_bytes(f"{server}/hop/{MAX_REDIRECTS - 1}", "part[0]")) == PNG
    (tmp_path / "a.png").write_bytes(PNG)
    assert run(f.fetch_bytes(f"file://{tmp_path}/a.png", "part[0]")) == PNG
    im = decode_image(open_media(run(f.fetch_bytes(f"{server}/img.png", "part[0]")), "image"))
    assert im.size == (40, 30) and im.getpixel((0, 0)) == (200, 10, 30)
    opened = open_media(run(fetcher(max_bytes=1 << 20).fetch_bytes(f"{server}/anim.gif", "part[0]")), "video")
    assert opened.frames == 13 and opened.pixels == 13 * 32 * 24
    frames, fps, idx = decode_video(opened)
    assert len(frames) == 13 and frames[0].size == (32, 24) and fps == pytest.approx(10.0) and idx == list(range(13))


def media_error(data: bytes, kind: str, match: str):
    with pytest.raises(MediaError, match=match):
        open_media(data, kind)


def test_limits_and_failures(server, tmp_path):
    f = fetcher()
    bad(f.fetch_bytes(f"{server}/big", "part[0]"), "could not fetch media URL: too large (over the 4000-byte limit")
    bad(f.fetch_bytes(f"{server}/big-chunked", "part[0]"), "too large (over the 4000-byte limit")
    bad(f.fetch_bytes(base64.b64encode(b"z" * 6000).decode(), "part[0]"), "4000-byte limit")
    bad(f.fetch_bytes(f"{server}/hop/{MAX_REDIRECTS + 1}", "part[0]"), "could not fetch media URL: too many redirects")
    bad(f.fetch_bytes(f"{server}/missing", "part[0]"), "could not fetch media URL: HTTP error")
    bad(f.fetch_bytes("not base64 at all!", "part[0]"), "not an http(s) URL")
    bad(f.fetch_bytes("data:image/png,rawdata", "part[0]"), "must be base64")
    bad(f.fetch_bytes("ftp://example.com/a.png", "part[0]"), "unsupported URL scheme")
    media_error(run(f.fetch_bytes(f"{server}/text", "part[0]")), "image", "could not decode the image")
    media_error(PNG, "video", "animated")
    media_error(b"\x00\x00\x00\x18ftypmp42" + bytes(200), "video", r"could not decode the video \(InvalidDataError\)")
    t0 = time.monotonic()
    bad(fetcher(timeout_s=1.0).fetch_bytes(f"{server}/slow", "part[0]"), "could not fetch media URL: timed out")
    assert time.monotonic() - t0 < 2.9  # the server answers after 3 s
    # nothing listens on port 9 of loopback: refused at once, and the message does not say which port
    with pytest.raises(APIError) as e:
        run(f.fetch_bytes("http://127.0.0.1:9/img.png", "part[0]"))
    assert e.value.message == "part[0]: could not fetch media URL: could not connect"
    assert run(f.fetch_bytes(f"{server}/img.png", "part[0]")) == PNG  # still healthy


def test_local_files_need_the_lever(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    bad(fetcher().fetch_bytes(f"file://{tmp_path}/a.png", "part[0]"), "local files are not allowed")
    inner = tmp_path / "allowed"
    inner.mkdir()
    bad(fetcher(local_dir=str(inner)).fetch_bytes(f"file://{inner}/../a.png", "part[0]"), "not a file under")


def test_domain_allow_list(server):
    f = fetcher(allowed_domains="127.0.0.1")
    assert run(f.fetch_bytes(f"{server}/img.png", "part[0]")) == PNG
    bad(f.fetch_bytes(f"{server}/away", "part[0]"), "domain not allowed (media_allowed_domains)")  # every hop
    bad(fetcher(allowed_domains="example.com").fetch_bytes(f"{server}/img.png", "part[0]"), "domain not allowed")


def test_loopback_denied_by_default(server):
    """The same server without media_allowed_networks: refused before connecting, by address."""
    port = server.rsplit(":", 1)[1]
    f = fetcher(allowed_networks="")
    for url in (f"{server}/img.png", f"http://localhost:{port}/img.png", f"http://[::ffff:127.0.0.1]:{port}/img.png",
                f"http://0.0.0.0:{port}/img.png", f"http://2130706433:{port}/img.png"):
        with pytest.raises(APIError) as e:
            run(f.fetch_bytes(url, "part[0]"))
        assert e.value.message == "part[0]: could not fetch media URL: address not allowed (media_allowed_networks)"


def test_every_redirect_hop_is_checked(server):
    """Loopback opened by the lever, the metadata address not: a redirect there is refused at
    its hop; a redirect back to loopback (IPv4-mapped) is followed, as the lever allows."""
    f = fetcher()
    bad(f.fetch_bytes(f"{server}/to-metadata", "part[0]"), "address not allowed (media_allowed_networks)")
    assert run(f.fetch_bytes(f"{server}/to-self", "part[0]")) == PNG
    bad(fetcher(allowed_networks="127.0.0.1/32").fetch_bytes(f"{server}/to-metadata", "part[0]"), "address not allowed")


def test_oversized_image_refused_before_decoding():
    buf = io.BytesIO()
    Image.new("1", (9000, 8000)).save(buf, "PNG")  # 72M pixels, a few kB compressed
    media_error(buf.getvalue(), "image", "9000x8000 pixels is over the 67108864-pixel limit")


def _msgs(n_images: int, n_videos: int, url: str, vurl: str) -> list:
    content = [{"type": "text", "text": "look"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for _ in range(n_images)]
    content += [{"type": "video_url", "video_url": {"url": vurl}} for _ in range(n_videos)]
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]


def test_collect_media_limits(server):
    from qv.server.media import collect_media

    found = collect_media(_msgs(20, 2, "u", "v"), 20, 2)
    assert [k for k, _, _ in found] == ["image"] * 20 + ["video"] * 2
    assert found[0] == ("image", "u", "messages[1].content[1]")
    with pytest.raises(APIError, match="at most 20 images"):
        collect_media(_msgs(21, 0, "u", "v"), 20, 2)
    with pytest.raises(APIError, match="at most 2 videos"):
        collect_media(_msgs(0, 3, "u", "v"), 20, 2)
    with pytest.raises(APIError, match="must be a URL string"):
        collect_media([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], 20, 2)
    responses_style = [{"role": "user", "content": [{"type": "input_image", "image_url": "w"}]}]
    assert collect_media(responses_style, 20, 2) == [("image", "w", "messages[0].content[0]")]


@pytest.fixture(scope="module")
def server_media(tiny_dirs):
    """The server's media stage on the tiny checkpoint's own prompt builder (the engine's)."""
    from transformers import AutoTokenizer

    from qv.config import EngineConfig, ModelConfig
    from qv.engine.multimodal import MultimodalInputs
    from qv.server.media import ServerMedia

    d = tiny_dirs("tiny")
    inputs = MultimodalInputs(d, ModelConfig.from_dir(d), AutoTokenizer.from_pretrained(d))
    return ServerMedia(EngineConfig(media_max_bytes=1 << 20, media_allowed_networks=LOOPBACK), inputs)


def test_items_end_to_end(server, server_media):
    """Fetched over loopback, header-checked, decoded and preprocessed in the decode pool: the same
    items as processing the bytes directly; raw bytes (`from_bytes`) and `load` give the same."""
    from qv.server.media import collect_media

    m = server_media
    proc = m.inputs.processor
    found = collect_media(_msgs(2, 1, f"{server}/img.png", f"{server}/anim.gif"), 20, 2)
    items = run(m.items(found))
    assert [it.kind for it in items] == ["image", "image", "video"]
    direct = proc.image(Image.open(io.BytesIO(PNG)))
    assert torch.equal(items[0].pixel_values, direct.pixel_values) and items[0].grid_thw == direct.grid_thw
    for other in (run(m.from_bytes(PNG)), run(m.load(f"{server}/img.png")),
                  run(m.load("data:image/png;base64," + base64.b64encode(PNG).decode()))):
        assert torch.equal(other.pixel_values, direct.pixel_values)
    # the video was decoded frame-selectively: same item as sampling from all its frames
    frames, fps, _ = decode_video(open_media(GIF, "video"))
    whole = proc.video(frames, fps)
    assert torch.equal(items[2].pixel_values, whole.pixel_values) and items[2].timestamps == whole.timestamps
    with pytest.raises(APIError, match=r"messages\[1\].content\[1\]: could not decode"):
        run(m.items(collect_media(_msgs(1, 0, f"{server}/text", ""), 20, 2)))
    thin = "data:image/png;base64," + base64.b64encode(png(2500, 10)).decode()
    with pytest.raises(APIError, match=r"content\[1\]: image aspect ratio 250.0 exceeds 200"):
        run(m.items(collect_media(_msgs(1, 0, thin, ""), 20, 2)))
    with pytest.raises(APIError, match=r"asset-3: could not decode the image"):
        run(m.from_bytes(b"GIF89a garbage", "asset-3"))
