"""Incremental detokenization that is correct when a multi-byte UTF-8 character is split across
tokens, plus stop-string detection on the decoded text.

Like vLLM's: decode a short window of recent tokens, emit only the text past what the window
already showed, and hold text back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        # The window starts a few prompt tokens back so the first output token decodes with context
        # (byte-level tokenizers render a leading space relative to the previous token).
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # full decoded output text (stop string removed once hit)
        self.stop_hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut there)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            new_text = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            start = max(0, len(self.text) - self.stop_hold)
            self.text += new_text
            return self._check_stop(start)
        return None

    def _check_stop(self, search_from: int) -> str | None:
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return s
        return None

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, the last chars that could begin a stop string are held back."""
        if finished or not self.stop or self.stop_hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.stop_hold)]

    def decode_token(self, token_id: int) -> str:
        """One token alone, as shown in logprobs entries."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
