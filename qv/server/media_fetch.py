"""Fetching the media of chat content parts: http(s) URLs, data URLs, bare base64, and local
files only under the `media_local_dir` lever. Every failure is a 400 naming the part, so a bad
image never costs more than its own request.

Limits: `media_max_bytes` per item (checked on Content-Length and while streaming), one overall
`media_timeout_s` per item (connect, redirects and body together), at most MAX_REDIRECTS
redirects, each hop's host checked against `media_allowed_domains`, decoded images at most
MAX_IMAGE_PIXELS (checked from the header, before decoding).

Videos: qv has no video-file decoder dependency, so a video is an animated image (GIF, WebP,
APNG) decoded with Pillow into frames plus the frame rate from its frame durations; other
containers get a clear 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from qv.server.errors import APIError, bad_request

MAX_REDIRECTS = 5
MAX_IMAGE_PIXELS = 1 << 26  # 67M pixels: far past what the processor keeps, short of a decompression bomb
MAX_VIDEO_FRAMES = 4096


class MediaFetcher:
    def __init__(self, max_bytes: int, timeout_s: float, allowed_domains: str = "", local_dir: str = ""):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.allowed = {d.strip().lower().strip(".") for d in allowed_domains.split(",") if d.strip()}
        self.local_dir = Path(local_dir).resolve() if local_dir else None

    # -- bytes ---------------------------------------------------------------------------------
    async def fetch_bytes(self, url: str, where: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}: the media URL must be a non-empty string", where)
        if url.startswith("data:"):
            return self._data_url(url, where)
        scheme = urlsplit(url).scheme.lower() if "://" in url[:16] else ""
        if scheme in ("http", "https"):
            try:
                return await asyncio.wait_for(self._http(url, where), self.timeout_s)
            except asyncio.TimeoutError:
                raise bad_request(f"{where}: fetching {_short(url)} took longer than {self.timeout_s:g} s", where) from None
        if scheme == "file":
            return self._local(url, where)
        if scheme:
            raise bad_request(f"{where}: unsupported URL scheme {scheme!r} (http, https, data or base64)", where)
        return self._base64(url, where)

    def _check_size(self, n: int, where: str) -> None:
        if n > self.max_bytes:
            raise bad_request(f"{where}: media is larger than the {self.max_bytes}-byte limit", where)

    def _base64(self, text: str, where: str) -> bytes:
        self._check_size(len(text) * 3 // 4 - 2, where)  # before decoding: the decoded size, give or take padding
        try:
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}: not an http(s) URL, a data URL or base64 data", where) from None
        self._check_size(len(data), where)
        return data

    def _data_url(self, url: str, where: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise bad_request(f"{where}: data URLs must be base64 (data:<type>;base64,<data>)", where)
        return self._base64(payload, where)

    def _local(self, url: str, where: str) -> bytes:
        if self.local_dir is None:
            raise bad_request(f"{where}: local files are not allowed (set the media_local_dir lever)", where)
        path = Path(unquote(urlsplit(url).path)).resolve()
        if not path.is_relative_to(self.local_dir) or not path.is_file():
            raise bad_request(f"{where}: {_short(url)} is not a file under the allowed media directory", where)
        self._check_size(path.stat().st_size, where)
        return path.read_bytes()

    def _check_host(self, url: str, where: str) -> None:
        host = (urlsplit(url).hostname or "").lower()
        if self.allowed and not any(host == d or host.endswith("." + d) for d in self.allowed):
            raise bad_request(f"{where}: media from {host!r} is not allowed (media_allowed_domains)", where)

    async def _http(self, url: str, where: str) -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_host(url, where)
                try:
                    async with client.stream("GET", url) as resp:
                        if resp.is_redirect:
                            url = urljoin(url, resp.headers.get("location", ""))
                            continue
                        if resp.status_code != 200:
                            raise bad_request(f"{where}: fetching {_short(url)} gave HTTP {resp.status_code}", where)
                        self._check_size(int(resp.headers.get("content-length") or 0), where)
                        body = bytearray()
                        async for chunk in resp.aiter_bytes():
                            body += chunk
                            self._check_size(len(body), where)
                        return bytes(body)
                except httpx.HTTPError as e:
                    raise bad_request(f"{where}: could not fetch {_short(url)}: {type(e).__name__}", where) from None
        raise bad_request(f"{where}: more than {MAX_REDIRECTS} redirects fetching the media", where)

    # -- decoded media -------------------------------------------------------------------------
    async def image(self, url: str, where: str):
        """A decoded PIL image."""
        return decode_image(await self.fetch_bytes(url, where), where)

    async def video(self, url: str, where: str, pick=None):
        """(frames, fps, indices): RGB PIL frames of one size, the source frame rate, and which
        source frames they are (see decode_video)."""
        return decode_video(await self.fetch_bytes(url, where), where, pick)


def _open(data: bytes, where: str, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise bad_request(f"{where}: could not decode the {what} ({type(e).__name__})", where) from None
    if im.width * im.height > MAX_IMAGE_PIXELS:
        raise bad_request(f"{where}: {what} of {im.width}x{im.height} pixels is over the {MAX_IMAGE_PIXELS} limit", where)
    return im


def decode_image(data: bytes, where: str):
    im = _open(data, where, "image")
    try:
        im.load()
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt pixel data
        raise bad_request(f"{where}: could not decode the image ({type(e).__name__})", where) from None
    return im


def decode_video(data: bytes, where: str, pick=None):
    """(frames, fps, indices) of an animated image: `pick(total_frames, fps)` chooses which frames
    to decode (all when None), so a long video is never held whole; fps None when the file
    gives no frame durations."""
    try:
        im = _open(data, where, "video")
    except APIError as e:
        if "pixels is over" in e.message:
            raise
        raise bad_request(f"{where}: could not decode the video: qv reads animated GIF, WebP or PNG "
                          "(no MP4/WebM decoder is installed)", where) from None
    n = getattr(im, "n_frames", 1)
    if not getattr(im, "is_animated", False) or n < 2:
        raise bad_request(f"{where}: videos must be animated GIF, WebP or PNG (qv has no video-file decoder)", where)
    if n > MAX_VIDEO_FRAMES:
        raise bad_request(f"{where}: video has {n} frames, over the {MAX_VIDEO_FRAMES} limit", where)
    try:
        total_ms = 0.0
        for i in range(n):  # durations only: seeking decodes nothing to RGB
            im.seek(i)
            total_ms += float(im.info.get("duration") or 0)
        fps = 1000.0 * n / total_ms if total_ms > 0 else None
        indices = list(range(n)) if pick is None else [int(i) for i in pick(n, fps)]
        frames = []
        for i in indices:
            im.seek(i)
            frames.append(im.convert("RGB"))
    except (OSError, ValueError, EOFError) as e:
        raise bad_request(f"{where}: could not decode the video ({type(e).__name__})", where) from None
    return frames, fps, indices


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


# ---------------------------------------------------------------------------------------------
# chat messages -> media items
# ---------------------------------------------------------------------------------------------

_IMAGE_TYPES = ("image_url", "input_image")
_VIDEO_TYPES = ("video_url",)


def _part_url(part: dict, where: str) -> str:
    """OpenAI's {"image_url": {"url": ...}} or {"image_url": "..."} (Responses' input_image), same for video."""
    key = "video_url" if part.get("type") in _VIDEO_TYPES else "image_url"
    ref = part.get(key)
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.{key} must be a URL string or an object with a 'url' string", f"{where}.{key}")
    return url


def collect_media(messages: list, max_images: int, max_videos: int) -> list[tuple[str, str, str]]:
    """(kind, url, where) of every image/video part, in the order the chat template renders
    their placeholders; more than `max_images` images or `max_videos` videos is a 400."""
    found: list[tuple[str, str, str]] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_TYPES or kind in _VIDEO_TYPES:
                where = f"messages[{i}].content[{j}]"
                found.append(("image" if kind in _IMAGE_TYPES else "video", _part_url(part, where), where))
    n_img = sum(1 for k, _, _ in found if k == "image")
    n_vid = len(found) - n_img
    if n_img > max_images:
        raise bad_request(f"at most {max_images} images per request (media_max_images); got {n_img}", "messages")
    if n_vid > max_videos:
        raise bad_request(f"at most {max_videos} videos per request (media_max_videos); got {n_vid}", "messages")
    return found


async def load_media(found: list[tuple[str, str, str]], fetcher: MediaFetcher, processor) -> list:
    """Fetch every part concurrently, then preprocess (a qv VisionProcessor) off the event loop;
    returns VisionItems in prompt order. Processor refusals (e.g. aspect ratio) become 400s."""
    from qv.model.vision_processor import MediaError

    def pick(n: int, fps: float | None):  # decode only the frames the processor keeps
        return processor.sample_indices(n, 24.0 if fps is None else fps)

    decoded = await asyncio.gather(*[fetcher.image(url, where) if kind == "image" else fetcher.video(url, where, pick)
                                     for kind, url, where in found])

    def run():
        items = []
        for (kind, _, where), media in zip(found, decoded):
            try:
                items.append(processor.image(media) if kind == "image" else processor.video(*media))
            except MediaError as e:
                raise bad_request(f"{where}: {e}", where) from None
        return items

    return await asyncio.to_thread(run)
