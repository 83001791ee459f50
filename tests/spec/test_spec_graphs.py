"""The plumbing of speculative decoding's CUDA graphs, on the CPU: the verification graphs (k+1 rows a
sequence) and the MTP head's graphs (catch-up, the k-step walk) read only their static buffers, so a
stand-in 'graph' that reruns the captured function on those buffers at replay time behaves as a real one
would. Greedy outputs through them equal speculation off; decode-only steps go through the graphs.
(On the GPU, tests/engine/test_cuda_graphs_gpu.py captures real graphs.)"""

from __future__ import annotations

import random
import types

import pytest
import torch

from graph_fakes import faithful_pieces
from qv import SamplingParams
from qv.engine import engine as engine_module
from qv.engine.cuda_graphs import DecodeGraphs
from qv.engine.step_inputs import StepCapacity, StepInputs
from tests.spec.test_spec_engine import CYCLE, model_list


def _stand_in_capture(self, b):
    """DecodeGraphs._capture_one without CUDA: each "graph" reruns its function on the input fields it captured."""
    out = self._eager(b).clone()
    self.graphs[b] = (types.SimpleNamespace(replay=lambda: out.copy_(self._eager(b))), out)
    for kind in self.mtp_kinds(b):
        made = self._eager_mtp(b, kind)
        drafts = None if made is None else made.clone()

        def replay(kind=kind, drafts=drafts):
            fresh = self._eager_mtp(b, kind)
            if drafts is not None:
                drafts.copy_(fresh)

        self.mtp_graphs[(b, kind)] = (types.SimpleNamespace(replay=replay), drafts)
    if self.q > 1:
        self.commit_graphs[b] = types.SimpleNamespace(replay=lambda: self._eager_commit(b))


@pytest.fixture
def stand_in_graphs(monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "_capture_one", _stand_in_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(engine_module, "eager_reason", lambda *a: None)
    faithful_pieces(monkeypatch)  # prompt steps replay the piecewise graphs' stand-ins (MTP head after them eager)
    calls = {"decode": 0, "verify": 0, "draft": 0, "catch_up": 0, "commit": 0}
    run, run_mtp, run_commit = DecodeGraphs.run, DecodeGraphs.run_mtp, DecodeGraphs.run_commit

    def counted_run(self, *a):
        calls["decode" if self.q == 1 else "verify"] += 1
        return run(self, *a)

    def counted_mtp(self, kind, *a):
        calls[kind] += 1
        return run_mtp(self, kind, *a)

    def counted_commit(self, *a):
        calls["commit"] += 1
        return run_commit(self, *a)

    monkeypatch.setattr(DecodeGraphs, "run_commit", counted_commit)
    monkeypatch.setattr(DecodeGraphs, "run", counted_run)
    monkeypatch.setattr(DecodeGraphs, "run_mtp", counted_mtp)
    return calls


@pytest.mark.parametrize("mode,policy", [("mtp", "backoff"), ("mtp", "always"), ("ngram", "backoff")])
def test_graphs_replay_speculation_greedy_identical(tiny_engine, fitted_dir, stand_in_graphs, mode, policy):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": model_list(rng.randrange(4, 15), rng.randrange(CYCLE)) * 2} for _ in range(3)]
    prompts += [{"prompt_token_ids": [rng.randrange(300) for _ in range(n)]} for n in (5, 11)]
    params = [SamplingParams(temperature=0, max_tokens=20 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    base = [o.outputs[0].token_ids for o in tiny_engine(model=fitted_dir, cuda_graphs=False).generate(prompts, params)]
    llm = tiny_engine(model=fitted_dir, spec=mode, spec_k=3, spec_policy=policy, max_num_seqs=8, spec_max_seqs=8,
                      piecewise_graph_max_rows=512)
    assert llm.engine.runner.verify_graphs is not None
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs == base
    calls = stand_in_graphs
    assert calls["decode"] and calls["verify"] and calls["commit"] == calls["verify"], calls
    if mode == "mtp":
        assert calls["draft"] >= calls["verify"], calls  # every verified decode step drafts in its graph
        assert llm.engine.spec.stats.num_accepted_tokens > 0


def test_backed_off_sequences_catch_up_only(tiny_engine, fitted_dir, stand_in_graphs):
    """Random prompts the fitted head mostly misses: once every sequence has backed off, steps replay
    the plain decode graph with the head's catch-up alone (no walk); drafts come back on the probes."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(300) for _ in range(7)]} for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in tiny_engine(model=fitted_dir, cuda_graphs=False).generate(prompts, params)]
    llm = tiny_engine(model=fitted_dir, spec="mtp", spec_k=3, max_num_seqs=4, spec_max_seqs=4)
    wrong = llm.engine.model_config.vocab_size - 1  # a padding id: never the greedy token
    llm.engine.spec.head.draft_ids = lambda out: torch.full(out.shape[:1], wrong, dtype=torch.int64)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs == base
    calls, stats = stand_in_graphs, llm.engine.spec.stats
    assert calls["catch_up"] > calls["verify"], calls
    # bounded: over 120 tokens a sequence drafts 4 times, then once after each pause of 4, 8, 16, 32 steps
    assert stats.num_accepted_tokens <= 2 and 0 < stats.num_drafts <= 2 * 8, stats


def test_every_batch_that_can_verify_has_a_draft_graph():
    """With spec_max_seqs between two graph sizes, the larger size (where 5 or 6 sequences pad to 8) still
    holds the draft graph; sizes past it hold the catch-up alone."""
    spec = types.SimpleNamespace(uses_mtp=True, max_seqs=6)
    inputs = StepInputs(StepCapacity(rows=16, seqs=16, blocks=4, k1=1), torch.device("cpu"))
    graphs = DecodeGraphs(types.SimpleNamespace(device=torch.device("cpu")), None, inputs, 16, max_model_len=64,
                          scratch_slot=9, spec=spec)
    assert graphs.sizes == [1, 2, 4, 8, 16]
    assert [graphs.mtp_kinds(b) for b in graphs.sizes] == [("draft", "catch_up")] * 4 + [("catch_up",)]
