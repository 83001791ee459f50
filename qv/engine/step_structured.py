"""Structured outputs as a step feature (qv/engine/step_feature.py): the grammar compiler, built on
first use (LLMEngine.compile_grammar), each constrained sequence's matcher, kept here and weakly keyed
by its Sequence, the token bitmask rows of a step's sampling settings, and the end of a sequence when
its grammar ends. The grammars themselves: qv/engine/structured.py."""

from __future__ import annotations

import threading
import weakref

from qv.engine.step_feature import StepFeature
from qv.engine.structured import Grammar, GrammarCompiler, GrammarLimits, grammar_bitmask


class StructuredOutputs(StepFeature):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, limits: GrammarLimits):
        self._compiler_args = (tokenizer, vocab_size, eos_token_ids)
        self.limits = limits
        self.compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self.matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> BudgetedMatcher

    def compile(self, kind: str, spec: str, param: str, cancel=None) -> Grammar:
        """LLMEngine.compile_grammar: thread-safe, cached per (kind, spec)."""
        with self._lock:
            if self.compiler is None:
                self.compiler = GrammarCompiler(*self._compiler_args, limits=self.limits)
        return self.compiler.compile(kind, spec, param, cancel)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()

    def add(self, seq, grammar: Grammar | None) -> None:
        """A new sequence of a request whose params carry `grammar` (None: unconstrained)."""
        if grammar is not None:
            self.matchers[seq] = grammar.matcher()

    def constrains(self, seq) -> bool:
        return seq in self.matchers

    def bitmask(self, rows, vocab_size: int, device):
        """The sampling rows' grammar masks (sampler.apply_grammar), or None when no row is constrained:
        row (seq, j) of a verified sequence is masked as its grammar stands after its first j drafts."""
        if not any(s in self.matchers for s, _ in rows):
            return None
        return grammar_bitmask([(self.matchers.get(s), s.drafts.tokens[:j]) for s, j in rows], vocab_size, device)

    def on_token(self, seq, token_id: int, scheduler) -> bool:
        """Advance the sequence's matcher; True when that finished it: a token outside the grammar (a bug:
        the mask allowed only tokens it accepts) aborts it, the grammar's end stops it."""
        matcher = self.matchers.get(seq)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            scheduler.finish(seq, "abort", error=matcher.failure
                             or f"token {token_id} is outside the request's grammar (a qv bug)")
            return True
        if matcher.is_terminated():  # it took a stop token where the grammar is complete
            scheduler.finish(seq, "stop")
            return True
        return False
