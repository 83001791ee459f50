"""LLMEngine.warm_up (start-up's dummy requests on a GPU, so the first real requests meet no kernel compile):
it leaves no trace. Run here on the CPU by calling it directly (the engine calls it only on CUDA)."""

from __future__ import annotations

import logging

from qv import SamplingParams


def test_warm_up_leaves_no_trace(tiny_engine, caplog):
    """After warm_up, outputs (seeded and unseeded: the engine's own random stream), statistics, the prefix
    cache and the step cost model are those of an engine that never ran it."""
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2),  # unseeded: the engine's stream
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True)]
    levers = dict(max_model_len=512, max_num_batched_tokens=512, seed=3, gdn_snapshot_interval=16)  # hits at 16 tokens
    cold = tiny_engine(**levers)
    words = cold.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)
    prompts = [{"prompt_token_ids": (words * 40)[:40]}] * len(params)  # the dummy prompts' start: a prefix they'd leave
    assert cold.engine.stats.prompt_tokens == 0  # not on a CPU: the lever acts on CUDA only
    cold_out = cold.generate(prompts, params)

    warm = tiny_engine(**levers)
    with caplog.at_level(logging.INFO, logger="qv"):
        warm.engine.warm_up()
    assert "warmed up: 5 dummy requests of [13, 29, 61, 300, 1100] prompt tokens" not in caplog.text  # 1,100 > 512
    assert "warmed up: 4 dummy requests of [13, 29, 61, 300] prompt tokens and one under a JSON grammar" in caplog.text
    eng = warm.engine
    assert eng.structured.compiler is not None  # the grammar request ran: its compiler's workers are up
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.stats.prompt_tokens == 0 and eng.stats.generation_tokens == 0
    assert eng.stats.prefix_cache_queries == 0 and eng.stats.prefix_cache_hits == 0
    assert eng.step_timer.model.num_steps == 0 and eng.step_timer.model.cost == eng.step_timer.model.prior
    warm_out = warm.generate(prompts, params)
    for c, w in zip(cold_out, warm_out):
        assert [o.token_ids for o in c.outputs] == [o.token_ids for o in w.outputs]
        assert c.num_cached_tokens == w.num_cached_tokens  # no prefix of the dummy prompts was kept


def test_warm_up_forgets_its_drafts(tiny_engine):
    """With speculative decoding the dummy requests draft and verify; the counters start from zero after."""
    llm = tiny_engine(mtp=True, spec="mtp", max_model_len=512, max_num_batched_tokens=512)
    llm.engine.warm_up()
    s = llm.engine.stats
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (0, 0, 0)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.engine.stats.spec_num_drafts > 0  # the counters still count


def test_warm_up_without_a_grammar_compiler_still_warms_the_rest(tiny_engine, monkeypatch, caplog):
    """A grammar compile that fails at warm-up (here: its worker processes cannot start) is logged and skipped:
    the engine still warms up and serves unconstrained requests."""
    llm = tiny_engine(max_model_len=512, max_num_batched_tokens=512)
    eng = llm.engine

    def broken(*args, **kwargs):
        raise OSError("no processes here")

    monkeypatch.setattr(eng.structured, "compile", broken)
    with caplog.at_level(logging.INFO, logger="qv"):
        eng.warm_up()
    assert "warm-up: no grammar-constrained request (OSError: no processes here)" in caplog.text
    assert "warmed up: 4 dummy requests of [13, 29, 61, 300] prompt tokens in" in caplog.text
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
