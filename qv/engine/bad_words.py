"""bad_words (vLLM's SamplingParams field): words a request never generates, as token sequences.

Each word is tokenized as written (leading blanks stripped) and, where that makes a different first
token of the same length, with one leading space too, so a word is banned at the start of the text
and after a space (vLLM's `update_from_tokenizer`). A sequence's last token is banned at a step when
the row's latest generated tokens are the rest of the sequence; a one-token word is always banned.
The sampler applies the bans on the device (sampler.apply_bias) for the rows that have them only.
"""

from __future__ import annotations

from qv.engine.request import MAX_BAD_WORDS, InvalidFieldError

MAX_TOKENS = 1024  # all sequences' tokens together: bounds the per-step host check


def token_sequences(tokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """The sequences to ban for `words` (SamplingParams.bad_words_token_ids). InvalidFieldError
    ("bad_words") when there are too many or a token lies outside the model's vocabulary."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidFieldError(f"bad_words[{i}] {word!r} tokenizes to no tokens", "bad_words")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    total = sum(len(s) for s in sequences)
    if len(sequences) > MAX_BAD_WORDS or total > MAX_TOKENS:
        raise InvalidFieldError(f"bad_words make {len(sequences)} token sequences of {total} tokens in all; at most "
                                f"{MAX_BAD_WORDS} sequences and {MAX_TOKENS} tokens are allowed", "bad_words")
    outside = sorted({t for s in sequences for t in s if not 0 <= t < vocab_size})
    if outside:
        raise InvalidFieldError(f"bad_words tokenize to ids {outside[:8]} outside the vocabulary [0, {vocab_size})",
                                "bad_words")
    return sequences


def depends_on_output(sequences: list[list[int]] | None) -> bool:
    """Whether some ban waits for its prefix among the generated tokens (a word of several tokens)."""
    return any(len(s) > 1 for s in sequences or ())


def banned_next(sequences: list[list[int]], output: list[int]) -> list[int]:
    """Token ids banned after `output` (the row's generated tokens so far)."""
    banned = []
    for s in sequences:
        n = len(s) - 1
        if n == 0 or (n <= len(output) and output[len(output) - n:] == s[:-1]):
            banned.append(s[-1])
    return banned


def batch_bans(params: list, outputs: list[list[int]]) -> tuple[list[int], list[int]] | None:
    """(row, token id) of every ban in a batch of rows (SamplingParams, generated tokens each), as two
    lists; None when no row bans anything this step."""
    rows, ids = [], []
    for i, (p, out) in enumerate(zip(params, outputs)):
        if p.bad_words_token_ids:
            banned = banned_next(p.bad_words_token_ids, out)
            rows += [i] * len(banned)
            ids += banned
    return (rows, ids) if ids else None
