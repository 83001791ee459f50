"""The bytes of one media source: an http(s) URL (qv/server/safe_fetch.py: the address policy,
the domain allow-list, redirects), a data URL, bare base64, or a file:// URL under the
`media_local_dir` lever. Every failure is a 400 naming the part, so a bad source never costs more
than its own request. Fetch failures read "could not fetch media URL: <cause class>".

Limits: `media_max_bytes` per item (checked on Content-Length, while streaming, and on base64
before it is decoded), one overall `media_timeout_s` per URL (resolving, connecting, redirects and
the body together), at most MAX_REDIRECTS redirects. Large base64 payloads and local files are
decoded / read in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlsplit

from qv.server.errors import bad_request
from qv.server.safe_fetch import MAX_REDIRECTS, FetchError, Resolver, SafeFetcher, resolve

__all__ = ["MAX_REDIRECTS", "MediaFetcher"]
THREAD_BYTES = 1 << 16  # base64 longer than this is decoded in a worker thread


class MediaFetcher:
    def __init__(self, max_bytes: int, timeout_s: float, allowed_domains: str = "", local_dir: str = "",
                 allowed_networks: str = "", resolver: Resolver = resolve):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.http = SafeFetcher(max_bytes, timeout_s, allowed_domains, allowed_networks, resolver)
        self.local_dir = Path(local_dir).resolve() if local_dir else None

    async def fetch_bytes(self, url: str, where: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}: the media URL must be a non-empty string", where)
        if url.startswith("data:"):
            return await self._data_url(url, where)
        scheme = urlsplit(url).scheme.lower() if "://" in url[:16] else ""
        if scheme in ("http", "https"):
            try:
                return await self.http.get(url)
            except FetchError as exc:
                raise bad_request(f"{where}: could not fetch media URL: {exc}", where) from None
        if scheme == "file":
            return await asyncio.to_thread(self._local, url, where)
        if scheme:
            raise bad_request(f"{where}: unsupported URL scheme {scheme!r} (http, https, data or base64)", where)
        return await self._base64(url, where)

    def check_size(self, n: int, where: str) -> None:
        if n > self.max_bytes:
            raise bad_request(f"{where}: media is larger than the {self.max_bytes}-byte limit (media_max_bytes)", where)

    async def _base64(self, text: str, where: str) -> bytes:
        self.check_size(len(text) * 3 // 4 - 2, where)  # before decoding: the decoded size, give or take padding
        data = await asyncio.to_thread(_b64decode, text) if len(text) > THREAD_BYTES else _b64decode(text)
        if data is None:
            raise bad_request(f"{where}: not an http(s) URL, a data URL or base64 data", where)
        self.check_size(len(data), where)
        return data

    async def _data_url(self, url: str, where: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise bad_request(f"{where}: data URLs must be base64 (data:<type>;base64,<data>)", where)
        return await self._base64(payload, where)

    def _local(self, url: str, where: str) -> bytes:
        if self.local_dir is None:
            raise bad_request(f"{where}: local files are not allowed (set the media_local_dir lever)", where)
        path = Path(unquote(urlsplit(url).path)).resolve()
        if not path.is_relative_to(self.local_dir) or not path.is_file():
            raise bad_request(f"{where}: {_short(url)} is not a file under the allowed media directory", where)
        self.check_size(path.stat().st_size, where)
        return path.read_bytes()


def _b64decode(text: str) -> bytes | None:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
