"""Non-text content parts. qv's server does not take media yet; this is the one place that decides,
so the vision work replaces `check_media_part` (and nothing else) when images land."""

from __future__ import annotations

from qv.server.errors import bad_request

IMAGE_PARTS = ("image_url", "image", "input_image", "image_pil", "image_embeds")
VIDEO_PARTS = ("video_url", "video")
AUDIO_PARTS = ("input_audio", "audio_url", "audio")
FILE_PARTS = ("file", "input_file")


def check_media_part(part: dict, where: str) -> None:
    """Raise the 400 for a media content part qv cannot take; return for anything else."""
    kind = part.get("type")
    if kind in IMAGE_PARTS:
        raise bad_request("images are not supported yet: this server takes text content parts only", where)
    if kind in VIDEO_PARTS:
        raise bad_request("videos are not supported yet: this server takes text content parts only", where)
    if kind in AUDIO_PARTS:
        raise bad_request("audio is not supported: this server takes text content parts only", where)
    if kind in FILE_PARTS:
        raise bad_request("file inputs are not supported: this server takes text content parts only", where)
