"""A small, deterministic byte-level BPE tokenizer with Qwen's special tokens, written as a
Hugging Face `tokenizer.json`. Every UTF-8 byte is a token, so any text round-trips and
multi-byte characters can split across tokens (which detokenization must handle)."""

from __future__ import annotations

import json
from collections import Counter

# Qwen3.5's added tokens, in Qwen's order; `special` follows Qwen (tool/think tags are not special).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads tokens and writes tokens; the engine
schedules requests, the kernels do the arithmetic. def main(): return {"name": "value", "count": 3}
<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
</function>
</tool_call>
Привет, мир! こんにちは世界 Ünïcödé façade naïve café 😀 — “quotes” and 'single' ones.
Question: what is the answer? Answer: the answer is 42. Yes or no. true false null
STATE: QUESTIONS: choice score noul criteria instructions options
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _pretokenize(text: str) -> list[str]:
    """Split like ByteLevel's regex closely enough for training: words with their leading space."""
    import re

    pat = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?[^\s\w]+|\s+(?!\S)|\s+""")
    return pat.findall(text)


def train_bpe(num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Deterministic BPE on CORPUS: most frequent pair first, ties broken by the pair itself."""
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(range(256))}
    words = Counter(tuple(b2u[b] for b in w.encode("utf-8")) for w in _pretokenize(CORPUS))
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        vocab["".join(best)] = len(vocab)
        new_words: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return vocab, merges


def tokenizer_json(num_merges: int = 120) -> tuple[str, dict[str, int]]:
    """(tokenizer.json text, added token -> id)."""
    vocab, merges = train_bpe(num_merges)
    added = {}
    added_list = []
    for content, special in ADDED_TOKENS:
        added[content] = len(vocab) + len(added)
        added_list.append({"id": added[content], "content": content, "single_word": False, "lstrip": False,
                           "rstrip": False, "normalized": False, "special": special})
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_list,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    return json.dumps(tok, ensure_ascii=False, indent=1), added
