"""Structured outputs: grammars compiled by xgrammar, one token matcher per constrained sequence.

The engine owns it all: `GrammarCompiler.compile(kind, spec)` (LLMEngine.compile_grammar) turns a
request's constraint into a `Grammar` once per (kind, spec) string, cached. A spec over a size limit
(`GrammarLimits`, the grammar_* levers) is refused before compiling; compiles run in worker processes
(grammar_worker.py: xgrammar's C++ cannot be interrupted in a thread), killed past the time budget or
when the caller cancels; each matcher is timed (`BudgetedMatcher`). SamplingParams.grammar
carries it; add_request gives each of the request's sequences a `GrammarMatcher`, which the
StructuredOutputs step feature keeps (qv/engine/step_structured.py). Each step the runner fills the
constrained rows' token bitmasks on the host (`grammar_bitmask`), the sampler
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

import concurrent.futures
import contextlib
import json
import os
import queue
import re
import select
import struct
import subprocess
import sys
import threading
import time
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
    step_budget_s: float = 0.05  # grammar_mask_budget_ms

    def matcher(self) -> "BudgetedMatcher":
        import xgrammar as xgr

        return BudgetedMatcher(xgr.GrammarMatcher(self.compiled), self.step_budget_s)


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


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may ask of the compiler, checked on the spec before compiling (the
    grammar_* levers), and the time it may take: compiling, and per call of its matcher."""

    spec_bytes: int = 256 << 10
    properties: int = 512
    enum_entries: int = 4096
    depth: int = 32
    any_of: int = 64
    regex_chars: int = 4096
    compile_timeout_s: float = 10.0
    workers: int = 2
    mask_budget_s: float = 0.05

    @classmethod
    def of(cls, cfg) -> "GrammarLimits":
        return cls(cfg.grammar_max_spec_bytes, cfg.grammar_max_properties, cfg.grammar_max_enum_entries,
                   cfg.grammar_max_depth, cfg.grammar_max_any_of, cfg.grammar_max_regex_chars,
                   cfg.grammar_compile_timeout_s, cfg.grammar_compile_workers, cfg.grammar_mask_budget_ms / 1000)

    def over(self, what: str, found: int, limit: int, lever: str, param: str) -> InvalidFieldError:
        return InvalidFieldError(f"the {what} is over this server's limit: {found} > {limit} (grammar_{lever})", param)

    def check(self, kind: str, spec: str, param: str) -> None:
        """Refuse a spec whose size alone says it is too costly to compile (InvalidFieldError naming the lever)."""
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.spec_bytes:
            raise self.over(f"{kind} constraint's size in bytes", size, self.spec_bytes, "max_spec_bytes", param)
        if kind == "regex" and len(spec) > self.regex_chars:
            raise self.over("regex's length", len(spec), self.regex_chars, "max_regex_chars", param)
        if kind not in ("json", "structural_tag", "choice"):
            return
        try:
            tree = json.loads(spec)
        except (ValueError, RecursionError):
            return  # the compile names what is wrong with it
        if kind == "choice":
            if isinstance(tree, list) and len(tree) > self.enum_entries:
                raise self.over("number of choices", len(tree), self.enum_entries, "max_enum_entries", param)
            return
        counts = {"properties": 0, "enum": 0, "anyOf": 0}
        stack = [(tree, 1)]
        while stack:  # iterative: the JSON parser bounds the depth, this bounds the work by the spec's size
            node, depth = stack.pop()
            if depth > self.depth:
                raise self.over("schema's nesting depth", depth, self.depth, "max_depth", param)
            if isinstance(node, list):
                stack.extend((v, depth + 1) for v in node)
                continue
            if not isinstance(node, dict):
                continue
            props, enum, pattern = node.get("properties"), node.get("enum"), node.get("pattern")
            counts["properties"] += len(props) if isinstance(props, dict) else 0
            counts["enum"] += len(enum) if isinstance(enum, list) else 0
            counts["anyOf"] += sum(len(node[k]) for k in ("anyOf", "oneOf", "allOf") if isinstance(node.get(k), list))
            if isinstance(pattern, str) and len(pattern) > self.regex_chars:
                raise self.over("length of a pattern", len(pattern), self.regex_chars, "max_regex_chars", param)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        for name, limit, lever, what in (("properties", self.properties, "max_properties", "number of object properties"),
                                         ("enum", self.enum_entries, "max_enum_entries", "number of enum entries"),
                                         ("anyOf", self.any_of, "max_any_of", "number of anyOf/oneOf/allOf branches")):
            if counts[name] > limit:
                raise self.over(f"schema's {what}", counts[name], limit, lever, param)


class GrammarBusy(RuntimeError):
    """No compile worker came free within the request's budget (the server answers 503)."""


class GrammarCancelled(RuntimeError):
    """The caller gave up (its client disconnected): the compile was killed."""


_LIBRARY_NOISE = re.compile(r"^\[[\d:.]+\]\s*|\S*/\S+\.(?:cc|cpp|h|hpp):\d+:?\s*")


def library_message(text: str) -> str:
    """xgrammar's message without its log prefix and C++ source path (`[07:18:59] /project/cpp/...cc:820:`)."""
    lines = [ln for ln in (_LIBRARY_NOISE.sub("", ln).strip() for ln in str(text).splitlines()) if ln]
    return lines[-1] if lines else "rejected"


_HEADER = struct.Struct(">I")
_POLL_S = 0.05  # how often a compile's waiter checks for cancellation
STARTUP_S = 120.0  # a worker that is not ready by then (importing xgrammar) is broken


class _Worker:
    """One grammar_worker.py process, started at once (its imports overlap the parent's work)."""

    def __init__(self, info_json: str):
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.join(os.path.dirname(__file__), "grammar_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._send({"info": info_json})
        self.ready = False

    def _send(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.proc.stdin.write(_HEADER.pack(len(body)) + body)
        self.proc.stdin.flush()

    def call(self, job: dict, budget_s: float, cancel: threading.Event | None) -> dict:
        """The worker's reply to `job`; TimeoutError past `budget_s`, counted once the worker is ready
        (its start, imports included, is not the request's doing)."""
        if not self.ready:
            self.ready = self._receive(time.monotonic() + STARTUP_S, cancel).get("ready", False)
        self._send(job)
        return self._receive(time.monotonic() + budget_s, cancel)

    def _receive(self, deadline: float, cancel: threading.Event | None) -> dict:
        fd = self.proc.stdout.fileno()
        while True:
            if cancel is not None and cancel.is_set():
                raise GrammarCancelled("the compile was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], min(left, _POLL_S))
            if ready:
                break
        head = self.proc.stdout.read(_HEADER.size)
        body = self.proc.stdout.read(_HEADER.unpack(head)[0]) if len(head) == _HEADER.size else b""
        if not body:
            raise RuntimeError(f"the grammar compile worker died (exit status {self.proc.poll()})")
        return json.loads(body)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


class CompileWorkers:
    """`n` worker processes; a compile takes one for its duration. A compile past its deadline, or
    cancelled, kills its process (the only way to stop xgrammar's C++) and a fresh one takes its place."""

    def __init__(self, info_json: str, n: int):
        self.info_json = info_json
        self._free: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(n):
            self._free.put(self._start())

    def _start(self) -> _Worker:
        w = _Worker(self.info_json)
        with self._lock:
            self._all.append(w)
        return w

    def _retire(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.remove(w)

    def run(self, job: dict, budget_s: float, cancel: threading.Event | None = None) -> dict:
        """The reply to `job` from a free worker: GrammarBusy when none comes free within `budget_s`,
        TimeoutError when its compile takes longer than `budget_s`."""
        try:
            w = self._free.get(timeout=budget_s)
        except queue.Empty:
            raise GrammarBusy("every grammar compile worker is busy (grammar_compile_workers)") from None
        try:
            reply = w.call(job, budget_s, cancel)
        except BaseException:
            self._retire(w)
            w = None if self._closed else self._start()
            raise
        finally:
            if w is not None:
                self._free.put(w)
        return reply

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._all)
        for w in workers:
            w.kill()


class GrammarCompiler:
    """One per engine: xgrammar's TokenizerInfo over the model's logits width (which may exceed the
    tokenizer's vocabulary: the extra ids are never allowed), the compile worker processes and an
    LRU of compiled grammars (with the constraints that ran out of time, so a repeat is refused at
    once). Thread-safe: the server calls `compile` on worker threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = CACHE_SIZE,
                 limits: GrammarLimits = GrammarLimits()):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.limits = limits
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids))
        self.workers = CompileWorkers(self.info.serialize_json(), limits.workers)
        self._cache: OrderedDict[tuple[str, str], Grammar | str] = OrderedDict()
        self._pending: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def close(self) -> None:
        self.workers.close()

    def compile(self, kind: str, spec: str, param: str = "response_format",
                cancel: threading.Event | None = None) -> Grammar:
        """The Grammar for (kind, spec): json (a JSON schema, as text), json_object (spec ignored),
        regex, choice (a JSON list of strings), grammar (EBNF, GBNF style), structural_tag (an
        xgrammar structural tag as JSON: the server's tool-call grammar). A bad spec, one over a
        limit or one that does not compile within the budget raises InvalidFieldError naming
        `param`; GrammarBusy when no worker came free in time; GrammarCancelled once `cancel` is set."""
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
        if isinstance(hit, str):
            raise InvalidFieldError(hit, param)
        if hit is not None:
            return hit
        self.limits.check(kind, key[1], param)
        while True:  # the same constraint asked for again while it compiles waits for that compile
            with self._lock:
                running = self._pending.get(key)
                if running is None:
                    mine = self._pending[key] = concurrent.futures.Future()
                    break
            while True:
                if cancel is not None and cancel.is_set():
                    raise GrammarCancelled("the compile was cancelled")
                try:
                    return running.result(timeout=_POLL_S)
                except concurrent.futures.TimeoutError:
                    continue
                except GrammarCancelled:
                    break  # its client left: compile it here
                except InvalidFieldError as exc:
                    raise InvalidFieldError(str(exc), param) from None
        try:
            grammar = Grammar(kind, key[1], self._compile(kind, key[1], param, cancel), self.limits.mask_budget_s)
            self._remember(key, grammar)  # before the compile stops being pending: no window for a second one
        except _OverBudget as exc:
            self._remember(key, str(exc))
            mine.set_exception(InvalidFieldError(str(exc), param))
            raise InvalidFieldError(str(exc), param) from None
        except BaseException as exc:
            mine.set_exception(exc if isinstance(exc, (InvalidFieldError, GrammarBusy)) else GrammarCancelled())
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)
        mine.set_result(grammar)
        return grammar

    def _remember(self, key, value) -> None:
        with self._lock:
            self.misses += 1
            self._cache[key] = value
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)

    def _compile(self, kind: str, spec: str, param: str, cancel: threading.Event | None):
        import xgrammar as xgr

        what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
                "grammar": "grammar", "structural_tag": "structural tag"}[kind]
        try:
            if kind == "json":
                schema = json.loads(spec)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object or a boolean")
                spec = json.dumps(bounded_strings(schema))
            elif kind == "choice":
                spec, kind = _choice_ebnf(spec), "grammar"
        except (ValueError, RecursionError) as e:
            raise InvalidFieldError(f"invalid {what}: {library_message(e)}"[:1000], param) from None
        budget = self.limits.compile_timeout_s
        try:
            reply = self.workers.run({"kind": kind, "spec": spec}, budget, cancel)
        except TimeoutError:
            raise _OverBudget(f"the {what} did not compile within this server's budget of {budget:g} s "
                              "(grammar_compile_timeout_s): simplify it") from None
        if "error" in reply:
            raise InvalidFieldError(f"invalid {what}: {library_message(reply['error'])}"[:1000], param)
        return xgr.CompiledGrammar.deserialize_json(reply["ok"], self.info)


class _OverBudget(Exception):
    pass


class BudgetedMatcher:
    """xgrammar's GrammarMatcher, timed: a call (a token mask, or accepting a token) that takes more
    than `budget_s` (grammar_mask_budget_ms) stops the grammar. From then on the mask allows every
    token and accept_token refuses, so the engine finishes the sequence with `failure` as its error
    (an ambiguous grammar's cost grows with every token: it is stopped before it slows the batch)."""

    def __init__(self, matcher, budget_s: float):
        self._m, self.budget_s = matcher, budget_s
        self.failure: str | None = None

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        spent = time.perf_counter() - t0
        if spent > self.budget_s and self.failure is None:
            self.failure = (f"{GRAMMAR_STOPPED}: one step of its grammar took {spent * 1000:.1f} ms, over this "
                            f"server's budget of {self.budget_s * 1000:g} ms (grammar_mask_budget_ms); an ambiguous "
                            "grammar gets slower with every token: make it unambiguous")
        return out

    def accept_token(self, token: int) -> bool:
        return self.failure is None and self._timed(self._m.accept_token, token) and self.failure is None

    def fill_next_token_bitmask(self, mask, index: int = 0) -> None:
        if self.failure is None:
            self._timed(self._m.fill_next_token_bitmask, mask, index)

    def is_terminated(self) -> bool:
        return self.failure is None and self._m.is_terminated()

    def rollback(self, n: int) -> None:
        if self.failure is None:
            self._m.rollback(n)

    def __getattr__(self, name):
        return getattr(self._m, name)


GRAMMAR_STOPPED = "the structured output was stopped"


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
