"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over qv's chat path.

The request becomes a ChatCompletionRequest (system -> a system message, tool_use -> assistant
tool_calls, tool_result -> tool messages, images -> image_url parts through qv's media path,
`thinking` -> the template's enable_thinking, tool_choice any/tool -> the call grammar), which
the chat path renders, checks and runs; the output goes back through the same reasoning and
qwen3_coder parsers as chat completions, as thinking / text / tool_use blocks, whole or as
Anthropic's event stream (message_start, content_block_start, ping, content_block_delta...,
content_block_stop, message_delta, message_stop).

`AnthropicEdge` wraps the whole app: it takes the API key from `x-api-key` (Anthropic's header) when
no Authorization header is sent, and gives every error under /v1/messages Anthropic's shape
({"type": "error", "error": {"type", "message"}}), the guards' 401/413 and the route's 400 alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qv.server.chat import render_chat, tool_parser
from qv.server.errors import APIError, bad_request, error_response, internal_error
from qv.server.openai import ChatContext, read_request, stream_response, validate_body
from qv.server.parsers import OutputStream, parse_output
from qv.server.protocol import ChatCompletionRequest
from qv.server.state import ServerState, random_id
from qv.server.streaming import last_output, sse_event, until_disconnect
from qv.server.structured import compile_constraint, constraint_field
from qv.server.anthropic_protocol import (CountTokensRequest, ImageBlock, MessagesRequest, PromptFields, TextBlock,
                                          ThinkingBlock, ThinkingDisabled, ToolResultBlock, ToolUseBlock)

log = logging.getLogger("qv.server")

PATH = "/v1/messages"
WHERE = "qv_where"  # an image part's mark: its block's place in the Anthropic request
PLACE = re.compile(r"messages\[\d+\]\.content\[\d+\]")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
NAMES = {"stop": "stop_sequences"}  # engine field -> this API's field
FORMAT = {"response_format": "output_config.format"}  # the chat field of a constraint -> this API's
TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# -- request -> chat request ---------------------------------------------------------------------

def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def _image_part(block: ImageBlock, where: str) -> dict:
    """An image_url part; `where` (the block's place in this request) is taken out by chat_messages."""
    return {"type": "image_url", "image_url": {"url": block.url()}, WHERE: where}


def _tool_result(block: ToolResultBlock, where: str) -> tuple[dict, list[dict]]:
    """A tool_result -> the tool message and the images it returned (which go to a user message after
    it: the chat template shows images in user turns)."""
    content = block.content
    if content is None or isinstance(content, str):
        text, images = content or "", []
    else:
        text = "\n".join(b.text for b in content if isinstance(b, TextBlock))
        images = [_image_part(b, f"{where}.content[{k}]") for k, b in enumerate(content) if isinstance(b, ImageBlock)]
    if block.is_error:
        text = f"Error: {text}"  # the model is told the call failed, as Anthropic's is_error means
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}, images


def _user_turn(content: list, where: str) -> list[dict]:
    """A user message's blocks -> tool messages (one per tool_result, first, as Anthropic orders
    them) and a user message with the rest."""
    out, parts = [], []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            parts.append(_text_part(block.text))
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block, f"{where}.content[{j}]"))
        elif isinstance(block, ToolResultBlock):
            tool, images = _tool_result(block, f"{where}.content[{j}]")
            out.append(tool)
            parts.extend(images)
        else:
            raise bad_request(f"{where}.content[{j}]: a `{block.type}` block belongs in an assistant message",
                              f"{where}.content[{j}]")
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_turn(content: list, where: str) -> dict:
    texts, calls, thinking = [], [], []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        else:
            raise bad_request(f"{where}.content[{j}]: a `{block.type}` block belongs in a user message",
                              f"{where}.content[{j}]")
    msg: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thinking:
        msg["reasoning"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(req: PromptFields) -> list[dict]:
    messages: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else [_text_part(b.text) for b in req.system]
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages.extend(_user_turn(m.content, where))
        else:
            messages.append(_assistant_turn(m.content, where))
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("messages hold no content", "messages")
    return messages


def image_places(messages: list[dict]) -> dict[str, str]:
    """{chat path of an image part: its path in the Anthropic request}, the marks taken out."""
    places = {}
    for i, m in enumerate(messages):
        for j, part in enumerate(m["content"] if isinstance(m.get("content"), list) else []):
            if WHERE in part:
                places[f"messages[{i}].content[{j}]"] = part.pop(WHERE)
    return places


def in_request_terms(exc: APIError, places: dict[str, str]) -> APIError:
    """A media error names the chat message's part: name the request's block instead."""
    rename = lambda text: PLACE.sub(lambda m: places.get(m.group(0), m.group(0)), text) if text else text  # noqa: E731
    return APIError(exc.status, rename(exc.message), rename(exc.param), exc.headers)


def thinking_on(req: PromptFields, default: bool) -> bool:
    """`thinking` decides (enabled or adaptive: on); without it, chat_template_kwargs or the server's
    enable_thinking lever do, which an output format turns off (its grammar holds from the first token)."""
    if req.thinking is not None:
        return not isinstance(req.thinking, ThinkingDisabled)
    return default and req.output_format is None


def to_chat_request(req: PromptFields) -> tuple[ChatCompletionRequest, dict[str, str]]:
    """The chat request, and image_places of its messages."""
    messages = chat_messages(req)
    places = image_places(messages)
    body: dict = {"messages": messages}
    if req.messages[-1].role == "assistant":  # Anthropic's prefill: the answer continues that text
        body.update(add_generation_prompt=False, continue_final_message=True)
    body["chat_template_kwargs"] = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        body["chat_template_kwargs"]["enable_thinking"] = not isinstance(req.thinking, ThinkingDisabled)
    if req.output_format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": req.output_format.json_schema}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    tc = req.tool_choice
    if tc is not None:
        body["tool_choice"] = (TOOL_CHOICE[tc.type] if tc.type != "tool"
                               else {"type": "function", "function": {"name": tc.name}})
        body["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stream=req.stream)
    return validate_body(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None}), places


async def _render(state: ServerState, request: Request, model_cls):
    """(the Anthropic request, its chat request, the rendered prompt, the media prompt or None, the
    prompt's token ids)."""
    areq, size = await read_request(state, request, model_cls)
    state.check_model(areq.model)
    req, places = to_chat_request(areq)
    max_tokens = getattr(areq, "max_tokens", None)
    check = lambda text: state.check_text(text, max_tokens, "messages")  # noqa: E731
    rendered = await state.offload(size, render_chat, state.tokenizer, req, thinking_on(areq, state.enable_thinking),
                                   check)
    if req.constraint is not None and rendered.thinking:
        raise bad_request("output_config.format needs thinking off: the format's grammar holds from the first output "
                          "token; set thinking to {\"type\": \"disabled\"}", "output_config.format")
    try:
        mm = await state.media.prompt(req.messages, rendered.token_ids)  # images fetched, checked and expanded
    except APIError as exc:
        raise in_request_terms(exc, places) from None
    return areq, req, rendered, mm, mm.token_ids if mm is not None else rendered.token_ids


async def count_tokens(state: ServerState, request: Request) -> Response:
    *_, prompt_ids = await _render(state, request, CountTokensRequest)
    return JSONResponse({"input_tokens": len(prompt_ids)})


# -- running -------------------------------------------------------------------------------------

async def create_message(state: ServerState, request: Request) -> Response:
    areq, req, rendered, mm, prompt_ids = await _render(state, request, MessagesRequest)
    state.check_capacity(1)
    grammar = await compile_constraint(state, req, FORMAT, request)
    params = state.sampling_params(req, max_tokens=areq.max_tokens, logprobs=None, names=NAMES, grammar=grammar)
    checked = state.check_request(prompt_ids, params, "messages", NAMES)
    ctx = ChatContext(req, rendered, tool_parser(req), random_id("msg", "_"), int(time.time()), state.response_model,
                      "")
    if areq.metadata is not None and areq.metadata.user_id is not None:
        log.info("request %s: metadata.user_id %s", ctx.request_id, areq.metadata.user_id)
    seats = state.admit(1)
    try:
        gen = state.generate(ctx.request_id, checked, prompt=rendered.text, multimodal=mm,
                             grammar_field=constraint_field(req, FORMAT), admission=seats)
        if areq.stream:
            stopped = state.stopped_error()
            return stream_response(state, message_events(ctx, gen), seats,
                                   sse_event("error", error_body(stopped.status, stopped.message)))
        out = await until_disconnect(request, last_output(gen))
    except BaseException:
        seats.release()
        raise
    seats.release()
    return JSONResponse(message_body(ctx, out))


def _signature(thinking: str) -> str:
    """A thinking block's signature: Anthropic's is opaque; qv's is a digest of the text (stable, so a
    streamed message equals the whole one)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def stop_reason(o, tools_called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output (a call cut by max_tokens is max_tokens)."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if tools_called:
        return "tool_use", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def usage(out, output_tokens: int) -> dict:
    """Anthropic's split: input_tokens are those not read from the cache (the prompt is their sum)."""
    prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": output_tokens}


def _envelope(ctx: ChatContext, content: list, reason: str | None, sequence: str | None, use: dict) -> dict:
    return {"id": ctx.request_id, "type": "message", "role": "assistant", "model": ctx.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": use}


def _tool_input(arguments: str) -> dict:
    return json.loads(arguments) if arguments.strip() else {}


def message_body(ctx: ChatContext, out) -> dict:
    o = out.outputs[0]
    parsed = parse_output(o.text, ctx.rendered.thinking, ctx.tools)
    calls = parsed.tool_calls if ctx.req.parallel_tool_calls else parsed.tool_calls[:1]
    content: list[dict] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": _signature(parsed.reasoning)})
    text = [{"type": "text", "text": parsed.content}] if parsed.content else []
    uses = [{"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)} for c in calls]
    forced = ctx.tools is not None and ctx.tools.forced  # its text is a call cut after those that ended
    content += uses + text if forced else text + uses
    reason, sequence = stop_reason(o, bool(calls) and not parsed.cut)
    return _envelope(ctx, content, reason, sequence, usage(out, len(o.token_ids)))


class _BlockWriter:
    """Deltas -> content_block_* events, one block open at a time, indexed in order; a ping follows
    the first block's start."""

    def __init__(self):
        self.index = -1
        self.open: dict | None = None  # {"type", "text"}
        self.pinged = False

    def _start(self, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = {"type": block["type"], "text": ""}
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block}))
        if not self.pinged:
            self.pinged = True
            out.append(sse_event("ping", {"type": "ping"}))
        return out

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        o, self.open = self.open, None
        if o is None:
            return []
        out = []
        if o["type"] == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature(o["text"])}))
        out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def text(self, kind: str, text: str) -> list[bytes]:
        empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                                  "text": ""}
        out = [] if self.open is not None and self.open["type"] == kind else self._start(empty)
        self.open["text"] += text
        key = "thinking" if kind == "thinking" else "text"
        return out + [self._delta({"type": f"{key}_delta", key: text})]

    def call(self, tc: dict) -> list[bytes]:
        out = []
        if "id" in tc:
            out += self._start({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": {}})
        args = tc["function"].get("arguments", "")
        if args:
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out


async def message_events(ctx: ChatContext, gen):
    stream = OutputStream(ctx.rendered.thinking, ctx.tools)
    w = _BlockWriter()
    seen, started, out = "", False, None
    try:
        async for out in gen:
            o = out.outputs[0]
            if not started:  # with the first output, which knows the cached share of the prompt
                started = True
                yield sse_event("message_start", {"type": "message_start",
                                                  "message": _envelope(ctx, [], None, None, usage(out, 0))})
            pieces = [stream.feed(o.text[len(seen):])]
            seen = o.text
            if o.finish_reason is not None:
                pieces.append(stream.finish())
            for p in pieces:
                for ev in (w.text("thinking", p.reasoning) if p.reasoning else []):
                    yield ev
                for ev in (w.text("text", p.content) if p.content else []):
                    yield ev
                for tc in p.tool_calls:
                    if tc["index"] == 0 or ctx.req.parallel_tool_calls:
                        for ev in w.call(tc):
                            yield ev
            if out.finished:
                break
        for ev in w.close():
            yield ev
        if not w.pinged:
            yield sse_event("ping", {"type": "ping"})
        o = out.outputs[0]
        reason, sequence = stop_reason(o, stream.tools_called and not stream.cut)
        yield sse_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": usage(out, len(o.token_ids))})
        yield sse_event("message_stop", {"type": "message_stop"})
    except APIError as exc:
        yield sse_event("error", error_body(exc.status, exc.message))
    except Exception as exc:  # noqa: BLE001 - a bug must still end the stream with an error event
        err = internal_error("internal error while streaming", ctx.request_id, exc)
        yield sse_event("error", error_body(500, err.message))
    finally:
        await gen.aclose()


# -- the edge: x-api-key, Anthropic's error shape ------------------------------------------------

class AnthropicEdge:
    """Outermost ASGI layer. `x-api-key: K` counts as `Authorization: Bearer K` when no Authorization
    header is sent (on every route, so Anthropic clients pass the same guard). Under /v1/messages,
    a JSON error in qv's OpenAI shape, whoever answered it, is sent in Anthropic's shape (its message
    led by the `param` it named, which that shape has no field for)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        names = [k.lower() for k, _ in headers]
        if scope["path"] in (PATH, PATH + "/count_tokens"):
            send = _ErrorReshaper(send)
        if names.count(b"x-api-key") > 1:  # as two Authorization headers: a proxy in front may read the other
            return await error_response(400, "the request has more than one x-api-key header",
                                        headers={"Connection": "close"})(scope, receive, send)
        if b"x-api-key" in names and b"authorization" not in names:
            key = headers[names.index(b"x-api-key")][1]
            scope = dict(scope, headers=list(headers) + [(b"authorization", b"Bearer " + key)])
        return await self.app(scope, receive, send)


class _ErrorReshaper:
    """A send channel that holds back an error response's JSON body and sends it reshaped."""

    def __init__(self, send):
        self.send = send
        self.start: dict | None = None  # the held http.response.start of an error
        self.body = b""

    async def __call__(self, message):
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self.start = message
            return
        if self.start is None or message["type"] != "http.response.body":
            return await self.send(message)
        self.body += message.get("body", b"")
        if message.get("more_body", False):
            return
        status = self.start["status"]
        try:
            err = json.loads(self.body)["error"]
            message, param = (err.get("message"), err.get("param")) if isinstance(err, dict) else (str(err), None)
            if param and param not in message:  # Anthropic's body has no `param`: the message names it
                message = f"{param}: {message}"
            body = json.dumps(error_body(status, message)).encode()
        except (ValueError, KeyError, TypeError):
            body = json.dumps(error_body(status, self.body.decode("utf-8", "replace") or f"HTTP {status}")).encode()
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                         b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await self.send(dict(self.start, headers=headers))
        await self.send({"type": "http.response.body", "body": body})


__all__ = ["AnthropicEdge", "count_tokens", "create_message", "to_chat_request"]
