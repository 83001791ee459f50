"""Non-text content parts: which media qv takes (`check_media_part`), and the media of a chat
request turned into the engine's MultimodalPrompt (`ServerMedia.prompt`).

Chat completions take `image_url` (and the Responses-style `input_image`) and `video_url` parts:
http(s) URLs, data URLs or bare base64, fetched by qv/server/media_fetch.py under the media_*
levers. The chat template renders one placeholder per part; the placeholders are expanded to
the items' vision tokens after rendering.
"""

from __future__ import annotations

import asyncio

from qv.config import EngineConfig
from qv.engine.request import InvalidRequestError
from qv.server.errors import bad_request
from qv.server.media_fetch import MediaFetcher, collect_media, load_media

IMAGE_PARTS = ("image_url", "image", "input_image", "image_pil", "image_embeds")
VIDEO_PARTS = ("video_url", "video")
AUDIO_PARTS = ("input_audio", "audio_url", "audio")
FILE_PARTS = ("file", "input_file")
TAKEN = {"image_url": "image", "input_image": "image", "video_url": "video"}  # part type -> placeholder kind


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


class ServerMedia:
    """The media levers, the fetcher, and the engine's prompt builder (None: a text-only model)."""

    def __init__(self, cfg: EngineConfig, inputs):
        self.inputs = inputs  # qv.engine.multimodal.MultimodalInputs or None
        self.max_images, self.max_videos = cfg.media_max_images, cfg.media_max_videos
        self.fetcher = MediaFetcher(cfg.media_max_bytes, cfg.media_timeout_s, cfg.media_allowed_domains,
                                    cfg.media_local_dir)

    async def prompt(self, messages, prompt_ids: list[int]):
        """The MultimodalPrompt of a chat whose rendered prompt is `prompt_ids` (one placeholder
        per media part), or None when it has no media. Every failure is a 400."""
        dicts = [{"content": m.content} if not isinstance(m, dict) else m for m in messages]
        found = collect_media(dicts, self.max_images, self.max_videos)
        if not found:
            return None
        if self.inputs is None:
            raise bad_request("this model takes no images or videos (it has no vision tower, or media_max_images "
                              "and media_max_videos are 0)", found[0][2])
        items = await load_media(found, self.fetcher, self.inputs.processor)
        try:
            return await asyncio.to_thread(self.inputs.prompt, prompt_ids, items)
        except InvalidRequestError as exc:
            raise bad_request(f"the rendered prompt does not match the request's media: {exc}", "messages") from None
