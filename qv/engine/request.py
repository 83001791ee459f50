"""Requests and their outputs, with vLLM's names: SamplingParams, RequestOutput, CompletionOutput,
Logprob. The server and the offline LLM API see only these."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from qv.errors import InvalidRequestError

__all__ = ["CompletionOutput", "FinishReason", "InvalidFieldError", "InvalidRequestError", "Logprob", "RequestMetrics",
           "RequestOutput", "SamplingParams", "TextBound"]

FP32_MAX = 3.4028234663852886e38
MAX_N = 1024  # samples per prompt; the server's max_waiting bounds the sequences of a whole request
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0
MAX_BAD_WORDS = 128  # words, and token sequences once tokenized (qv/engine/bad_words.py), as vLLM allows
MAX_BAD_WORDS_CHARS = 16384  # all bad_words together, checked before tokenizing (their 1024 tokens at 16 chars each)
MAX_STOP_CHARS = 16384  # all stop strings together: each step's stop check scans as far back as the longest


class InvalidFieldError(InvalidRequestError):
    """An InvalidRequestError caused by one field (`param`: its name, as the request spells it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (plus the prompt token's own)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    grammar: Any = None  # qv.engine.structured.Grammar from LLMEngine.compile_grammar: constrains every sample
    logit_bias: dict[int, float] | None = None  # token id (or its decimal string) -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated (qv/engine/bad_words.py)
    bad_words_token_ids: list[list[int]] | None = None  # their token sequences: set by the engine from bad_words

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
        """Every range rule of a request's sampling fields, in vLLM's words; the server keeps only the
        JSON types. InvalidFieldError names the field."""
        def need(cond: bool, param: str, msg: str):
            if not cond:
                raise InvalidFieldError(msg, param)

        def number(name: str) -> bool:  # the sampler computes in fp32: beyond its range is inf
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= FP32_MAX

        for name in ("n", "top_k", "min_tokens"):
            need(isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool), name,
                 f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            need(number(name), name, f"{name} must be a finite 32-bit float, got {getattr(self, name)!r}")
        need(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        need(self.n <= MAX_N, "n", f"n must be at most {MAX_N}, got {self.n}")
        need(self.temperature >= 0, "temperature", f"temperature must be non-negative, got {self.temperature}")
        need(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 0, "top_k",
             f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}")
        need(self.top_k < (1 << 31), "top_k", f"top_k must be below 2**31, got {self.top_k}")
        need(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                                         and self.max_tokens >= 1), "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}")
        need(self.min_tokens >= 0, "min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                       and self.logprobs >= 0), "logprobs",
             f"logprobs must be non-negative, got {self.logprobs}")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and not isinstance(self.prompt_logprobs, bool)
                                              and self.prompt_logprobs >= 0), "prompt_logprobs",
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        int64 = isinstance(self.seed, int) and not isinstance(self.seed, bool) and -(1 << 63) <= self.seed < (1 << 63)
        need(self.seed is None or int64, "seed", f"seed must be an integer in the int64 range, got {self.seed!r}")
        # sample i of n runs with seed + i, which must stay an int64
        need(self.seed is None or self.seed + self.n - 1 < (1 << 63), "seed",
             f"seed + n - 1 must be at most 2**63 - 1, got seed={self.seed}, n={self.n}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        need(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop",
             f"stop must be a string or a list of strings, got {self.stop!r}")
        need(all(s != "" for s in self.stop), "stop", "stop cannot contain an empty string")
        stop_chars = sum(map(len, self.stop))
        need(stop_chars <= MAX_STOP_CHARS, "stop",
             f"the stop strings hold {stop_chars} characters in all; at most {MAX_STOP_CHARS} are allowed")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        need(isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids), "stop_token_ids",
             f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        need(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             f"stop_token_ids must be non-negative, got {min(self.stop_token_ids, default=0)}")
        need(self.grammar is None or callable(getattr(self.grammar, "matcher", None)), "grammar",
             f"grammar must come from LLMEngine.compile_grammar, got {type(self.grammar).__name__}")
        if self.top_k == -1:
            self.top_k = 0
        self._validate_token_lists()

    def _validate_token_lists(self) -> None:
        """logit_bias (OpenAI: token id string -> [-100, 100], at most 300), allowed_token_ids
        (vLLM: non-empty) and bad_words (at most 128 non-blank words); token ids are checked against
        the vocabulary, and bad_words tokenized, by the engine."""
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidFieldError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}",
                                        "logit_bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidFieldError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are "
                                        "allowed", "logit_bias")
            bias = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
                if not integer(token) or not 0 <= token < (1 << 31):
                    raise InvalidFieldError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                            "logit_bias")
                if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                        and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
                    raise InvalidFieldError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for "
                                            f"token {key!r}", "logit_bias")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not (isinstance(ids, list) and ids and all(integer(t) and 0 <= t < (1 << 31) for t in ids)):
                raise InvalidFieldError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}",
                                        "allowed_token_ids")
        words = self.bad_words
        if words is not None:
            chars = sum(len(w) for w in words if isinstance(w, str)) if isinstance(words, list) else 0
            if chars > MAX_BAD_WORDS_CHARS:  # before anything reads or tokenizes them
                raise InvalidFieldError(f"bad_words hold {chars} characters in all; at most {MAX_BAD_WORDS_CHARS} are "
                                        "allowed", "bad_words")
            if not (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)):
                raise InvalidFieldError(f"bad_words must be a list of words (strings that are not empty or blank), "
                                        f"got {words!r}"[:300], "bad_words")
            if len(words) > MAX_BAD_WORDS:
                raise InvalidFieldError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed",
                                        "bad_words")
            self.bad_words = words or None

    def token_ids_to_check(self) -> list[tuple[str, list[int]]]:
        """(field, token ids) the engine checks against the vocabulary."""
        return [(name, list(ids)) for name, ids in (("logit_bias", self.logit_bias or ()),
                                                     ("allowed_token_ids", self.allowed_token_ids or ())) if ids]

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
    # SamplingParams.prompt_logprobs: None first, then per prompt token {token id: Logprob} with the
    # token itself and the top-n; None until the whole prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


# How many times shorter, in UTF-8 bytes, a normalizer can make a text (tests/server/test_hardening.py
# re-derives each over every code point): NFC maps U+1FEF (3 bytes) to "`" (1 byte) and composes
# "ΐ" (2 bytes) from up to 7 bytes; NFKC maps U+107A5 (4 bytes) to one ASCII byte.
NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 5, "NFKD": 5, "Lowercase": 3}


@dataclass(frozen=True)
class TextBound:
    """The fewest tokens a text can become, from its length alone: every token stands for at most
    `max_token_bytes` bytes of normalized text, and normalizing shortens it at most `shrink` times.
    So a prompt that cannot fit is refused before it is tokenized, and no prompt that fits ever is."""

    max_token_bytes: int
    shrink: int

    @classmethod
    def of(cls, tokenizer) -> "TextBound | None":
        """From a Hugging Face fast tokenizer's vocabulary and normalizer; None when the normalizer
        is one whose shrinking is not bounded here (then nothing is refused early)."""
        import json

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        shrink = _shrink(spec.get("normalizer"))
        if shrink is None:
            return None
        byte_level = "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
        # byte-level vocabularies spell each byte as one character; otherwise the UTF-8 length of a
        # token's spelling is at least the bytes it decodes to ("▁" for a space, "<0x41>" for "A")
        longest = max((len(t) if byte_level else len(t.encode("utf-8", "surrogatepass"))
                       for t in backend.get_vocab(with_added_tokens=False)), default=1)
        added = max((len(t["content"].encode("utf-8", "surrogatepass")) for t in spec.get("added_tokens") or []),
                    default=1)
        return cls(max(longest, added, 1), shrink)

    def min_tokens(self, text: str, enough: int) -> int:
        """A lower bound of the tokens `text` becomes; exact bytes are counted only while the
        character count (never more than the bytes) does not already reach `enough` tokens."""
        per_token = self.max_token_bytes * self.shrink
        floor = -(-len(text) // per_token)
        if floor >= enough or text.isascii():
            return floor
        return -(-len(text.encode("utf-8", "surrogatepass")) // per_token)

    def check(self, text: str, max_model_len: int, max_tokens: int | None) -> None:
        """InvalidFieldError (param "prompt") when `text` certainly cannot fit max_model_len; the
        messages are the engine's (LLMEngine.check_request) with "at least"."""
        enough = max_model_len - (max_tokens or 0) + 1
        n = self.min_tokens(text, min(enough, max_model_len))
        if n >= max_model_len:
            raise InvalidFieldError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains at "
                f"least {n} input tokens ({len(text)} characters), which leaves no room for output. Please reduce "
                "the length of the input.", "prompt")
        if max_tokens is not None and n + max_tokens > max_model_len:
            raise InvalidFieldError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains at least {n} input tokens ({len(text)} "
                f"characters), for a total of at least {n + max_tokens} tokens. Please reduce the length of the "
                "input prompt or the number of requested output tokens.", "max_tokens")


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        total = 1
        for part in normalizer.get("normalizers") or []:
            s = _shrink(part)
            if s is None:
                return None
            total *= s
        return total
    return NORMALIZER_SHRINK.get(normalizer.get("type"))
