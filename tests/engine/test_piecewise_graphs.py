"""Piecewise CUDA graphs (qv/engine/piecewise_graphs.py) on the CPU, with the capture faked by running
each piece eagerly at the captured row count (tests/graph_fakes.py) and the cores' padding rows
poisoned with NaN before every step: the engine's plumbing (which steps replay pieces, their padding,
the buffers between the pieces and the eager cores, the start-up check) against the eager engine.
The real captures run in tests/engine/test_piecewise_graphs_gpu.py."""

from __future__ import annotations

import random

import pytest

from graph_fakes import faithful_pieces
from qv import SamplingParams
from qv.errors import StartupError

LEVERS = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96, long_prefill_token_threshold=40,
              piecewise_graph_max_rows=512)


def _as_on_a_gpu(monkeypatch, rule=None):
    from qv.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "eager_reason", lambda *a: None)
    monkeypatch.setattr("qv.engine.runner.ModelRunner.enable_decode_graphs",
                        lambda self, slot: setattr(self, "scratch_slot", slot))  # decode steps: tested elsewhere
    return faithful_pieces(monkeypatch, rule)


def _prompts(vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (7, 33, 61, 130, 12, 90)]


def test_steps_with_prompt_rows_replay_pieces_and_equal_the_eager_engine(tiny_engine, monkeypatch):
    """Six prompts in 40-token chunks beside decoding ones: every step (none holds more than 96 rows) runs
    the pieces at a padded size, and greedy tokens with their logprobs equal the eager engine's."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    eager_llm = tiny_engine(**LEVERS)
    prompts = _prompts(eager_llm.engine.model_config.vocab_size, seed=11)
    eager = [o.outputs[0] for o in eager_llm.generate(prompts, params)]
    runs = _as_on_a_gpu(monkeypatch)
    llm = tiny_engine(**LEVERS)
    pieces = llm.engine.runner.pieces
    assert pieces is not None and pieces.sizes == [16, 32, 48, 64, 96]
    assert max(pieces.errors.values()) <= 1e-5, pieces.errors
    runs.clear()
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert runs and any(n < t for n, t in runs), runs  # padded steps ran
    assert any(n > 8 for n, _ in runs), "no step with prompt rows replayed the pieces"
    for g, e in zip(got, eager):
        assert g.token_ids == e.token_ids
        for lg, le in zip(g.logprobs, e.logprobs):
            assert lg.keys() == le.keys()
            assert all(abs(lg[k].logprob - le[k].logprob) < 1e-4 for k in lg)


def test_steps_over_the_largest_size_and_lever_off_run_eagerly(tiny_engine, monkeypatch):
    runs = _as_on_a_gpu(monkeypatch)
    llm = tiny_engine(**dict(LEVERS, max_num_batched_tokens=160, long_prefill_token_threshold=160,
                             piecewise_graph_max_rows=64))
    assert llm.engine.runner.pieces.sizes == [16, 32, 48, 64]
    runs.clear()
    vocab = llm.engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": list(range(3, 3 + 150))}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(n <= 64 for n, _ in runs) and len(runs) == 2, runs  # the 150-row prefill ran eagerly
    off = tiny_engine(**{k: v for k, v in LEVERS.items() if k != "piecewise_graph_max_rows"})
    assert off.engine.runner.pieces is None  # off by default
    assert vocab > 150


def test_a_disagreeing_piece_stops_start_up_naming_its_size(tiny_engine, monkeypatch):
    _as_on_a_gpu(monkeypatch, rule=lambda out: out * 1.01)
    with pytest.raises(StartupError, match=r"16-row piecewise graphs.*QV_PIECEWISE_GRAPH_MAX_ROWS=0 .*"
                       r"the replay vs the same pieces run eagerly: 1\.0e-02; the replay again vs the first: "
                       r"0\.0e\+00; the eager forward again vs the first: 0\.0e\+00"):  # the capture, not the split
        tiny_engine(**LEVERS)


def test_a_step_target_fills_the_rows_up_to_the_graphs_size(tiny_engine, monkeypatch):
    """Under a target no step meets (each waiting prompt gets the 16-token floor), a long prompt beside a
    decoding chat takes the rest of its step's padded size: 1 decode row + 16 floor tokens would replay
    the 32-row graphs with 15 rows of padding, so the prompt takes 31 tokens; only its last chunk pads."""
    runs = _as_on_a_gpu(monkeypatch)
    llm = tiny_engine(**dict(LEVERS, max_step_ms=1e-3, prefix_caching=False))
    eng = llm.engine
    assert eng.scheduler.row_buckets == (16, 32, 48, 64, 96)
    eng.add_request("chat", [5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()  # the chat's prompt
    runs.clear()
    eng.add_request("long", list(range(3, 3 + 200)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not any(o.request_id == "long" and o.finished for o in eng.step()):
        pass
    mixed = [(n, t) for n, t in runs if n > 1]
    assert sum(n - 1 for n, _ in mixed) == 200, mixed  # every prompt token, one decode row a step beside them
    assert all(n == t == 32 for n, t in mixed[:-1]) and mixed[-1][0] <= 32, mixed


def test_the_start_up_check_attends_over_keys_it_wrote(tiny_engine, monkeypatch):
    """The check's sequences write their keys to the cache's first blocks (free at start-up), so attention runs
    over real keys, from the pages where a kernel reads them there (an int8 cache), not over an empty block 0."""
    _as_on_a_gpu(monkeypatch)
    llm = tiny_engine(**LEVERS)
    cache = llm.engine.runner.cache
    used = -(-llm.engine.runner.pieces.sizes[-1] // cache.block_size)  # the largest size's blocks (one sequence)
    for kv in cache.kv.values():
        written = kv.k[:used].flatten(1).abs().sum(-1)
        assert bool((written > 0).all()), written  # every block of the largest check holds keys
        assert not kv.k[used:].any()  # and nothing past them
