"""Logprobs in the two OpenAI shapes (chat `content[]` entries, completions parallel lists)."""

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
