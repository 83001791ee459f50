"""qwen3 reasoning parser: splits Qwen3.5 output into reasoning and content.

Qwen3.5 templates put `<think>\\n` at the end of the prompt when thinking is on, so the output is
`reasoning</think>\\n\\ncontent`; with thinking off the prompt already holds
`<think>\\n\\n</think>\\n\\n` and the whole output is content (research/qwen35.md 6.4).

Rules (vLLM's `Qwen3ReasoningParser`, made exact so streaming matches non-streaming):
- A `<think>` the model writes itself (older Qwen3 templates) is dropped when it opens the output
  (after optional whitespace). vLLM drops everything up to the first `<think>` anywhere, which a
  stream cannot do without retracting reasoning already sent.
- Reasoning ends at the first `</think>` (content is what follows it), or at the first
  `<tool_call>` that is followed, after optional whitespace, by `<function=` or `<function `
  (an implicit end: content starts at the `<tool_call>`, so the tool parser sees it).
- Without an end the output was cut short and everything is reasoning.

`ReasoningStream` re-parses the text seen so far with `final=False` and sends only what later text
cannot change, so streamed reasoning + content always equal `extract_reasoning` on the same text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qv.server.parsers.markers import scan

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")
_FUNCTION_PREFIX = "<function"


def prompt_ends_reasoning(prompt: str) -> bool:
    """True when the prompt already closed the think block (enable_thinking=false renders
    `<think>\\n\\n</think>\\n\\n`), so every generated token is content."""
    return prompt.rfind(THINK_END) > prompt.rfind(THINK_START)


@dataclass
class ReasoningSplit:
    reasoning: str  # stable reasoning text
    content: str  # stable content text (empty until reasoning ends)
    ended: bool


def split_reasoning(text: str, final: bool = True) -> ReasoningSplit:
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        body = stripped[len(THINK_START) :]
    elif not final and len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
        return ReasoningSplit("", "", False)  # may still become a leading <think>
    else:
        body = text
    cursor = 0
    while True:
        p, marker, hold = scan(body, (THINK_END, TOOL_CALL_START), cursor, final)
        if p == -1:
            return ReasoningSplit(body if final else body[:hold], "", False)
        if marker == THINK_END:
            return ReasoningSplit(body[:p], body[p + len(THINK_END) :], True)
        after = body[p + len(TOOL_CALL_START) :].lstrip()
        if _FUNCTION_OPEN.match(after):
            return ReasoningSplit(body[:p], body[p:], True)
        if not final and (len(after) <= len(_FUNCTION_PREFIX) and _FUNCTION_PREFIX.startswith(after)):
            return ReasoningSplit(body[:p], "", False)  # `<function` may still follow
        cursor = p + 1  # a <tool_call> mentioned in reasoning: not an end


def extract_reasoning(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output; None where empty. `thinking` False: all content."""
    if not thinking:
        return None, text
    split = split_reasoning(text, final=True)
    return split.reasoning or None, split.content or None


class ReasoningStream:
    """Per-choice streaming state: feed new text, get (reasoning delta, content delta)."""

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.ended = False

    def feed(self, delta_text: str) -> tuple[str, str]:
        if not self.thinking or self.ended:  # after the end, new text is content as it comes
            return "", delta_text
        self.text += delta_text
        return self._diff(split_reasoning(self.text, final=False))

    def finish(self) -> tuple[str, str]:
        if not self.thinking or self.ended:
            return "", ""
        return self._diff(split_reasoning(self.text, final=True))

    def _diff(self, split: ReasoningSplit) -> tuple[str, str]:
        self.ended = split.ended
        r = split.reasoning[self.sent_reasoning :]
        c = split.content[self.sent_content :]
        self.sent_reasoning = max(self.sent_reasoning, len(split.reasoning))
        self.sent_content = max(self.sent_content, len(split.content))
        return r, c
