"""Chat messages -> prompt, through the checkpoint's own chat template (transformers'
`apply_chat_template`), the way vLLM renders them.

- Content parts: text parts are joined with "\\n" (vLLM's "string" content format, which every
  template understands); media parts go to `media.check_media_part`, and a message with images or
  videos reaches the template as its parts list (text parts and one image/video placeholder part
  each, in order; the template concatenates them).
- `developer` messages render as `system` (the Qwen3.5 template knows no developer role).
- Assistant `tool_calls[].function.arguments` arrive as JSON strings and are parsed to dicts,
  since Qwen3.5 templates iterate `arguments.items()`. Reasoning is accepted as `reasoning` or
  `reasoning_content` and passed to the template under both names.
- `chat_template_kwargs` override the server default `enable_thinking` lever;
  `reasoning_effort: "none"` also turns thinking off.
- tool_choice `required`/named: the output is held to the tool-call grammar from its first token
  (server/structured.py, parsers/qwen3_coder_grammar.py), so an open think block is closed in the
  prompt first (the call goes out without reasoning). A call max_tokens cuts is text, not a call:
  the content, beside the calls that ended before it, finish_reason `length`, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
import pydantic_core

from qv.server.errors import bad_request
from qv.server.media import check_media_part
from qv.server.parsers.qwen3_coder import Qwen3CoderToolParser
from qv.server.parsers.qwen3_reasoning import THINK_END, THINK_START

TEXT_PARTS = ("text", "input_text", "output_text")
RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                   "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                   "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


@dataclass
class RenderedPrompt:
    text: str  # the prompt as rendered
    token_ids: list[int]
    thinking: bool  # the output starts inside an open think block


def content_text(content, where: str, allow_media: bool = False) -> str | list[dict] | None:
    """Text parts joined with "\n". With allow_media (chat completions), content holding images or
    videos becomes the parts list the template renders their placeholders from, in order:
    [{"type": "text", "text": ...}, {"type": "image"}, ...]."""
    if content is None or isinstance(content, str):
        return content
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            placeholder = check_media_part(part, f"{where}[{j}]")
            if placeholder is None:
                raise bad_request(f"{where}[{j}] has unknown content part type {kind!r}; expected 'text'",
                                  f"{where}[{j}].type")
            if not allow_media:
                raise bad_request(f"{where}[{j}]: images and videos are taken by /v1/chat/completions only",
                                  f"{where}[{j}]")
            parts.append(placeholder)
            continue
        parts.append({"type": "text", "text": texts[-1]})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _tool_call_arguments(args, where: str) -> dict:
    if isinstance(args, dict):
        return args
    try:  # pydantic's parser: nesting past its limit is a ValueError, never a RecursionError
        parsed = pydantic_core.from_json(args) if args.strip() else {}
    except ValueError as exc:
        raise bad_request(f"{where} is not valid JSON: {exc}", where) from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where} must be a JSON object, got {type(parsed).__name__}", where)
    return parsed


def build_conversation(messages) -> list[dict]:
    """Validated ChatMessage models -> the dicts the chat template reads."""
    conv = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        text = content_text(m.content, f"{where}.content", allow_media=True)
        if text is None and m.role != "assistant":
            raise bad_request(f"{where}.content is required for role '{m.role}'", f"{where}.content")
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            d["name"] = m.name
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                d["reasoning_content"] = d["reasoning"] = reasoning
            if m.tool_calls:
                d["tool_calls"] = [
                    {"id": tc.id, "type": "function", "function": {
                        "name": tc.function.name,
                        "arguments": _tool_call_arguments(tc.function.arguments, f"{where}.tool_calls[{k}].function.arguments")}}
                    for k, tc in enumerate(m.tool_calls)]
        elif m.tool_calls:
            raise bad_request(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        conv.append(d)
    return conv


def template_kwargs(req_kwargs: dict | None, default_thinking: bool, reasoning_effort: str | None) -> dict:
    kwargs = {"enable_thinking": default_thinking}
    if reasoning_effort == "none":
        kwargs["enable_thinking"] = False
    elif reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    bad = sorted(set(req_kwargs or {}) & RESERVED_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}: use the request fields instead",
                          "chat_template_kwargs")
    kwargs.update(req_kwargs or {})
    return kwargs


def apply_template(tokenizer, conversation: list[dict], *, tools: list[dict] | None, documents=None,
                   chat_template: str | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, kwargs: dict | None = None,
                   trust_template: bool = False) -> str:
    """trust_template: a request's own `chat_template` is rendered (transformers' Jinja sandbox, on
    the caller's worker thread) rather than refused: vLLM's --trust-request-chat-template."""
    if chat_template is not None and not trust_template:
        raise bad_request("Refused request with untrusted chat template: this server renders chats with the "
                          "checkpoint's own template; a request's `chat_template` needs the server started with "
                          "--trust-request-chat-template 1 (QV_TRUST_REQUEST_CHAT_TEMPLATE)", "chat_template")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be an assistant message", "messages")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **(kwargs or {}))
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise bad_request("the chat template did not render to text", "messages")
    return text


def output_starts_thinking(prompt: str, enable_thinking: bool) -> bool:
    """Whether generated text begins as reasoning: the prompt leaves a think block open; for
    templates without think tags, the enable_thinking setting decides (vLLM's default)."""
    start, end = prompt.rfind(THINK_START), prompt.rfind(THINK_END)
    if start == -1 and end == -1:
        return enable_thinking
    return start > end


def forces_call(tool_choice, tools) -> bool:
    """tool_choice `required` or a named function, with tools (vLLM: `required` with none means none)."""
    return bool(tools) and tool_choice is not None and tool_choice not in ("none", "auto")


def tool_parser(req) -> Qwen3CoderToolParser | None:
    """The tool-call parser of a chat request (None: no tools, or tool_choice none); forced when the
    call grammar holds the output, so that a call max_tokens cuts comes back as content."""
    if not req.tools or req.tool_choice == "none":
        return None
    return Qwen3CoderToolParser([t.model_dump(exclude_none=True) for t in req.tools],
                                forced=forces_call(req.tool_choice, req.tools))


def render_chat(tokenizer, req, default_thinking: bool, check_text=None,
                trust_template: bool = False) -> RenderedPrompt:
    """A ChatCompletionRequest (or anything with its fields) -> the prompt the engine runs. Slow for
    long conversations: call it off the event loop. check_text(text): the length pre-check, run on
    the rendered text before it is tokenized."""
    conversation = build_conversation(req.messages)
    kwargs = template_kwargs(req.chat_template_kwargs, default_thinking, getattr(req, "reasoning_effort", None))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    text = apply_template(tokenizer, conversation, tools=tools, documents=getattr(req, "documents", None),
                          chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message, kwargs=kwargs,
                          trust_template=trust_template)
    thinking = output_starts_thinking(text, bool(kwargs.get("enable_thinking", True)))
    if thinking and forces_call(getattr(req, "tool_choice", None), req.tools):
        # `<think>\n` + `\n</think>\n\n` is the template's own empty think block (enable_thinking=false)
        text += "\n" + THINK_END + "\n\n"
        thinking = False
    if check_text is not None:
        check_text(text)
    ids = tokenizer.encode(text, add_special_tokens=getattr(req, "add_special_tokens", False))
    if getattr(req, "truncate_prompt_tokens", None):
        ids = ids[-req.truncate_prompt_tokens:]
    return RenderedPrompt(text, ids, thinking)
