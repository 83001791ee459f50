"""Requests and their outputs, with vLLM's names: SamplingParams, RequestOutput, CompletionOutput,
Logprob. The server and the offline LLM API see only these."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from qv.errors import InvalidRequestError

__all__ = ["CompletionOutput", "FinishReason", "InvalidRequestError", "Logprob", "RequestMetrics", "RequestOutput",
           "SamplingParams"]


@dataclass
class SamplingParams:
    """Per-request decoding settings (vLLM's field names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidRequestError(f"unknown SamplingParams field(s): {', '.join(unknown)}")
        return cls(**d)

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise InvalidRequestError(msg)

        for name in ("n", "top_k", "min_tokens"):
            need(isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool),
                 f"{name} must be an integer, got {getattr(self, name)!r}")
        need(self.n >= 1, f"n must be at least 1, got {self.n}")
        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             f"temperature must be non-negative, got {self.temperature}")
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 0, f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}")
        need(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be at least 1, got {self.max_tokens}")
        need(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be non-negative, got {self.logprobs}")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and -(1 << 63) <= self.seed < (1 << 63) - 1024),
             f"seed must be an integer in the int64 range, got {self.seed!r}")
        need(self.top_k < (1 << 31), f"top_k must be below 2**31, got {self.top_k}")
        need(self.n <= 1024, f"n must be at most 1024, got {self.n}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        need(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
             f"stop must be a string or a list of strings, got {self.stop!r}")
        need(all(s != "" for s in self.stop), "stop cannot contain an empty string")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        need(isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids),
             f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class CompletionOutput:
    """One of the n samples of a request; text, token_ids and logprobs are cumulative."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    clef: Any = None  # qv.engine.clef_rows.ClefResult of an answered Clef record (LLMEngine.add_clef)
