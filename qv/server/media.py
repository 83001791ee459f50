"""Media in requests: the one table of content-part types (`check_media_part`, `collect_media`),
and `ServerMedia`, which turns sources into the engine's VisionItems and MultimodalPrompt.

Chat completions take `image_url` (and the Responses-style `input_image`) and `video_url` parts:
http(s) URLs, data URLs or bare base64, fetched by qv/server/media_fetch.py under the media_*
levers. The chat template renders one placeholder per part; the placeholders are expanded to
the items' vision tokens after rendering.

A request's media goes through three stages, each failure a 400 naming the part:
1. fetch every source concurrently (async: nothing waits on the event loop);
2. read every header (qv.engine.media.open_media; MP4/WebM through PyAV with their frame count,
   refused past `media_max_video_frames`) and refuse the request when its pixels in all pass
   `media_max_pixels`: a bomb, a pile of huge images or a long 4K video is refused before
   anything is decoded;
3. decode and preprocess item by item in a small pool of worker threads shared by all requests
   (`media_decode_threads`), so decoding never runs on the event loop and at most that many
   decoded images are held at once; a video's decoding stops past `media_video_decode_timeout_s`.

Clef and other callers with their own request shapes use `items`, `load` and `from_bytes`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from qv.config import EngineConfig
from qv.engine.media import MediaError, OpenedMedia, VideoLimits
from qv.errors import InvalidRequestError
from qv.server.errors import bad_request
from qv.server.media_fetch import MediaFetcher

IMAGE_PARTS = ("image_url", "image", "input_image", "image_pil", "image_embeds")
VIDEO_PARTS = ("video_url", "video")
AUDIO_PARTS = ("input_audio", "audio_url", "audio")
FILE_PARTS = ("file", "input_file")
TAKEN = {"image_url": "image", "input_image": "image", "video_url": "video"}  # part type -> placeholder kind
URL_KEY = {"image_url": "image_url", "input_image": "image_url", "video_url": "video_url"}  # where the URL sits

Source = str | bytes  # a URL, data URL or base64 text; or the media file's bytes


def check_media_part(part: dict, where: str) -> dict | None:
    """The chat template's placeholder part ({"type": "image"} or {"type": "video"}) for a media
    part qv takes; the 400 for one it cannot take; None for anything that is not media."""
    kind = part.get("type")
    if kind in TAKEN:
        return {"type": TAKEN[kind]}
    if kind in IMAGE_PARTS:
        raise bad_request(f"image parts of type {kind!r} are not supported: send an 'image_url' part (an http(s) "
                          "URL, a data URL or base64 data)", where)
    if kind in VIDEO_PARTS:
        raise bad_request(f"video parts of type {kind!r} are not supported: send a 'video_url' part", where)
    if kind in AUDIO_PARTS:
        raise bad_request("audio is not supported: this server takes text, image and video content parts", where)
    if kind in FILE_PARTS:
        raise bad_request("file inputs are not supported: this server takes text, image and video content parts", where)
    return None


def part_url(part: dict, where: str) -> str:
    """OpenAI's {"image_url": {"url": ...}} or {"image_url": "..."} (Responses' input_image), same for video."""
    key = URL_KEY[part["type"]]
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
            if kind in TAKEN:
                where = f"messages[{i}].content[{j}]"
                found.append((TAKEN[kind], part_url(part, where), where))
    n_img = sum(1 for k, _, _ in found if k == "image")
    n_vid = len(found) - n_img
    if n_img > max_images:
        raise bad_request(f"at most {max_images} images per request (media_max_images); got {n_img}", "messages")
    if n_vid > max_videos:
        raise bad_request(f"at most {max_videos} videos per request (media_max_videos); got {n_vid}", "messages")
    return found


def _trimmer():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _trimmer()


def _return_free_memory() -> None:
    """Hand a decoded image's freed pages back to the OS: glibc keeps freed blocks of tens of MB
    in the worker thread's arena otherwise, and the process's memory would ratchet up with every
    large image."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


async def _all(coros: list):
    """Await all; the first failure cancels the rest (nothing keeps fetching for a refused request)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class ServerMedia:
    """The media levers, the fetcher, the decode pool, and the engine's prompt builder (`inputs`,
    qv.engine.multimodal.MultimodalInputs; None for a text-only model)."""

    def __init__(self, cfg: EngineConfig, inputs, off_reason: str | None = None):
        self.inputs = inputs
        # why a request with media gets a 400 (the engine's media_off)
        self.off_reason = off_reason or "it has no vision tower, or media_max_images and media_max_videos are 0"
        self.max_images, self.max_videos = cfg.media_max_images, cfg.media_max_videos
        self.max_pixels = cfg.media_max_pixels
        self.video_limits = VideoLimits(cfg.media_max_video_frames, cfg.media_video_decode_timeout_s)
        self.fetcher = MediaFetcher(cfg.media_max_bytes, cfg.media_timeout_s, cfg.media_allowed_domains,
                                    cfg.media_local_dir, cfg.media_allowed_networks)
        self.pool = ThreadPoolExecutor(cfg.media_decode_threads, thread_name_prefix="qv-media")

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def _bytes(self, source: Source, where: str) -> bytes:
        if isinstance(source, (bytes, bytearray, memoryview)):
            self.fetcher.check_size(len(source), where)
            return bytes(source)
        return await self.fetcher.fetch_bytes(source, where)

    def _open(self, data: bytes, kind: str, where: str) -> OpenedMedia:
        try:
            return self.inputs.open(data, kind, self.video_limits)
        except MediaError as exc:
            raise bad_request(f"{where}: {exc}", where) from None

    def _open_all(self, blobs: list[bytes], found: Sequence[tuple[str, Source, str]], param: str) -> list[OpenedMedia]:
        opened: list[OpenedMedia] = []
        try:
            for data, (kind, _, where) in zip(blobs, found):
                opened.append(self._open(data, kind, where))
            total = sum(o.pixels for o in opened)
            if total > self.max_pixels:
                raise bad_request(f"the request's images and video frames have {total} pixels in all, over the "
                                  f"{self.max_pixels}-pixel limit of one request (media_max_pixels); nothing was "
                                  "decoded", param)
        except BaseException:
            for o in opened:
                o.close()
            raise
        return opened

    def _item(self, opened: OpenedMedia, where: str):
        try:
            return self.inputs.item(opened)
        except MediaError as exc:
            raise bad_request(f"{where}: {exc}", where) from None
        finally:
            _return_free_memory()

    async def items(self, found: Sequence[tuple[str, Source, str]], param: str = "messages") -> list:
        """VisionItems of (kind, source, where) entries, in order; kind "image" or "video", where the
        part's name in errors, `param` the name of the whole in the pixel-budget error."""
        if not found:
            return []
        if self.inputs is None:
            raise bad_request(f"this model takes no images or videos: {self.off_reason}", found[0][2])
        blobs = await _all([self._bytes(src, where) for _, src, where in found])
        opened = await self._in_pool(self._open_all, blobs, found, param)
        del blobs  # each OpenedMedia holds its own bytes
        items: list = []
        waiting = list(zip(opened, [where for _, _, where in found]))
        try:
            while waiting:  # one at a time: a request holds one decoded image at most
                o, where = waiting.pop(0)
                items.append(await self._in_pool(self._item, o, where))
        finally:
            for o, _ in waiting:
                o.close()
        return items

    async def load(self, source: Source, where: str = "image", kind: str = "image"):
        """One VisionItem from a URL, data URL, base64 text or raw bytes (400 naming `where`)."""
        return (await self.items([(kind, source, where)], where))[0]

    async def from_bytes(self, data: bytes, where: str = "image", kind: str = "image"):
        """One VisionItem from a media file's bytes (e.g. a multipart part)."""
        return await self.load(bytes(data), where, kind)

    async def prompt(self, messages, prompt_ids: list[int]):
        """The MultimodalPrompt of a chat whose rendered prompt is `prompt_ids` (one placeholder
        per media part), or None when it has no media. Every failure is a 400."""
        dicts = [{"content": m.content} if not isinstance(m, dict) else m for m in messages]
        found = collect_media(dicts, self.max_images, self.max_videos)
        if not found:
            return None
        items = await self.items(found)
        try:
            return await self._in_pool(self.inputs.prompt, prompt_ids, items)
        except InvalidRequestError as exc:
            raise bad_request(f"the rendered prompt does not match the request's media: {exc}", "messages") from None
