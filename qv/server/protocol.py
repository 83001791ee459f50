"""Request bodies (pydantic), with vLLM's field names, JSON types and combination rules.

Types are strict, as OpenAI's are: `"stream": "yes"` or `1`, `"max_tokens": 4.5` or `"4"` are
refused rather than coerced (an integer is taken where a number is expected). Sampling ranges are
not here: SamplingParams.validate in the engine holds them, once for the server and `LLM` alike.
Unknown top-level fields are accepted and ignored with a warning, as vLLM does; fields qv knows
but cannot honour yet (beam search) are refused
with a 400 that says so, rather than silently changing what the client asked for.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

log = logging.getLogger("qv.server")

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")  # rendered as `<function=NAME>`: no spaces or `<>`


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False, strict=True)

    @model_validator(mode="after")
    def _log_ignored(self):
        if self.model_extra and type(self).__name__.endswith("Request"):
            log.warning("%s: ignoring unknown field(s) %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.match(v):
            raise ValueError(f"function name {v!r} must be 1-128 characters of letters, digits, '_', '.', ':' or '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict | None) -> dict | None:
        if v is None:
            return v
        if "type" in v and v["type"] != "object":
            raise ValueError(f"parameters must be a JSON schema of type 'object', got type {v['type']!r}")
        if "properties" in v and not isinstance(v["properties"], dict):
            raise ValueError("parameters.properties must be an object mapping names to schemas")
        if "required" in v and not (isinstance(v["required"], list) and all(isinstance(x, str) for x in v["required"])):
            raise ValueError("parameters.required must be a list of property names")
        return v


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallIn(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class SamplingKnobs(OpenAIModel):
    """The sampler's settings every generating endpoint takes (ranges: SamplingParams.validate)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None


class SamplingFields(SamplingKnobs):
    """Sampling and output fields shared by chat and completions (vLLM extensions included)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep the last N; -1 the last max_model_len
    user: str | None = None
    request_id: str | None = Field(None, min_length=1)  # vLLM's: the response id's tail, logged (state.request_id_of)
    priority: int = 0  # vLLM's: lower first under --scheduling-policy priority; else only 0 (ServerState.sampling_params)
    # vLLM's plug-in hooks qv has not: refused when set
    mm_processor_kwargs: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # structured outputs (vLLM's fields; response_format in the subclasses)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id string -> bias; ranges: SamplingParams.validate
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # rules: SamplingParams.validate
    prompt_logprobs: int | None = None  # vLLM's: top-N per prompt token; -1 the whole vocabulary
    # known but not supported yet: refused when set to anything but their "off" value
    use_beam_search: bool = False
    _constraint: tuple[str, str, str] | None = PrivateAttr(None)

    @property
    def constraint(self) -> tuple[str, str, str] | None:
        """The structured-output constraint asked for: (kind, spec text, field) for
        LLMEngine.compile_grammar, or None."""
        return self._constraint

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        """vLLM's rules and words (the largest N is the server's max_logprobs)."""
        if v is not None and info.data.get("stream") and (v > 0 or v == -1):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        if v is not None and v < -1:
            raise ValueError(f"`prompt_logprobs` must be a positive value or -1, got {v}.")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (keep the last max_model_len tokens) or at least 1")
        return v

    @model_validator(mode="after")
    def _common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        unsupported = {"use_beam_search": self.use_beam_search, "mm_processor_kwargs": self.mm_processor_kwargs,
                       "logits_processors": self.logits_processors, "vllm_xargs": self.vllm_xargs}
        refused = [k for k, on in unsupported.items() if on]
        if refused:
            raise ValueError(f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not supported by qv yet")
        found = structured_constraints(getattr(self, "response_format", None), self.structured_outputs,
                                       {"json": self.guided_json, "regex": self.guided_regex,
                                        "choice": self.guided_choice, "grammar": self.guided_grammar})
        if len(found) > 1:
            raise ValueError(f"give one structured-output constraint, got {len(found)} "
                             f"({', '.join(f[2] for f in found)})")
        self._constraint = found[0] if found else None
        return self


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback",
                      "whitespace_pattern")  # vLLM's tuning knobs: accepted, qv's JSON is always compact


def _one_constraint(kind: str, value, where: str) -> tuple[str, str, str]:
    """(kind, spec text, field) of one constraint value, its JSON types checked."""
    if kind == "json":
        if isinstance(value, str):
            return kind, value, where
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"{where}: a JSON schema must be an object (or its JSON text)")
        return kind, json.dumps(value), where
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"{where}: choice must be a non-empty list of non-empty strings")
        return kind, json.dumps(value), where
    if kind == "json_object":
        return kind, "", where
    if kind == "structural_tag":
        return kind, structural_tag_spec(value, where), where
    if not (isinstance(value, str) and value):
        raise ValueError(f"{where}: {kind} must be a non-empty string")
    return kind, value, where


def structured_constraints(response_format, structured_outputs, guided: dict) -> list[tuple[str, str, str]]:
    """Every constraint a request names: OpenAI's response_format, vLLM's structured_outputs and
    its older guided_* fields."""
    found = []
    if response_format is not None:
        rtype = response_format.get("type", "text")
        if rtype == "json_object":
            found.append(("json_object", "", "response_format"))
        elif rtype == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise ValueError("response_format.json_schema must be an object with `name` and `schema`")
            found.append(_one_constraint("json", js["schema"], "response_format"))
        elif rtype == "structural_tag":
            found.append(_one_constraint("structural_tag", response_format, "response_format"))
        elif rtype != "text":
            raise ValueError(f"response_format type {rtype!r} is not supported; expected text, json_object, "
                             "json_schema or structural_tag")
    if structured_outputs is not None:
        unknown = sorted(set(structured_outputs) - set(STRUCTURED_KEYS) - set(STRUCTURED_OPTIONS))
        if unknown:
            raise ValueError(f"structured_outputs: {', '.join(unknown)} not supported; qv takes one of "
                             f"{', '.join(STRUCTURED_KEYS)}")
        keys = [k for k in STRUCTURED_KEYS if structured_outputs.get(k) not in (None, False)]
        if len(keys) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}, got "
                             f"{len(keys)}")
        found.append(_one_constraint(keys[0], structured_outputs[keys[0]], "structured_outputs"))
    for kind, value in guided.items():
        if value is not None:
            found.append(_one_constraint(kind, value, f"guided_{kind}"))
    return found


def structural_tag_spec(value, where: str) -> str:
    """vLLM's structural tag (an object, or its JSON text) as the JSON of xgrammar's structural tag:
    the `format` form as given, the older `structures` + `triggers` form as the triggered tags it
    stands for (each structure's `schema` the JSON content between its `begin` and `end`)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where}: a structural tag must be a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a structural tag must be an object with `format`, or `structures` and `triggers`")
    if "format" in value:
        return json.dumps({"type": "structural_tag", "format": value["format"]})
    structures, triggers = value.get("structures"), value.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers and
            all(isinstance(t, str) and t for t in triggers) and
            all(isinstance(x, dict) and {"begin", "end"} <= set(x) for x in structures)):
        raise ValueError(f"{where}: a structural tag needs `format`, or a non-empty `structures` list (each with "
                         "`begin`, `schema` and `end`) and a non-empty `triggers` list of strings")
    tags = [{"type": "tag", "begin": x["begin"], "end": x["end"],
             "content": {"type": "json_schema", "json_schema": x.get("schema", True)}} for x in structures]
    return json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers,
                                                             "tags": tags}})


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: bool = True
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens (BOS) around the rendered chat

    @model_validator(mode="after")
    def _chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        if self.tool_choice not in (None, "none") and self.tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names the function `{self.tool_choice.function.name}`, which is not "
                                 f"among the tools ({', '.join(names) or 'none'})")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to true.")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _completion(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} differs from n={self.n}; qv does not rank extra samples")
        return self


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class ResponsesTool(OpenAIModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function_only(self):
        if self.type != "function":
            raise ValueError(f"tool type {self.type!r} is not supported: qv serves function tools only")
        if self.name is None:
            raise ValueError("a function tool needs a name")
        FunctionDefinition(name=self.name, parameters=self.parameters)  # same name and schema rules as chat
        return self


class ResponsesNamedToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(SamplingKnobs):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: the response's id as given
    priority: int = 0  # vLLM's: lower first under --scheduling-policy priority

    @model_validator(mode="after")
    def _responses(self):
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be an empty list")
        if self.background and self.stream:
            raise ValueError("background: qv does not stream background responses; retrieve them once they end")
        fmt = (self.text or {}).get("format") or {}
        if not isinstance(fmt, dict) or fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
            raise ValueError("text.format must be an object of type text, json_object or json_schema")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(self.tool_choice, ResponsesNamedToolChoice):
            names = [t.name for t in self.tools or []]
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names the function `{self.tool_choice.name}`, which is not among "
                                 f"the tools ({', '.join(names) or 'none'})")
        return self
