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
import math
import re
from array import array
from collections.abc import AsyncIterator

import anyio
import pydantic_core
import zstandard
from starlette.requests import Request

from qv.server.errors import APIError, bad_request

DONE = b"data: [DONE]\n\n"
LARGE_BYTES = 1 << 20  # bodies from this size are parsed off the event loop and rendered on the bounded pool


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
    return (await read_json_sized(request, max_body_bytes))[0]


async def read_json_sized(request: Request, max_body_bytes: int) -> tuple[dict, int]:
    """read_json and the body's size in bytes (which decides where its work runs)."""
    raw = await read_body(request, max_body_bytes)
    if len(raw) >= LARGE_BYTES:
        return await asyncio.to_thread(parse_json, raw), len(raw)
    return parse_json(raw), len(raw)


def parse_json(raw: bytes) -> dict:
    """Strict JSON, so that nothing past here meets what Python's json would let through: a lone
    UTF-16 surrogate or invalid UTF-8 (400), nesting deeper than the parser's limit of 200 levels
    (400, never a RecursionError), NaN/Infinity literals and numbers beyond the float range (400)."""
    try:
        body = pydantic_core.from_json(raw, allow_inf_nan=False, cache_strings="keys")
    except ValueError as exc:
        why = str(exc)
        if "recursion limit" in why:
            why = f"it nests deeper than the parser's limit of 200 levels ({why})"
        elif "surrogate" in why or "hex escape" in why:
            why = f"a string holds a lone UTF-16 surrogate, which is not text ({why})"
        elif ("expected value" in why or "invalid number" in why) and re.search(rb"(NaN|Infinity)", raw):
            why = f"NaN and Infinity are not JSON numbers ({why})"
        raise bad_request(f"the request body is not valid JSON: {why}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    where = _non_finite(body)
    if where is not None:
        raise bad_request(f"{where} is a number outside the range of a 64-bit float", where or None)
    return body


def _all_int64(values: list) -> bool:
    try:
        array("q", values)
    except (TypeError, OverflowError):
        return False
    return True


def _non_finite(body: dict) -> str | None:
    """The path of the first number that parsed to ±inf (1e999), or None. Depth is bounded by the parser."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
        elif isinstance(node, list):
            if node and type(node[0]) is int and _all_int64(node):
                continue  # token-id lists, the common large case, pass at C speed
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node))
        elif type(node) is float and not math.isfinite(node):
            return path
    return None


async def read_body(request: Request, max_body_bytes: int, media_types: tuple[str, ...] = ("application/json",),
                    lever: str = "max_body_bytes") -> bytes:
    """The request body's bytes (of one of `media_types`), zstd-decoded when `Content-Encoding: zstd`;
    the checks of read_json (`lever`: what sets max_body_bytes, named in the 413)."""
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
            raise APIError(413, f"the request body is larger than {max_body_bytes} bytes ({lever}) once decompressed")
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
        try:
            return task.result()
        finally:
            task = done = None  # a raised exception must not keep this frame, and the task holding it, in a cycle
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


class SSEResponse:
    """Streams `chunks` (bytes) as text/event-stream; stops and closes the source on disconnect.

    stop: set when the server's shutdown grace runs out; the stream is then cut (its engine request
    aborted) and ends with `trailer` (the route's final error event and `[DONE]`).
    stall_timeout_s: a client that takes no chunk for this long is cut (stream_stall_timeout_s).
    on_close: called once the response is over, however it ended (releases the admission seats)."""

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict | None = None, stop: asyncio.Event | None = None,
                 trailer: bytes = b"", on_close=None, stall_timeout_s: float | None = None):
        self.chunks = chunks
        self.stall_timeout_s = stall_timeout_s
        self.stop, self.trailer, self.on_close = stop, trailer, on_close
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]
        self.headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        cut, gone, done = False, False, False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async with anyio.create_task_group() as tg:
                async def watch():
                    nonlocal gone
                    await _wait_disconnect(receive)
                    gone = True
                    tg.cancel_scope.cancel()

                async def watch_stop():
                    nonlocal cut
                    await self.stop.wait()
                    cut = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                if self.stop is not None:
                    tg.start_soon(watch_stop)
                try:
                    async for chunk in self.chunks:
                        # a client that reads nothing fills the socket's buffer and pauses this send (and the
                        # next chunk); past stall_timeout_s it is cut and its engine request aborted
                        with anyio.fail_after(self.stall_timeout_s):
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    done = True
                except (OSError, TimeoutError):  # the client went away mid-write, or stopped reading
                    gone = True
                tg.cancel_scope.cancel()
            if cut and not (gone or done):
                await self.chunks.aclose()  # abort the engine request before the trailer goes out
                with anyio.move_on_after(1.0):  # a client that reads nothing must not hold up the exit
                    await send({"type": "http.response.body", "body": self.trailer, "more_body": False})
        finally:
            try:
                await self.chunks.aclose()  # runs the source's cleanup (aborting its engine request)
            finally:
                if self.on_close is not None:
                    self.on_close()


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
