"""`qv validate` on the tiny fixtures: every gate is shown to detect failure, not only to pass.

- The fitted tiny model (preset `spec`, MTP head self-distilled: tests/spec/conftest.py) passes the
  retrieval gate and MTP acceptance; a random-weight model with an MTP head fails both. The tiny
  models cannot remember anything across a filler (their greedy output follows the last token), so
  on the fitted model the planted word is the text it has learned to say after the question: this
  shows the gate's plumbing (a filler prompt, chunked prefill, the verbatim check) passing and
  failing, not long-context memory, which only real weights can show.
- A kernel perturbed through a test-only hook (monkeypatching `qv.kernels.sigmoid_mul`, which every
  attention layer calls) fails the reference gate, and `qv validate` names it and exits 1.
- Gates a model cannot take are skipped by name with the reason; `--json` holds every result.
"""

from __future__ import annotations

import json

import pytest

from qv.bench.validate import ValidateOptions, table, validate
from qv.bench.validate_texts import code_word_probe
from qv.cli import main

RETRIEVAL_TOKENS = 200  # through chunked prefill at the budget below
LEVERS = {"max_model_len": 1024, "max_num_batched_tokens": 64}


def run(model_dir, *gates, **options):
    options.setdefault("levers", LEVERS)
    header, results = validate(str(model_dir), ValidateOptions(gates=gates, retrieval_tokens=RETRIEVAL_TOKENS,
                                                               **options), log=lambda *_: None)
    print("\n" + table(header, results))
    return {r.gate: r for r in results}


@pytest.fixture(scope="module")
def learned_word(fitted_dir):
    """The text the fitted model says after the code-word question, whatever word was planted."""
    from qv import LLM, SamplingParams

    llm = LLM(model=fitted_dir, **LEVERS)
    probe = code_word_probe(llm.tokenizer, RETRIEVAL_TOKENS, "00000")
    out = llm.generate({"prompt_token_ids": probe.prompt_ids}, SamplingParams(temperature=0, max_tokens=3))
    word = out[0].outputs[0].text
    assert word.strip(), "the fitted model says nothing after the question"
    return word


def test_fitted_model_passes_retrieval_and_acceptance(fitted_dir, learned_word):
    gates = run(fitted_dir, "retrieval", "speculation", "repeatability", code_word=learned_word, min_acceptance=2.0)
    assert gates["retrieval"].status == "pass", gates["retrieval"]
    assert gates["retrieval"].values["tokens"] >= RETRIEVAL_TOKENS - 1
    assert gates["speculation"].status == "pass", gates["speculation"]
    assert gates["speculation"].values["greedy_equal"] and gates["speculation"].values["acceptance_length"] >= 2.0
    assert gates["repeatability"].status == "pass"


def test_random_model_fails_retrieval_and_acceptance(tiny_dirs, learned_word):
    random_dir = tiny_dirs("tiny", 1, True)  # random weights, with an (unfitted) MTP head
    gates = run(random_dir, "retrieval", "retrieval_depth", "speculation", code_word=learned_word,
                min_acceptance=2.0)
    for name in ("retrieval", "retrieval_depth", "speculation"):
        assert gates[name].status == "fail", gates[name]
    assert gates["speculation"].values["greedy_equal"]  # exact anyway: only the acceptance misses
    assert gates["speculation"].values["acceptance_length"] < 2.0


def test_perturbed_kernel_fails_the_reference_gate(tiny_dirs, monkeypatch, capsys, tmp_path):
    """The same folder passes, then fails once the attention output gate is off by 1% (test-only hook)."""
    import qv.kernels as K

    folder = tiny_dirs("tiny")
    clean = run(folder, "reference")["reference"]
    assert clean.status == "pass" and clean.values["max_abs_dlogp"] < 1e-4, clean
    exact = K.sigmoid_mul
    monkeypatch.setattr(K, "sigmoid_mul", lambda o, gate: exact(o, gate) * 1.01)
    out_json = tmp_path / "validate.json"
    status = main(["validate", str(folder), "--gates", "reference,repeatability", "--json", str(out_json),
                   "--max-model-len", "1024"])
    printed = capsys.readouterr().out
    assert status == 1
    assert "| reference | FAIL |" in printed and "FAILED: reference" in printed
    record = json.loads(out_json.read_text())
    assert record["failed"] == ["reference"]
    gate = {g["gate"]: g for g in record["gates"]}
    assert gate["reference"]["values"]["max_abs_dlogp"] > 1e-3 and gate["repeatability"]["status"] == "pass"


def test_gates_a_model_cannot_take_are_skipped_by_name(tiny_dirs, capsys):
    status = main(["validate", str(tiny_dirs("tiny")), "--gates", "speculation,clef", "--max-model-len", "1024"])
    printed = capsys.readouterr().out
    assert status == 0  # a skip is no failure
    assert "| speculation | SKIP |" in printed and "no MTP head" in printed
    assert "| clef | SKIP |" in printed and "no Clef head" in printed


def test_unknown_gate_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="unknown gates"):
        validate(str(tiny_dirs("tiny")), ValidateOptions(gates=("reference", "vibes")))


@pytest.mark.gpu
def test_validate_on_the_gpu(fitted_dir, learned_word, tmp_path):
    """The whole command on a GPU at its default dtype (bf16 on sm_80+): the reference gate under the 16-bit
    bound, speculation through the verification graphs, repeatability with CUDA graphs, the speed rows."""
    gates = run(fitted_dir, "reference", "retrieval", "speculation", "repeatability", "speed", code_word=learned_word,
                min_acceptance=2.0, speed_prefill=256, levers={**LEVERS, "device": "cuda"})
    assert not [g for g in gates.values() if g.status == "fail"], gates
    assert gates["speed"].status == "info" and len(gates["speed"].values["rows"]) == 2
