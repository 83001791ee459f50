"""The Responses API's stored responses: `store` keeps a response (and the conversation that led to
it) in a bounded in-memory store, so that `previous_response_id` can continue the conversation,
`GET /v1/responses/{id}` retrieve it, `DELETE` remove it and, for a `background` response,
`POST /v1/responses/{id}/cancel` stop it while it runs; `GET /v1/responses/{id}/input_items` lists
the items that led to it.

The store holds at most responses_store_bytes (the sizes are estimates: the request body's bytes,
the output's text and the conversation carried over); past it the oldest finished responses are
dropped first. It lives in this process only: a restart, or another replica, knows none of them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.server.errors import APIError, bad_request

log = logging.getLogger("qv.server")

ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
ENTRY_OVERHEAD_BYTES = 1024  # the envelope's fixed fields, the dict and list objects around them
RUNNING = ("queued", "in_progress")


@dataclass
class StoredResponse:
    response: dict  # the response object as retrieve answers it (its status changes while it runs)
    conversation: list[dict]  # the input items that led to it, oldest first (earlier turns included)
    size: int  # estimated bytes
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response's run

    @property
    def running(self) -> bool:
        return self.response["status"] in RUNNING


class ResponseStore:
    """Stored responses by id, oldest first; at most `max_bytes` of them (0: nothing is stored)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, response_id: str) -> StoredResponse | None:
        return self.entries.get(response_id)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store (or replace) an entry, dropping the oldest finished ones past the bound; False when it
        alone is larger than the whole store (then it is not kept)."""
        self.delete(response_id)
        if entry.size > self.max_bytes:
            log.warning("response %s (about %d bytes) is larger than the whole store (responses_store_bytes %d): "
                        "not stored", response_id, entry.size, self.max_bytes)
            return False
        self.entries[response_id] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes:  # the oldest finished first (running ones are few, and skipped)
            old_id = next((k for k, e in self.entries.items() if not e.running and k != response_id), None)
            if old_id is None:
                break
            self.delete(old_id)
        return True

    def delete(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def cancel_all(self) -> None:
        """Shutdown: stop every background response still running."""
        for entry in self.entries.values():
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param)


def stored_or_404(store: ResponseStore, response_id: str, param: str | None = None) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id, param)
    return entry


def history(store: ResponseStore, previous_response_id: str | None) -> tuple[list[dict], int]:
    """The items `previous_response_id` continues from (its conversation, then its output) and their
    estimated size; ([], 0) without one."""
    if previous_response_id is None:
        return [], 0
    prev = stored_or_404(store, previous_response_id, "previous_response_id")
    if prev.running:
        raise bad_request(f"previous response {previous_response_id} is still {prev.response['status']}: continue "
                          "from it once it has finished", "previous_response_id")
    return prev.conversation + prev.response["output"], prev.size


def stored_item(item: dict) -> dict:
    """An input item as the store keeps it and input_items lists it: with an id, and a message's text
    content as a list of parts (OpenAI's item shapes)."""
    kind = item.get("type", "message")
    out = dict(item, type=kind)
    out.setdefault("id", f"{ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}")  # state.random_id's form
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    return out


def output_size(response: dict) -> int:
    """The estimated bytes of a response's output items (their text)."""
    n = 0
    for item in response.get("output") or []:
        n += len(item.get("arguments", "")) + sum(len(p.get("text", "")) for p in item.get("content") or [])
    return n


# -- routes ------------------------------------------------------------------------------------------

def _query_refusals(request: Request) -> None:
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request("stream: qv does not stream stored responses again; retrieve the whole response", "stream")
    if "starting_after" in request.query_params:
        raise bad_request("starting_after: qv does not stream stored responses again", "starting_after")


async def retrieve_response(state, request: Request) -> Response:
    """GET /v1/responses/{response_id}: the stored response as it stands (a background one while it runs)."""
    _query_refusals(request)
    entry = stored_or_404(state.responses, request.path_params["response_id"])
    return JSONResponse(entry.response)


MAX_LIST_LIMIT = 100


async def list_input_items(state, request: Request) -> Response:
    """GET /v1/responses/{response_id}/input_items: the items that led to the response (earlier turns
    included), OpenAI's cursor list: `order` desc (default) or asc, `limit` 1-100 (20), `after` an item id."""
    entry = stored_or_404(state.responses, request.path_params["response_id"])
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order!r}", "order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    items = entry.conversation if order == "asc" else entry.conversation[::-1]
    after = q.get("after")
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in response {request.path_params['response_id']}",
                              "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def delete_response(state, request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: forget it (a background one still running is cancelled first)."""
    response_id = request.path_params["response_id"]
    entry = stored_or_404(state.responses, response_id)
    if entry.task is not None and not entry.task.done():
        entry.task.cancel()
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(state, request: Request) -> Response:
    """POST /v1/responses/{response_id}/cancel: stop a background response that is queued or running
    (its engine request is aborted); answers the response, now `cancelled`."""
    response_id = request.path_params["response_id"]
    entry = stored_or_404(state.responses, response_id)
    if entry.task is None:
        raise bad_request("Cannot cancel a synchronous response.")
    if entry.running:
        entry.response["status"] = "cancelled"
        entry.task.cancel()
        try:
            await asyncio.shield(entry.task)
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - its outcome is the status set above
            pass
    elif entry.response["status"] != "cancelled":
        raise bad_request(f"response {response_id} is {entry.response['status']}: only a queued or in-progress "
                          "background response can be cancelled")
    return JSONResponse(entry.response)
