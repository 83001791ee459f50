"""A request's one check: `check_request` takes the prompt's token ids and the caller's
SamplingParams (range rules already applied by SamplingParams.validate) and returns the
CheckedRequest the engine queues, or raises InvalidFieldError naming the field. It edits nothing:
the params it returns are a copy with the bad words' token sequences resolved."""

from __future__ import annotations

import copy
from array import array
from dataclasses import dataclass

from qv.engine.bad_words import token_sequences
from qv.engine.request import InvalidFieldError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's and the levers' limits."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_stop_strings: int


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check, normalized: what LLMEngine.add_request queues."""

    prompt_token_ids: list[int]
    params: SamplingParams  # the caller's, copied, with bad_words_token_ids resolved
    max_tokens: int  # resolved: the request's, or all the room the prompt leaves


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits,
                  tokenizer) -> CheckedRequest:
    """Every check of a request before it is queued (prompt length and vocabulary, logprobs, token
    lists, stop strings, bad words, max_tokens, min_tokens). InvalidFieldError names the field: "prompt",
    "prompt_logprobs", "max_tokens", "min_tokens", "stop", "bad_words" or the token-id list's."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidFieldError("the prompt is empty", "prompt")
    vocab, max_len = limits.vocab_size, limits.max_model_len
    try:  # at C speed, for long prompts; the loop below only names the bad id
        ids = array("q", prompt_token_ids)
        ok = 0 <= min(ids) and max(ids) < vocab
    except (TypeError, OverflowError):
        ok = False
    if not ok:
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), prompt_token_ids[0])
        raise InvalidFieldError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
    if params.prompt_logprobs is not None and params.prompt_logprobs > limits.max_logprobs:
        raise InvalidFieldError(f"Requested prompt logprobs of {params.prompt_logprobs}, which is greater than max "
                                f"allowed: {limits.max_logprobs}", "prompt_logprobs")
    for field, token_ids in params.token_ids_to_check():
        if max(token_ids) >= vocab:
            raise InvalidFieldError(f"{field}: token id {max(token_ids)} is outside the vocabulary [0, {vocab})",
                                    field)
    bad_words = token_sequences(tokenizer, params.bad_words, vocab) if params.bad_words else None
    if len(params.stop) > limits.max_stop_strings:
        raise InvalidFieldError(f"{len(params.stop)} stop strings; at most {limits.max_stop_strings} are "
                                "allowed (max_stop_strings)", "stop")
    if n >= max_len:
        raise InvalidFieldError(
            f"This model's maximum context length is {max_len} tokens. However, your prompt "
            f"contains {n} input tokens, which leaves no room for output. Please reduce the length of the input.",
            "prompt")
    room = max_len - n
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidFieldError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{params.max_tokens} output tokens and your prompt contains {n} input tokens, for a total of "
            f"{n + params.max_tokens} tokens ({n} + {params.max_tokens} = {n + params.max_tokens} > "
            f"{max_len}). Please reduce the length of the input prompt or the number of requested "
            f"output tokens.", "max_tokens")
    if params.min_tokens > room:
        raise InvalidFieldError(f"min_tokens={params.min_tokens} is more than the {room} tokens the context leaves "
                                f"after the {n}-token prompt (max_model_len {max_len})", "min_tokens")
    normalized = copy.copy(params)  # a shallow copy: SamplingParams.validate has run on the caller's already
    normalized.bad_words_token_ids = bad_words
    return CheckedRequest(list(prompt_token_ids), normalized, room if params.max_tokens is None else params.max_tokens)
