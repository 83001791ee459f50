"""One choice's output through both parsers: reasoning first, then tool calls on the content.

`parse_output` is the non-streaming result; `OutputStream` produces OpenAI delta pieces whose
concatenation equals it (reasoning, content, and each tool call's name and arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qv.server.parsers.qwen3_coder import Qwen3CoderToolParser, ToolCall
from qv.server.parsers.qwen3_reasoning import ReasoningStream, extract_reasoning


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    cut: bool = False  # a forced call's output ends inside a call: it did not end in calls


def parse_output(text: str, thinking: bool, tools: Qwen3CoderToolParser | None) -> ParsedOutput:
    """thinking: the output starts inside a think block; tools: parse tool calls (None: don't)."""
    reasoning, content = extract_reasoning(text, thinking)
    if tools is None or content is None:
        return ParsedOutput(reasoning, content, [])
    extracted = tools.extract_tool_calls(content)
    return ParsedOutput(reasoning, extracted.content, extracted.tool_calls, extracted.cut)


@dataclass
class DeltaPieces:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputStream:
    def __init__(self, thinking: bool, tools: Qwen3CoderToolParser | None):
        self.reasoning = ReasoningStream(thinking)
        self.tools = tools.stream() if tools is not None else None

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.tools_called

    @property
    def cut(self) -> bool:
        """After finish(): the output ends inside a forced call (its text the content)."""
        return self.tools is not None and self.tools.cut

    def feed(self, delta_text: str) -> DeltaPieces:
        r, c = self.reasoning.feed(delta_text)
        return self._route(r, c, final=False)

    def finish(self) -> DeltaPieces:
        r, c = self.reasoning.finish()
        return self._route(r, c, final=True)

    def _route(self, reasoning: str, content: str, final: bool) -> DeltaPieces:
        if self.tools is None:
            return DeltaPieces(reasoning, content)
        d = self.tools.feed(content)
        out = DeltaPieces(reasoning, d.content, d.tool_calls)
        if final:
            f = self.tools.finish()
            out.content += f.content
            out.tool_calls += f.tool_calls
        return out
