"""POST /v1/chat/completions: render, validate, run, then answer as one JSON body or as SSE chunks
in vLLM's order (role chunk with the first output, content/reasoning/tool_calls deltas, a final
chunk per choice with finish_reason, an optional usage chunk with `choices: []`, `[DONE]`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from qv.server.chat import RenderedPrompt, render_chat, tool_parser
from qv.server.errors import APIError, internal_error, sse_error, validation_error
from qv.server.logprobs import chat_logprobs, prompt_logprobs_field, prompt_logprobs_json
from qv.server.parsers import OutputStream, Qwen3CoderToolParser, parse_output
from qv.server.protocol import ChatCompletionRequest
from qv.server.state import ServerState, request_id_of
from qv.server.streaming import DONE, LARGE_BYTES, SSEResponse, last_output, read_json_sized, sse, until_disconnect
from qv.server.structured import check_not_thinking, compile_constraint, constraint_field


def validate_body(model_cls, body: dict):
    """A parsed JSON body -> the request model; pydantic's errors as one 400."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def read_request(state: ServerState, request: Request, model_cls):
    """(request model, body size): the body read, parsed and validated, off the loop when large."""
    body, size = await read_json_sized(request, state.max_body_bytes)
    if size < LARGE_BYTES:
        return validate_body(model_cls, body), size
    return await state.offload(size, validate_body, model_cls, body), size


def stream_response(state: ServerState, chunks, admission, trailer: bytes) -> SSEResponse:
    """SSE for a request in flight: cut at the end of the shutdown grace with `trailer`, its seats
    released however it ends."""
    return SSEResponse(chunks, stop=state.stopping, trailer=trailer, on_close=admission.release,
                       stall_timeout_s=state.stream_stall_timeout_s)


@dataclass
class ChatContext:
    req: ChatCompletionRequest
    rendered: RenderedPrompt
    tools: Qwen3CoderToolParser | None  # None: tool calls are not parsed (no tools, or tool_choice none)
    request_id: str
    created: int
    model: str
    echo_text: str  # vLLM's chat echo: the final message's text when it continues that role

    def finish_reason(self, reason: str | None, tools_called: bool) -> str | None:
        return "tool_calls" if tools_called and reason == "stop" else reason


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req, size = await read_request(state, request, ChatCompletionRequest)
    state.check_model(req.model)
    state.resolve_request_fields(req)
    state.check_logprobs(req.top_logprobs, "top_logprobs")
    max_tokens = req.max_output_tokens
    names = {"logprobs": "top_logprobs", "max_tokens": req.max_tokens_param}
    # vLLM's extra field; streamed chats never show it (vLLM's), so it is not computed for them
    prompt_lps = None if req.stream else prompt_logprobs_field(state, req.prompt_logprobs)
    state.check_capacity(req.n)  # before the work; admit() below holds the seats
    grammar = await compile_constraint(state, req, request=request)
    params = state.sampling_params(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                   names=names, prompt_logprobs=prompt_lps, grammar=grammar)
    check = None if req.truncate_prompt_tokens else (lambda text: state.check_text(text, max_tokens, "messages"))
    thinking = state.enable_thinking and req.constraint is None  # a grammar applies from the first token
    rendered = await state.offload(size, render_chat, state.tokenizer, req, thinking, check,
                                   state.trust_request_chat_template)
    check_not_thinking(rendered, req)
    mm = await state.media.prompt(req.messages, rendered.token_ids)  # images/videos fetched and expanded
    prompt_ids = mm.token_ids if mm is not None else rendered.token_ids
    checked = state.check_request(prompt_ids, params, "messages", names)
    last = req.messages[-1]
    echo = (last.content if isinstance(last.content, str) else "") if req.echo and last.role == "assistant" else ""
    ctx = ChatContext(req, rendered, tool_parser(req), request_id_of(request, req, "chatcmpl"), int(time.time()),
                      state.response_model, echo)
    seats = state.admit(req.n)
    try:
        gen = state.generate(ctx.request_id, checked, prompt=rendered.text, cache_salt=req.cache_salt,
                             grammar_field=constraint_field(req), priority=req.priority,
                             multimodal=mm, admission=seats)
        if req.stream:
            return stream_response(state, chat_stream(state, ctx, gen), seats, sse_error(state.stopped_error()) + DONE)
        final = await until_disconnect(request, last_output(gen))
    except BaseException:
        seats.release()
        raise
    seats.release()
    entries = sum(len(o.token_ids) for o in final.outputs) * (1 + (req.top_logprobs or 0) if req.logprobs else 1)
    entries += len(final.prompt_token_ids) * (1 + (prompt_lps or 0)) if prompt_lps is not None else 0
    return await state.json_response(entries, lambda: chat_response(state, ctx, final))


def chat_response(state: ServerState, ctx: ChatContext, out) -> dict:
    req, choices = ctx.req, []
    for o in out.outputs:
        parsed = parse_output(o.text, ctx.rendered.thinking, ctx.tools)
        calls = parsed.tool_calls if req.parallel_tool_calls else parsed.tool_calls[:1]
        content = parsed.content
        if ctx.echo_text:
            content = ctx.echo_text + (content or "")
        message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
        if req.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = parsed.reasoning
        choice = {"index": o.index, "message": message, "logprobs": None,
                  "finish_reason": ctx.finish_reason(o.finish_reason, bool(calls) and not parsed.cut),
                  "stop_reason": o.stop_reason}
        if req.logprobs:
            choice["logprobs"] = chat_logprobs(o.token_ids, o.logprobs or [], req.top_logprobs or 0, state.tokenizer,
                                               req.return_tokens_as_token_ids)
        if req.return_token_ids:
            choice["token_ids"] = list(o.token_ids)
        choices.append(choice)
    body = {"id": ctx.request_id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
            "choices": choices, "usage": usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs),
                                               out.num_cached_tokens)}
    if req.return_token_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return body


class _ChoiceState:
    def __init__(self, ctx: ChatContext):
        self.stream = OutputStream(ctx.rendered.thinking, ctx.tools)
        self.text = ""
        self.n_tokens = 0
        self.finished = False


def _delta(ctx: ChatContext, pieces) -> dict:
    delta: dict = {}
    if pieces.reasoning and ctx.req.include_reasoning:
        delta["reasoning"] = delta["reasoning_content"] = pieces.reasoning
    if pieces.content:
        delta["content"] = pieces.content
    calls = [c for c in pieces.tool_calls if ctx.req.parallel_tool_calls or c["index"] == 0]
    if calls:
        delta["tool_calls"] = calls
    return delta


async def chat_stream(state: ServerState, ctx: ChatContext, gen):
    req = ctx.req
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)
    choices = [_ChoiceState(ctx) for _ in range(req.n)]
    head = {"id": ctx.request_id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model}
    prompt_tokens, cached, started = 0, 0, False

    def chunk(choice_list, usage_obj=None):
        body = dict(head, choices=choice_list)
        if usage_obj is not None:
            body["usage"] = usage_obj
        return sse(body)

    def running_usage():
        return usage(prompt_tokens, sum(c.n_tokens for c in choices), cached) if continuous else None

    try:
        async for out in gen:
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            if not started:  # the role chunk goes out with the first output, not before (TTFT)
                started = True
                for i in range(len(choices)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    body = dict(head, choices=[first])
                    if req.return_token_ids:
                        body["prompt_token_ids"] = list(out.prompt_token_ids)
                    yield sse(body)
                    if ctx.echo_text:
                        yield chunk([{"index": i, "delta": {"content": ctx.echo_text}, "logprobs": None,
                                      "finish_reason": None}])
            for o in out.outputs:
                c = choices[o.index]
                if c.finished:
                    continue
                new_text, c.text = o.text[len(c.text):], o.text
                new_ids = o.token_ids[c.n_tokens:]
                new_lps = (o.logprobs or [])[c.n_tokens:]
                c.n_tokens = len(o.token_ids)
                pieces = c.stream.feed(new_text)
                if o.finish_reason is not None:
                    c.finished = True
                    tail = c.stream.finish()
                    pieces.reasoning += tail.reasoning
                    pieces.content += tail.content
                    pieces.tool_calls += tail.tool_calls
                delta = _delta(ctx, pieces)
                show_tokens = bool(new_ids) and (req.logprobs or req.return_token_ids)
                if not delta and o.finish_reason is None and not show_tokens:
                    continue  # text held back (partial character, stop string or tag): nothing to send yet
                choice = {"index": o.index, "delta": delta, "logprobs": None,
                          "finish_reason": ctx.finish_reason(o.finish_reason, c.stream.tools_called and not c.stream.cut)}
                if o.finish_reason is not None:
                    choice["stop_reason"] = o.stop_reason
                if req.logprobs and new_ids:
                    choice["logprobs"] = chat_logprobs(new_ids, new_lps, req.top_logprobs or 0, state.tokenizer,
                                                       req.return_tokens_as_token_ids)
                if req.return_token_ids:
                    choice["token_ids"] = list(new_ids)
                yield chunk([choice], running_usage())
            if out.finished:
                break
        if include_usage:
            yield chunk([], usage(prompt_tokens, sum(c.n_tokens for c in choices), cached))
    except APIError as exc:
        yield sse_error(exc)
    except Exception as exc:  # noqa: BLE001 - a bug must still end the stream with an error event
        yield sse_error(internal_error("internal error while streaming", ctx.request_id, exc))
    finally:
        await gen.aclose()
    yield DONE
