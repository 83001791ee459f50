"""POST /v1/responses (OpenAI Responses API): the input items (after those of the conversation
`previous_response_id` continues) become chat messages, the chat path renders and runs them, and
the output comes back as reasoning / message / function_call items, whole or as the documented event
stream (`event:` + `data:` lines, response.created ... response.completed; no `[DONE]`), or at once
as a `queued` background response to retrieve later. With `store` (the default while the store has
room: responses_store_bytes) the response is kept for retrieve, cancel, delete and
`previous_response_id` (qv/server/responses_store.py)."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.server.chat import content_text, render_chat, tool_parser
from qv.server.errors import APIError, bad_request, internal_error
from qv.server.openai import ChatContext, read_request, stream_response, validate_body
from qv.server.parsers import OutputStream, parse_output
from qv.server.protocol import ChatCompletionRequest, ResponsesRequest
from qv.server.responses_store import ENTRY_OVERHEAD_BYTES, StoredResponse, history, output_size, stored_item
from qv.server.state import ServerState, random_id
from qv.server.structured import check_not_thinking, compile_constraint, constraint_field
from qv.server.streaming import DONE, last_output, sse_event, until_disconnect

ROLES = ("user", "system", "developer", "assistant")


def _parts_text(content, where: str) -> str | None:
    """Responses content parts (input_text/output_text/input_image...) -> text."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    return content_text([p if isinstance(p, dict) else {"type": None} for p in content], where)


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string input is one user message)."""
    return [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def input_messages(req: ResponsesRequest, earlier: list[dict] = ()) -> list[dict]:
    """Input items, after the `earlier` items of the conversation continued, -> chat messages
    (function_call items join the assistant turn they follow). The request's instructions come first;
    those of earlier responses are not carried over (OpenAI's rule)."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [*earlier, *input_items(req)]
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
            msg = {"role": role, "content": _parts_text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise bad_request(f"{where} needs a string `name` and string `arguments`", where)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            elif messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning": reasoning} if reasoning is not None else {})})
                reasoning = None
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text or ""})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise bad_request(f"{where} has unsupported item type {kind!r}", f"{where}.type")
    if not messages:
        raise bad_request("input holds no messages", "input")
    return messages


def to_chat_request(req: ResponsesRequest, earlier: list[dict] = ()) -> ChatCompletionRequest:
    tc = req.tool_choice
    body = {
        "messages": input_messages(req, earlier), "priority": req.priority, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty, "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls, "chat_template_kwargs": req.chat_template_kwargs,
        "cache_salt": req.cache_salt, "reasoning_effort": (req.reasoning or {}).get("effort"),
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.parameters}} for t in req.tools] if req.tools else None,
        "tool_choice": tc if isinstance(tc, str) or tc is None else {"type": "function", "function": {"name": tc.name}},
    }
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":  # Responses flattens chat's json_schema object into format
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return validate_body(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def _usage(state: ServerState, out, reasoning: str | None) -> dict:
    n_out = sum(len(o.token_ids) for o in out.outputs)
    n_reason = len(state.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {"input_tokens": len(out.prompt_token_ids), "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(n_reason, n_out)},
            "total_tokens": len(out.prompt_token_ids) + n_out}


def _envelope(ctx: ChatContext, req: ResponsesRequest, status: str, output: list, usage: dict | None,
              reason: str | None = None) -> dict:
    return {"id": ctx.request_id, "object": "response", "created_at": ctx.created, "status": status,
            "model": ctx.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": reason} if reason else None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(), "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": {"type": "text"}}, "reasoning": req.reasoning, "metadata": req.metadata or {},
            "store": bool(req.store), "truncation": req.truncation or "disabled",
            "previous_response_id": req.previous_response_id, "user": req.user, "background": bool(req.background)}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _store_flag(state: ServerState, rreq: ResponsesRequest) -> bool:
    """Whether this response is stored: the request's `store`, by default whether the store is on."""
    if rreq.store is None:
        return state.responses.enabled
    if rreq.store and not state.responses.enabled:
        raise bad_request("store: this server keeps no responses (responses_store_bytes is 0); send store=false",
                          "store")
    return rreq.store


async def create_response(state: ServerState, request: Request) -> Response:
    rreq, size = await read_request(state, request, ResponsesRequest)
    state.check_model(rreq.model)
    state.check_priority(rreq)
    rreq.store = _store_flag(state, rreq)
    if rreq.background and not rreq.store:
        raise bad_request("background responses are stored: they need store=true", "background")
    earlier, earlier_size = history(state.responses, rreq.previous_response_id)
    response_id = rreq.request_id or random_id("resp", "_")
    if state.responses.get(response_id) is not None:
        raise bad_request(f"request_id {response_id!r} is the id of a stored response already", "request_id")
    req = to_chat_request(rreq, earlier)
    names = {"max_tokens": "max_output_tokens"}
    state.check_capacity(1)
    grammar = await compile_constraint(state, req, {"response_format": "text.format"}, request)
    params = state.sampling_params(req, max_tokens=req.max_output_tokens, logprobs=None, names=names, grammar=grammar)
    check = lambda text: state.check_text(text, req.max_output_tokens, "input")  # noqa: E731
    thinking = state.enable_thinking and req.constraint is None  # a grammar applies from the first token
    rendered = await state.offload(size, render_chat, state.tokenizer, req, thinking, check)
    check_not_thinking(rendered, req)
    checked = state.check_request(rendered.token_ids, params, "input", names)
    ctx = ChatContext(req, rendered, tool_parser(req), response_id, int(time.time()), state.response_model, "")
    conversation = [*earlier, *map(stored_item, input_items(rreq))]
    base_size = size + earlier_size + ENTRY_OVERHEAD_BYTES

    def keep(body: dict) -> None:
        if rreq.store:
            state.responses.put(response_id, StoredResponse(body, conversation, base_size + output_size(body)))

    seats = state.admit(1)
    try:
        gen = state.generate(ctx.request_id, checked, prompt=rendered.text,
                             grammar_field=constraint_field(req, {"response_format": "text.format"}),
                             cache_salt=req.cache_salt, admission=seats, priority=rreq.priority)
        if rreq.background:
            return _start_background(state, ctx, rreq, gen, seats, conversation, base_size)
        if rreq.stream:
            stopped = state.stopped_error()
            trailer = sse_event("error", {"type": "error", "code": str(stopped.status), "message": stopped.message,
                                          "param": None}) + DONE
            return stream_response(state, response_events(state, ctx, rreq, gen, keep), seats, trailer)
        out = await until_disconnect(request, last_output(gen))
    except BaseException:
        seats.release()
        raise
    seats.release()
    body = _final_response(state, ctx, rreq, out)
    keep(body)
    return JSONResponse(body)


def _final_response(state: ServerState, ctx: ChatContext, rreq: ResponsesRequest, out) -> dict:
    """The finished response object of the engine's last output."""
    o = out.outputs[0]
    parsed = parse_output(o.text, ctx.rendered.thinking, ctx.tools)
    calls = parsed.tool_calls if ctx.req.parallel_tool_calls else parsed.tool_calls[:1]
    items = []
    if parsed.reasoning:
        items.append(_reasoning_item(random_id("rs", "_"), parsed.reasoning))
    message = [_message_item(random_id("msg", "_"), parsed.content)] if (
        parsed.content is not None and (parsed.content or not calls)) else []
    call_items = [_call_item(random_id("fc", "_"), c.id, c.name, c.arguments) for c in calls]
    forced = ctx.tools is not None and ctx.tools.forced  # its text is a call cut after those that ended
    items += call_items + message if forced else message + call_items
    incomplete = o.finish_reason == "length"
    if incomplete and items:  # OpenAI's: the item max_output_tokens cut is incomplete, those before it completed
        items[-1]["status"] = "incomplete"
    return _envelope(ctx, rreq, "incomplete" if incomplete else "completed", items,
                     _usage(state, out, parsed.reasoning), "max_output_tokens" if incomplete else None)


def _start_background(state: ServerState, ctx: ChatContext, rreq: ResponsesRequest, gen, seats,
                      conversation: list[dict], base_size: int) -> Response:
    """Store the response `queued`, run it as a task of its own (retrieve shows it as it stands,
    cancel stops it) and answer at once."""
    entry = StoredResponse(_envelope(ctx, rreq, "queued", [], None), conversation, base_size)
    state.responses.put(ctx.request_id, entry)

    async def run() -> None:
        out = None
        try:
            async for out in gen:
                entry.response["status"] = "in_progress"
            entry.response = _final_response(state, ctx, rreq, out)
            entry.size = base_size + output_size(entry.response)
        except asyncio.CancelledError:  # cancel (or delete, or shutdown): its engine request is aborted below
            entry.response["status"] = "cancelled"
        except APIError as exc:
            entry.response.update(status="failed", error={"code": str(exc.status), "message": exc.message})
        except Exception as exc:  # noqa: BLE001 - a bug fails this response, not the server
            err = internal_error("internal error in a background response", ctx.request_id, exc)
            entry.response.update(status="failed", error={"code": "500", "message": err.message})
        finally:
            await gen.aclose()
            if state.responses.get(ctx.request_id) is entry:  # re-counted at its final size (not if deleted)
                state.responses.put(ctx.request_id, entry)

    entry.task = asyncio.ensure_future(run())
    entry.task.add_done_callback(lambda _: seats.release())  # also when cancelled before it began
    return JSONResponse(entry.response)


class _EventWriter:
    """Turns reasoning/content/tool-call deltas into Responses events, opening and closing output
    items in order (reasoning, then the message, then each function call)."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []  # finished items, in output order
        self.open: dict | None = None  # {"kind", "id", "text", ...}

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, body)

    def _start(self, kind: str, **extra):
        out = list(self.close())
        idx = len(self.items)
        self.open = {"kind": kind, "index": idx, "text": "", **extra}
        if kind == "reasoning":
            self.open["id"] = random_id("rs", "_")
            out.append(self.event("response.output_item.added", output_index=idx,
                                  item=_reasoning_item(self.open["id"], "", "in_progress")))
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=idx,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        elif kind == "message":
            self.open["id"] = random_id("msg", "_")
            out.append(self.event("response.output_item.added", output_index=idx,
                                  item=_message_item(self.open["id"], None, "in_progress")))
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        else:
            self.open["id"] = random_id("fc", "_")
            out.append(self.event("response.output_item.added", output_index=idx, item=_call_item(
                self.open["id"], extra["call_id"], extra["name"], "", "in_progress")))
        return out

    def close(self, status: str = "completed"):
        """Ends the open item; `status` incomplete when max_output_tokens cut it (OpenAI's item status)."""
        o, self.open = self.open, None
        if o is None:
            return []
        idx, text = o["index"], o["text"]
        if o["kind"] == "reasoning":
            item = _reasoning_item(o["id"], text, status)
            evs = [self.event("response.reasoning_text.done", item_id=o["id"], output_index=idx, content_index=0,
                              text=text),
                   self.event("response.content_part.done", item_id=o["id"], output_index=idx, content_index=0,
                              part={"type": "reasoning_text", "text": text})]
        elif o["kind"] == "message":
            item = _message_item(o["id"], text, status)
            part = item["content"][0]
            evs = [self.event("response.output_text.done", item_id=o["id"], output_index=idx, content_index=0,
                              text=text, logprobs=[]),
                   self.event("response.content_part.done", item_id=o["id"], output_index=idx, content_index=0,
                              part=part)]
        else:
            item = _call_item(o["id"], o["call_id"], o["name"], text, status)
            evs = [self.event("response.function_call_arguments.done", item_id=o["id"], output_index=idx,
                              arguments=text, name=o["name"])]
        self.items.append(item)
        return evs + [self.event("response.output_item.done", output_index=idx, item=item)]

    def text(self, kind: str, delta: str):
        out = [] if self.open and self.open["kind"] == kind else self._start(kind)
        self.open["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self.event(name, item_id=self.open["id"], output_index=self.open["index"], content_index=0,
                                 delta=delta, **extra)]

    def call(self, tc: dict):
        out = []
        if "id" in tc:
            out += self._start("call", call_id=tc["id"], name=tc["function"]["name"])
        args = tc["function"].get("arguments", "")
        if args:
            self.open["text"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=self.open["index"], delta=args))
        return out


async def response_events(state: ServerState, ctx: ChatContext, rreq: ResponsesRequest, gen, keep=None):
    """The event stream; `keep(response)` stores the final response (store)."""
    w = _EventWriter()
    yield w.event("response.created", response=_envelope(ctx, rreq, "in_progress", [], None))
    yield w.event("response.in_progress", response=_envelope(ctx, rreq, "in_progress", [], None))
    stream = OutputStream(ctx.rendered.thinking, ctx.tools)
    seen, reasoning, out = "", "", None
    try:
        pending = []
        async for out in gen:
            o = out.outputs[0]
            pending.append(stream.feed(o.text[len(seen):]))
            seen = o.text
            if o.finish_reason is not None:
                pending.append(stream.finish())
            for p in pending:
                reasoning += p.reasoning
                if p.reasoning:
                    for ev in w.text("reasoning", p.reasoning):
                        yield ev
                if p.content:
                    for ev in w.text("message", p.content):
                        yield ev
                for tc in p.tool_calls:
                    if tc["index"] > 0 and not ctx.req.parallel_tool_calls:
                        continue
                    for ev in w.call(tc):
                        yield ev
            pending = []
            if out.finished:
                break
        incomplete = out is not None and out.outputs[0].finish_reason == "length"
        for ev in w.close("incomplete" if incomplete else "completed"):
            yield ev
        final = _envelope(ctx, rreq, "incomplete" if incomplete else "completed", w.items,
                          _usage(state, out, reasoning) if out is not None else None,
                          "max_output_tokens" if incomplete else None)
        if keep is not None:
            keep(final)
        yield w.event("response.incomplete" if incomplete else "response.completed", response=final)
    except APIError as exc:
        yield w.event("error", code=str(exc.status), message=exc.message, param=exc.param)
    except Exception as exc:  # noqa: BLE001 - a bug must still end the stream with an error event
        err = internal_error("internal error while streaming", ctx.request_id, exc)
        yield w.event("error", code="500", message=err.message, param=None)
    finally:
        await gen.aclose()
