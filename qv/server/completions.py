"""POST /v1/completions: string, string-list, token-id and token-id-list prompts; n samples per
prompt (choice index = prompt index * n + sample index); logprobs; echo (with logprobs, the prompt
tokens' logprobs come first, as vLLM's); vLLM's prompt_logprobs; SSE streaming."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from qv.engine.request_check import CheckedRequest
from qv.server.errors import APIError, bad_request, internal_error, sse_error
from qv.server.logprobs import (completion_logprobs, echo_logprobs, joined, prompt_logprobs_field,
                                prompt_logprobs_json)
from qv.server.openai import read_request, stream_response, usage
from qv.server.protocol import CompletionRequest
from qv.server.state import ServerState, request_id_of
from qv.server.structured import compile_constraint, constraint_field
from qv.server.streaming import DONE, merge, sse, until_disconnect


def _items(state: ServerState, req: CompletionRequest) -> list:
    """The prompts of a request (a string, token ids, or a list of either), at most max_prompts_per_request."""
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if len(items) > state.max_prompts:
        raise bad_request(f"{len(items)} prompts in one request; this server takes at most {state.max_prompts} "
                          "(max_prompts_per_request)", "prompt")
    return items


def _prompts(state: ServerState, req: CompletionRequest, items: list, params) -> list[tuple[str, CheckedRequest]]:
    """(text, checked request) per prompt, each checked by the engine; token-id prompts are decoded for echo.
    Runs off the event loop (tokenizing)."""
    out = []
    for k, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{k}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where} is empty", where)
            if not req.truncate_prompt_tokens:
                state.check_text(item, req.max_tokens, where)
            ids = state.encode(item, req.add_special_tokens)
        else:
            ids = list(item)
        if req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens:]
        checked = state.check_request(ids, params, where)
        out.append((item if isinstance(item, str) else state.decode(ids), checked))
    return out


async def create_completion(state: ServerState, request: Request) -> Response:
    req, size = await read_request(state, request, CompletionRequest)
    state.check_model(req.model)
    state.resolve_request_fields(req)
    state.check_logprobs(req.logprobs, "logprobs")
    items = _items(state, req)
    state.check_capacity(len(items) * req.n)  # the whole request at once, before the work
    grammar = await compile_constraint(state, req, request=request)
    params = state.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=(
        prompt_logprobs_field(state, req.prompt_logprobs, req.logprobs if req.echo else None)), grammar=grammar)
    prompts = await state.offload(size, _prompts, state, req, items, params)
    rid, created = request_id_of(request, req, "cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.response_model}
    seats = state.admit(len(prompts) * req.n)
    try:
        gens = [state.generate(f"{rid}-{k}", checked, prompt=text, cache_salt=req.cache_salt, admission=seats,
                               grammar_field=constraint_field(req), priority=req.priority)
                for k, (text, checked) in enumerate(prompts)]
        if req.stream:
            trailer = sse_error(state.stopped_error()) + DONE
            return stream_response(state, completion_stream(state, req, head, prompts, gens), seats, trailer)

        async def run_all():
            outs: dict[int, object] = {}
            async for k, out in merge(gens):
                outs[k] = out
            return [outs[k] for k in range(len(gens))]

        try:
            finals = await until_disconnect(request, run_all())
        finally:
            for g in gens:
                await g.aclose()
    except BaseException:
        seats.release()
        raise
    seats.release()
    per_token = 1 + (req.logprobs or 0)
    entries = sum(len(o.token_ids) for f in finals for o in f.outputs) * per_token
    if params.prompt_logprobs is not None:
        entries += sum(len(f.prompt_token_ids) for f in finals) * (1 + params.prompt_logprobs)
    return await state.json_response(entries, lambda: completion_response(state, req, head, prompts, finals))


def _echo_logprobs(state: ServerState, req: CompletionRequest, out) -> dict:
    """The echoed prompt's part of `logprobs` (its prompt logprobs are in once the first token is)."""
    if out.prompt_logprobs is None:
        raise APIError(500, f"request {out.request_id}: prompt logprobs missing when its first token came (a qv bug)")
    return echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.logprobs, state.tokenizer,
                         req.return_tokens_as_token_ids)


def completion_response(state: ServerState, req: CompletionRequest, head: dict, prompts, finals) -> dict:
    choices, n_prompt, n_out, cached = [], 0, 0, 0
    for k, out in enumerate(finals):
        text_prefix = prompts[k][0] if req.echo else ""
        n_prompt += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        for o in out.outputs:
            n_out += len(o.token_ids)
            choice = {"index": k * req.n + o.index, "text": text_prefix + o.text, "logprobs": None,
                      "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
            if req.logprobs is not None:
                choice["logprobs"] = completion_logprobs(o.token_ids, o.logprobs or [], req.logprobs, state.tokenizer,
                                                         len(text_prefix), req.return_tokens_as_token_ids,
                                                         state.special_ids if req.skip_special_tokens else frozenset())
                if req.echo:
                    choice["logprobs"] = joined(_echo_logprobs(state, req, out), choice["logprobs"])
            if out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(o.token_ids)
            choices.append(choice)
    return dict(head, choices=choices, usage=usage(n_prompt, n_out, cached))


async def completion_stream(state: ServerState, req: CompletionRequest, head: dict, prompts, gens):
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)
    seen_text: dict[int, str] = {}
    seen_tokens: dict[int, int] = {}
    done: set[int] = set()
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    stream = merge(gens)

    def current_usage():
        return usage(sum(prompt_tokens.values()), sum(seen_tokens.values()), sum(cached.values()))

    try:
        async for k, out in stream:
            prompt_tokens[k], cached[k] = len(out.prompt_token_ids), out.num_cached_tokens
            for o in out.outputs:
                idx = k * req.n + o.index
                if idx in done:
                    continue
                first = idx not in seen_text
                if first and req.echo and req.logprobs is not None and out.prompt_logprobs is None and \
                        o.finish_reason is None:
                    continue  # sample 0 computes the prompt's logprobs; this sample's echo waits for them
                prev_text, prev_n = seen_text.get(idx, ""), seen_tokens.get(idx, 0)
                seen_text[idx], seen_tokens[idx] = o.text, len(o.token_ids)
                new_text, new_ids = o.text[len(prev_text):], o.token_ids[prev_n:]
                echo = prompts[k][0] if (first and req.echo) else ""
                show_tokens = bool(new_ids) and (req.logprobs is not None or req.return_token_ids)
                if not (new_text or echo or o.finish_reason or show_tokens):
                    continue  # text held back (partial character or stop string): nothing to send yet
                choice = {"index": idx, "text": echo + new_text, "logprobs": None, "finish_reason": o.finish_reason,
                          "stop_reason": o.stop_reason}
                if req.logprobs is not None and new_ids:
                    offset = len(prompts[k][0]) * req.echo + len(prev_text)
                    choice["logprobs"] = completion_logprobs(new_ids, (o.logprobs or [])[prev_n:], req.logprobs,
                                                             state.tokenizer, offset, req.return_tokens_as_token_ids,
                                                             state.special_ids if req.skip_special_tokens else frozenset())
                    if echo:
                        choice["logprobs"] = joined(_echo_logprobs(state, req, out), choice["logprobs"])
                if req.return_token_ids:
                    choice["token_ids"] = list(new_ids)
                    if first:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                if o.finish_reason is not None:
                    done.add(idx)
                body = dict(head, choices=[choice])
                if continuous:
                    body["usage"] = current_usage()
                yield sse(body)
        if include_usage:
            yield sse(dict(head, choices=[], usage=current_usage()))
    except APIError as exc:
        yield sse_error(exc)
    except Exception as exc:  # noqa: BLE001 - a bug must still end the stream with an error event
        yield sse_error(internal_error("internal error while streaming", head["id"], exc))
    finally:
        await stream.aclose()
        for g in gens:
            await g.aclose()
    yield DONE
