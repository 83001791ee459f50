"""Structured outputs: grammars compiled by xgrammar, one token matcher per constrained sequence.

The engine owns it all: `GrammarCompiler.compile(kind, spec)` (LLMEngine.compile_grammar) turns a
request's constraint into a `Grammar` once per (kind, spec) string, cached; SamplingParams.grammar
carries it; add_request gives each of the request's sequences a `GrammarMatcher`. Each step the
runner fills the constrained rows' token bitmasks on the host (`grammar_bitmask`), the sampler
applies them to those rows of the logits on the logits' device (qv/engine/sampler.py), the engine
advances the matcher with the accepted token and finishes the sequence ("stop") when the grammar
has terminated. Steps with constrained rows wait for the previous step's tokens (no async overlap).
Speculative drafts are checked against the grammar: verification row j of a constrained sequence is
masked as the grammar stands after its first j drafts, so a draft the grammar refuses has probability 0
and is rejected there, and greedy or sampled outputs stay those of decoding without drafts.

JSON is compact (no free whitespace between tokens): a grammar that allows unbounded whitespace lets
a model loop on blanks, and a bounded schema then always terminates.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qv.engine.request import InvalidFieldError

if TYPE_CHECKING:  # the server imports this module's grammar helpers without loading torch
    import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept (LRU): a compiled JSON schema is tens of KB to a few MB


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint (opaque to the server): what SamplingParams.grammar holds."""

    kind: str
    spec: str
    compiled: object  # xgrammar.CompiledGrammar

    def matcher(self):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


JSON_TEXT_CHARS = '[ !#-\\[\\]-~]'  # printable ASCII but the quote and the backslash


def bounded_strings(node, chars: str = JSON_TEXT_CHARS):
    """xgrammar turns a string's minLength/maxLength into `[^"\\\r\n]{m,n}`, which lets raw control
    characters into the JSON text (invalid JSON), and its character classes past ASCII admit overlong
    UTF-8 (E0 80 80 decodes to three U+FFFD, so the decoded string breaks maxLength). A bounded string
    is therefore made of `chars` (a regex class; by default printable ASCII), with the same bounds:
    always valid, narrower than the schema (no non-ASCII characters in a length-bounded string).
    Strings with a pattern or format of their own are left as they are."""
    if isinstance(node, list):
        return [bounded_strings(x, chars) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_strings(v, chars) for k, v in node.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out) and not (
            "pattern" in out or "format" in out):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = "^%s{%d,%s}$" % (chars, lo, hi)
    return out


def _choice_ebnf(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"choice must be a JSON list of strings: {e}") from None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """One per engine: xgrammar's TokenizerInfo over the model's logits width (which may exceed the
    tokenizer's vocabulary: the extra ids are never allowed) and an LRU of compiled grammars.
    Thread-safe: the server calls `compile` on worker threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = CACHE_SIZE):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids))
        self._xgr = xgr.GrammarCompiler(self.info, cache_enabled=False)  # the LRU below is the cache
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, kind: str, spec: str, param: str = "response_format") -> Grammar:
        """The Grammar for (kind, spec): json (a JSON schema, as text), json_object (spec ignored),
        regex, choice (a JSON list of strings), grammar (EBNF, GBNF style), structural_tag (an
        xgrammar structural tag as JSON: the server's tool-call grammar). A bad spec raises
        InvalidFieldError naming `param`."""
        if kind not in KINDS:
            raise InvalidFieldError(f"unknown structured output kind {kind!r}; expected one of {', '.join(KINDS)}",
                                    param)
        if not isinstance(spec, str):
            raise InvalidFieldError(f"the {kind} constraint must be given as text, got {type(spec).__name__}", param)
        key = (kind, "" if kind == "json_object" else spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        grammar = Grammar(kind, key[1], self._compile(kind, key[1], param))
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, kind: str, spec: str, param: str):
        what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
                "grammar": "grammar", "structural_tag": "structural tag"}[kind]
        try:
            if kind == "json":
                schema = json.loads(spec)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object or a boolean")
                return self._xgr.compile_json_schema(json.dumps(bounded_strings(schema)), any_whitespace=False,
                                                     strict_mode=True)
            if kind == "json_object":
                # any object, compact (xgrammar's builtin JSON grammar takes any value, and free whitespace)
                return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return self._xgr.compile_regex(spec)
            if kind == "choice":
                return self._xgr.compile_grammar(_choice_ebnf(spec))
            if kind == "structural_tag":
                return self._xgr.compile_structural_tag(spec)
            return self._xgr.compile_grammar(spec)
        except (ValueError, RuntimeError, TypeError) as e:  # xgrammar reports bad input as RuntimeError/ValueError
            msg = str(e).strip().splitlines()
            raise InvalidFieldError(f"invalid {what}: {msg[-1] if msg else type(e).__name__}"[:1000], param) from None


def grammar_bitmask(rows: list[tuple[object | None, list[int]]], vocab_size: int,
                    device: torch.device) -> tuple[torch.Tensor, list[int]] | None:
    """(token bitmask [rows, ceil(V/32)] int32 on `device`, the constrained row indices), or None when no row
    is constrained. Each row is (its matcher, or None for an unconstrained row; the drafts before it): the
    matcher takes those drafts, fills the row, and rolls back. A row past a draft the grammar refuses (or
    past its end) is never used (verification stops at that draft): it repeats the row before it, the same
    sequence's previous verification row."""
    constrained = [i for i, (m, _) in enumerate(rows) if m is not None]
    if not constrained:
        return None
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for i in constrained:
        matcher, before = rows[i]
        taken = 0
        for token in before:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
        if taken == len(before) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask, i)
        else:
            mask[i] = mask[i - 1]
        if taken:
            matcher.rollback(taken)
    return mask.to(device, non_blocking=True), constrained


def apply_bitmask(logits: torch.Tensor, grammar: tuple[torch.Tensor, list[int]]) -> None:
    """Disallowed tokens of the constrained rows to -inf, in place (other rows untouched)."""
    import xgrammar as xgr

    mask, rows = grammar
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], indices=rows)
