"""Output parsers: qwen3_coder tool calls and qwen3 reasoning (vLLM's names), both streaming."""

from qv.server.parsers.output import DeltaPieces, OutputStream, ParsedOutput, parse_output
from qv.server.parsers.qwen3_coder import Qwen3CoderToolParser, ToolCall, convert_param_value
from qv.server.parsers.qwen3_reasoning import extract_reasoning, prompt_ends_reasoning

__all__ = ["DeltaPieces", "OutputStream", "ParsedOutput", "parse_output", "Qwen3CoderToolParser", "ToolCall",
           "convert_param_value", "extract_reasoning", "prompt_ends_reasoning"]
