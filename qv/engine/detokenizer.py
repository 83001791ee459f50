"""Incremental detokenization that is correct when a multi-byte UTF-8 character is split across
tokens, plus stop-string detection on the decoded text.

The decoding itself is `tokenizers`' DecodeStream (Rust; what vLLM uses for fast tokenizers): it
keeps a window of recent ids, emits only text past what the window already showed and holds
text back while it ends in an incomplete character. It is several times cheaper than the same
algorithm over `tokenizer.decode` in Python (two decodes a token), which matters at batch 32.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 6  # prompt ids the stream sees first: byte-level tokenizers render a leading space
# relative to the previous token, so the first output token decodes with context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer (no backend_tokenizer): qv needs "
                            "the checkpoint's tokenizer.json")
        self._skip = skip_special_tokens
        window = list(prompt_ids[-PROMPT_CONTEXT:])
        self._stream, shown = self._primed(window)
        if shown < len(window):  # the prompt ends inside a character: keep its bytes out of the output
            self._stream, _ = self._primed(window[:shown])
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.text = ""  # full decoded output text (stop string removed once hit)
        self.stop_hold = max((len(s) for s in self.stop), default=1) - 1

    def _primed(self, ids: list[int]) -> tuple[DecodeStream, int]:
        """A stream that has seen `ids`, and how many of them it has shown as text (the rest may be
        bytes of an unfinished character, held back)."""
        stream, shown = DecodeStream(skip_special_tokens=self._skip), 0
        for i, t in enumerate(ids):
            if stream.step(self._backend, t) is not None:
                shown = i + 1
        return stream, shown

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut there)."""
        new_text = self._stream.step(self._backend, token_id)
        if not new_text:
            return None
        start = max(0, len(self.text) - self.stop_hold)
        self.text += new_text
        return self._check_stop(start) if self.stop else None

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
