"""Logprobs in the two OpenAI shapes (chat `content[]` entries, completions parallel lists), and
vLLM's prompt logprobs (`prompt_logprobs`, and the echoed prompt of completions)."""

from __future__ import annotations

import math

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _lp(value: float) -> float:
    return LOGPROB_FLOOR if value is None or math.isnan(value) or value < LOGPROB_FLOOR else float(value)


def _token(tid: int, lp, tokenizer, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{tid}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _top(entry: dict, top_n: int) -> list[tuple[int, object]]:
    """The top-n alternatives of one position, by rank (the sampled token only if it ranks there)."""
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= top_n]
    return sorted(ranked, key=lambda x: x[1].rank)[:top_n]


def chat_logprobs(token_ids: list[int], logprobs: list[dict], top_n: int, tokenizer, as_ids: bool = False) -> dict:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid)
        tok = _token(tid, lp, tokenizer, as_ids)
        content.append({
            "token": tok, "logprob": _lp(lp.logprob if lp else None), "bytes": list(tok.encode("utf-8", "replace")),
            "top_logprobs": [
                {"token": (t := _token(alt, alp, tokenizer, as_ids)), "logprob": _lp(alp.logprob),
                 "bytes": list(t.encode("utf-8", "replace"))}
                for alt, alp in _top(entry, top_n)],
        })
    return {"content": content}


def completion_logprobs(token_ids: list[int], logprobs: list[dict], top_n: int, tokenizer, text_offset: int,
                        as_ids: bool = False, hidden_ids: frozenset = frozenset()) -> dict:
    """hidden_ids: tokens that add nothing to the returned text (special tokens being skipped), so
    text_offset stays an index into the text."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = text_offset
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid)
        tok = _token(tid, lp, tokenizer, as_ids)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_lp(lp.logprob if lp else None))
        top = {_token(alt, alp, tokenizer, as_ids): _lp(alp.logprob) for alt, alp in _top(entry, top_n)}
        top.setdefault(tok, _lp(lp.logprob if lp else None))  # vLLM always lists the sampled token
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        if tid not in hidden_ids:
            offset += len(_token(tid, lp, tokenizer, False))
    return out


def prompt_logprobs_field(state, asked: int | None, echo_top_n: int | None = None) -> int | None:
    """SamplingParams.prompt_logprobs of a request, checked: the field, else (completions' echo with
    logprobs) the logprobs number, as vLLM takes them; -1 is the whole vocabulary."""
    n = asked if asked is not None else echo_top_n
    if n == -1:
        n = state.engine.model_config.vocab_size
    state.check_logprobs(n, "prompt_logprobs")
    return n


def prompt_logprobs_json(entries: list[dict | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
    return [None if e is None else {str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in e.items()}
            for e in entries]


def echo_logprobs(prompt_ids: list[int], entries: list[dict | None], top_n: int, tokenizer,
                  as_ids: bool = False) -> dict:
    """Completions' logprobs of an echoed prompt (prepended to the output's, as vLLM does): the first
    token has none (None), the others their prompt logprobs; offsets index the echoed prompt."""
    head = _token(prompt_ids[0], None, tokenizer, as_ids)
    rest = completion_logprobs(prompt_ids[1:], entries[1:], top_n, tokenizer,
                               len(_token(prompt_ids[0], None, tokenizer, False)), as_ids)
    return {"text_offset": [0] + rest["text_offset"], "token_logprobs": [None] + rest["token_logprobs"],
            "tokens": [head] + rest["tokens"], "top_logprobs": [None] + rest["top_logprobs"]}


def joined(*parts: dict) -> dict:
    """Completions logprobs of consecutive token runs as one."""
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}
