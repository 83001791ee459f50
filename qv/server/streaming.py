"""HTTP plumbing shared by the endpoints: JSON bodies, server-sent events, and client disconnects.

A client that goes away must stop its request at once (and free its KV blocks and GDN slot). The
engine aborts a request when its output iterator is closed, so every path here makes sure the
iterator is closed on disconnect:
- `SSEResponse` watches the ASGI receive channel while it streams and cancels the stream when
  `http.disconnect` arrives (Starlette's StreamingResponse only notices on the next write under
  ASGI 2.4, which for a queued request may be never).
- `until_disconnect` does the same for non-streaming requests, which would otherwise run to the
  end for nobody.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import anyio
import zstandard
from starlette.requests import Request

from qv.server.errors import APIError, bad_request

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(event: str, obj: dict) -> bytes:
    """Responses API framing: `event: <type>` then the data line."""
    return b"event: " + event.encode() + b"\n" + sse(obj)


class ClientDisconnected(Exception):
    pass


async def read_json(request: Request, max_body_bytes: int) -> dict:
    """The request body as a JSON object; 400 for a wrong content type or bad JSON, 413 when the
    (decompressed) body is over the limit. zstd bodies are accepted (the TypeSafe SDK sends them)."""
    raw = await read_body(request, max_body_bytes)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def read_body(request: Request, max_body_bytes: int, media_types: tuple[str, ...] = ("application/json",)) -> bytes:
    """The request body's bytes (of one of `media_types`), zstd-decoded when `Content-Encoding: zstd`;
    the checks of read_json."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in media_types:
        raise bad_request(f"Unsupported Media Type: Only {' or '.join(repr(m) for m in media_types)} is allowed")
    raw = await request.body()
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding == "zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=max_body_bytes + 1)
        except zstandard.ZstdError as exc:
            raise bad_request(f"the zstd request body could not be decompressed: {exc}") from None
        if len(raw) > max_body_bytes:
            raise APIError(413, f"the request body is larger than {max_body_bytes} bytes once decompressed")
    elif encoding not in ("", "identity"):
        raise bad_request(f"unsupported Content-Encoding {encoding!r}: send identity or zstd")
    return raw


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (closing any engine iterators it
    holds, which aborts their requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


class SSEResponse:
    """Streams `chunks` (bytes) as text/event-stream; stops and closes the source on disconnect."""

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict | None = None):
        self.chunks = chunks
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]
        self.headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        try:
            async with anyio.create_task_group() as tg:
                async def watch():
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    async for chunk in self.chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away mid-write
                    pass
                tg.cancel_scope.cancel()
        finally:
            await self.chunks.aclose()  # runs the source's cleanup (aborting its engine request)


async def last_output(gen):
    """Drain an engine output iterator; returns the final (cumulative) output."""
    last = None
    async for out in gen:
        last = out
    return last


async def merge(gens: list) -> AsyncIterator[tuple[int, object]]:
    """Interleave several engine iterators as (k, output); closing this closes all of them."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k, gen):
        try:
            async for out in gen:
                await queue.put((k, out))
            await queue.put((k, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((k, exc))
        finally:
            await gen.aclose()

    tasks = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
