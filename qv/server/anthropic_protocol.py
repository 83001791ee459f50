"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), pydantic.

Unlike the OpenAI bodies (protocol.py), nothing unknown passes: a field qv does not know, or knows
but cannot honour (`service_tier`, `mcp_servers`, server tools, `redacted_thinking`...), is a 400
that names it. Content blocks are a union on `type`, so a block of an unknown type is refused by
name as well. `cache_control` is taken on every block where Anthropic allows it: qv's prefix cache
is automatic, so the breakpoint it marks is honoured without being read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qv.server.protocol import FunctionDefinition

# Anthropic fields qv knows but does not serve: a 400 that says so, rather than "unknown field"
NOT_SERVED = {
    "service_tier": "qv has one service tier",
    "container": "qv runs no code-execution containers",
    "mcp_servers": "qv connects to no MCP servers",
    "context_management": "qv does not edit the context",
    "output_format": "the beta's name: use output_config.format",
    "inference_geo": "qv serves from where it runs",
}


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _not_served(cls, data):
        if isinstance(data, dict):
            known = [k for k in data if k in NOT_SERVED and k not in cls.model_fields]
            if known:
                raise ValueError("; ".join(f"`{k}` is not supported by qv ({NOT_SERVED[k]})" for k in known))
        return data


class CacheControl(AnthropicModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(AnthropicModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(AnthropicModel):
    type: Literal["url"]
    url: str


class ImageBlock(AnthropicModel):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        """The source as the URL qv's media path fetches (a data URL for base64 data)."""
        s = self.source
        return s.url if isinstance(s, URLSource) else f"data:{s.media_type};base64,{s.data}"


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ToolResultContent = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock],
                         Field(discriminator="type")]


class InputMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]


class Tool(AnthropicModel):
    type: Literal["custom"] | None = None  # server tools (web_search_..., bash_...) are Anthropic's own
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _schema(self):
        FunctionDefinition(name=self.name, parameters=self.input_schema)  # chat's name and schema rules
        return self


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice.name is required with type 'tool' and allowed with no other type")
        return self


class ThinkingEnabled(AnthropicModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingAdaptive(AnthropicModel):
    type: Literal["adaptive"]  # the model decides how long it thinks: qv's does, with the template's thinking on


class ThinkingDisabled(AnthropicModel):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled], Field(discriminator="type")]


class JSONOutputFormat(AnthropicModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: JSONOutputFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _effort(cls, data):
        if isinstance(data, dict) and "effort" in data:
            raise ValueError("output_config.effort is not supported by qv: its models think or do not; use `thinking`")
        return data


class Metadata(AnthropicModel):
    user_id: str | None = None


class PromptFields(AnthropicModel):
    """What both endpoints render into the prompt."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as for chat

    @property
    def output_format(self) -> JSONOutputFormat | None:
        return self.output_config.format if self.output_config is not None else None

    @model_validator(mode="after")
    def _tools(self):
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ValueError("tool_choice needs `tools`")
        asked = (self.chat_template_kwargs or {}).get("enable_thinking")
        if self.thinking is not None and asked is not None and asked != (self.thinking.type != "disabled"):
            raise ValueError("chat_template_kwargs.enable_thinking contradicts `thinking`: give one of them")
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            names = [t.name for t in self.tools or []]
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names the tool `{self.tool_choice.name}`, which is not among the "
                                 f"tools ({', '.join(names)})")
        return self


class MessagesRequest(PromptFields):
    max_tokens: int = Field(ge=1)
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _budget(self):
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than max_tokens "
                             f"({self.max_tokens})")
        return self


class CountTokensRequest(PromptFields):
    pass
