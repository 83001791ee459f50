"""Structured outputs in the engine (qv/engine/structured.py): compilation and its cache, bad specs,
the mask on the embedded random-weight model (whose unconstrained output is never valid), batched
beside unconstrained rows that must not change, with async scheduling and speculative decoding."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from qv import LLM, SamplingParams
from qv.engine.request import InvalidFieldError
from qv.engine.structured import grammar_bitmask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "kind"],
          "properties": {"id": {"type": "integer", "minimum": -50, "maximum": 50},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                         "kind": {"enum": ["a", "b", None]}}}


@pytest.fixture(scope="module")
def llms():
    return {m: LLM(model=None, async_scheduling=m, max_num_seqs=8) for m in (False, True)}


def test_compile_cached_and_bad_specs(llms):
    e = llms[False].engine
    spec = json.dumps(SCHEMA)
    g = e.compile_grammar("json", spec)
    assert e.compile_grammar("json", spec) is g and e._grammars.hits >= 1
    assert e._grammars.info.vocab_size == e.model_config.vocab_size > len(e.tokenizer)  # logits width, not tokenizer's
    bad = [("json", "{not json"), ("json", "[1, 2]"), ("json", json.dumps({"type": "nosuchtype"})),
           ("regex", "(unclosed"), ("grammar", "root ::= undefined_rule"), ("choice", "[]"), ("choice", '["a", 3]'),
           ("nosuchkind", "x")]
    for kind, s in bad:
        with pytest.raises(InvalidFieldError) as ei:
            e.compile_grammar(kind, s, param="structured_outputs")
        assert ei.value.param == "structured_outputs" and str(ei.value), (kind, s)
    with pytest.raises(InvalidFieldError):
        SamplingParams(grammar="not a grammar")


def test_mask_forbids_ids_beyond_the_tokenizer(llms):
    e = llms[False].engine
    g = e.compile_grammar("json_object", "")
    v = e.model_config.vocab_size
    mask, rows = grammar_bitmask([None, g.matcher(), None], v, torch.device("cpu"))
    assert rows == [1]
    logits = torch.zeros(3, v)
    from qv.engine.structured import apply_bitmask
    apply_bitmask(logits, (mask, rows))
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < len(e.tokenizer)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


@pytest.mark.parametrize("async_on", [False, True])
def test_json_regex_choice_valid_and_neighbours_unchanged(llms, async_on):
    llm = llms[async_on]
    e = llm.engine
    seed = random.randrange(1 << 30)
    prompts = ["the weather today", "a b c d", "xyz"]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    js = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, n=3, grammar=e.compile_grammar("json", json.dumps(SCHEMA)))
    rx = SamplingParams(temperature=0.8, seed=seed + 1, max_tokens=40, n=2,
                        grammar=e.compile_grammar("regex", r"[a-f]{2,5}-\d{1,3}(\.[0-9]{2})?"))
    ch = SamplingParams(temperature=1.0, seed=seed + 2, max_tokens=40, n=4,
                        grammar=e.compile_grammar("choice", json.dumps(["yes", "no", 'say "hi"\n'])))
    outs = llm.generate(prompts + ["json please", "regex please", "choose"], [plain] * 3 + [js, rx, ch])
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone  # the unconstrained rows are untouched
    for c in outs[3].outputs:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for c in outs[4].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"[a-f]{2,5}-\d{1,3}(\.[0-9]{2})?", c.text), c
    for c in outs[5].outputs:
        assert c.finish_reason == "stop" and c.text in ("yes", "no", 'say "hi"\n'), c


def test_json_object_and_min_tokens(llms):
    llm = llms[True]
    g = llm.engine.compile_grammar("grammar", 'root ::= "{" [a-z]{1,4} "}"')
    outs = llm.generate(["p"], SamplingParams(temperature=1.0, seed=5, max_tokens=20, min_tokens=3, n=3, grammar=g))
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"\{[a-z]{1,4}\}", c.text), c


def test_speculative_engine_gives_constrained_rows_no_drafts():
    """The n-gram proposer would draft the repeated `ab` of the constrained row; unchecked by its
    grammar, such drafts break it (the sequence is aborted with an error), so it must get none."""
    llm = LLM(model=None, spec="ngram", spec_k=3)
    g = llm.engine.compile_grammar("regex", r"(ab){3,6}c")
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(["ab ab ab ab ab ab", "ab ab ab ab"], [plain, SamplingParams(temperature=0.0, max_tokens=30,
                                                                                    grammar=g)])
    assert re.fullmatch(r"(ab){3,6}c", outs[1].outputs[0].text) and outs[1].outputs[0].finish_reason == "stop"
    alone = llm.generate(["ab ab ab ab ab ab"], plain)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
