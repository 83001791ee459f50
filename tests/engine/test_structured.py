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

from qv import SamplingParams
from qv.engine.request import InvalidFieldError
from qv.engine.structured import grammar_bitmask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "kind"],
          "properties": {"id": {"type": "integer", "minimum": -50, "maximum": 50},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                         "kind": {"enum": ["a", "b", None]}}}


@pytest.fixture(scope="module")
def llms(tiny_engine):
    return {m: tiny_engine(model=None, async_scheduling=m, max_num_seqs=8) for m in (False, True)}


def test_compile_cached_and_bad_specs(llms):
    e = llms[False].engine
    spec = json.dumps(SCHEMA)
    g = e.compile_grammar("json", spec)
    assert e.compile_grammar("json", spec) is g and e.structured.compiler.hits >= 1
    assert e.structured.compiler.info.vocab_size == e.model_config.vocab_size > len(e.tokenizer)  # logits width, not tokenizer's
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
    mask, rows = grammar_bitmask([(None, []), (g.matcher(), []), (None, [])], v, torch.device("cpu"))
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


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_of_constrained_rows_are_checked_by_the_grammar(tiny_engine, temperature):
    """Constrained rows verify drafts, each verification row masked as the grammar stands after the drafts
    before it: with n-gram drafts of the repeated `ab` (which would break the grammar past six) and with
    spare drafts that are always wrong, greedy outputs equal decoding without speculation token for token,
    and sampled ones (another random stream: equal in distribution, tests/spec/test_spec_distribution.py)
    match the grammar."""
    prompts = ["ab ab ab ab", "ab ab ab ab ab ab ab ab"]
    regex = r"(ab){3,6}c"

    def run(**levers):
        llm = tiny_engine(model=None, max_num_seqs=4, **levers)
        g = llm.engine.compile_grammar("regex", regex)
        params = [SamplingParams(temperature=temperature, max_tokens=30, grammar=g, seed=7 + i) for i in range(2)]
        return [o.outputs[0] for o in llm.generate(prompts, params)], llm

    base, _ = run()
    for levers in ({"spec": "ngram", "spec_k": 3, "spec_policy": "always"}, {"spec": "ngram", "spec_k": 2}):
        outs, llm = run(**levers)
        if temperature == 0:
            assert [o.token_ids for o in outs] == [o.token_ids for o in base], levers
        assert all(re.fullmatch(regex, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert llm.engine.spec.stats.num_drafts > 0  # the n-gram source drafted for the constrained rows
