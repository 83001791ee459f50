"""Decode CUDA graphs never turn themselves off silently (CPU): the replay-vs-eager comparison, a
graph that disagrees or a capture that fails becoming a StartupError that names the batch size (in
DecodeGraphs, through LLMEngine and as `qv serve`'s exit message), and the /metrics gauge that says
whether decode replays graphs. The GPU side is tests/engine/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import contextlib
import logging
import math
import types

import pytest
import torch

from graph_fakes import faithful_pieces
from qv.config import EngineConfig
from qv.engine import cuda_graphs
from qv.engine.cuda_graphs import REPLAY_BOUND, DecodeGraphs, check_replay, replay_error
from qv.engine.step_inputs import StepCapacity, StepInputs
from qv.errors import StartupError
from qv.server.metrics import ServerMetrics


def test_replay_error_is_the_worst_rows_relative_rms():
    eager = torch.randn(64, 512, dtype=torch.bfloat16)
    assert replay_error(eager.clone(), eager) == 0.0
    scaled = eager.float() * 1.01
    assert replay_error(scaled, eager) == pytest.approx(0.01, rel=1e-6)
    one_row = eager.clone()
    one_row[37] = torch.randn(512)  # one wrong row among 64 shows at its own size, not diluted by 63 good ones
    assert replay_error(one_row, eager) > 0.5
    nan = eager.clone()
    nan[3, 7] = float("nan")
    assert replay_error(nan, eager) == math.inf and replay_error(eager, nan) == math.inf


def test_rounding_passes_and_a_real_difference_names_the_batch_size():
    eager = torch.randn(16, 256) * 50  # large values: an absolute per-element tolerance would trip on rounding
    assert check_replay(16, eager.bfloat16().float(), eager.bfloat16().float()) == 0.0
    with pytest.raises(StartupError) as info:
        check_replay(16, eager * (1 + 5 * REPLAY_BOUND), eager)
    message = str(info.value)
    assert "batch-16" in message and "relative error 5.00e-03" in message
    assert "QV_CUDA_GRAPHS=0" in message and "eagerly" in message
    with pytest.raises(StartupError, match="relative error inf"):
        check_replay(16, torch.full_like(eager, float("nan")), eager)


def test_eager_reasons():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cuda_graphs.eager_reason(True, cuda, "triton") is None
    assert "QV_CUDA_GRAPHS=0" in cuda_graphs.eager_reason(False, cuda, "triton")
    assert "CPU" in cuda_graphs.eager_reason(True, cpu, "reference")
    assert "reference" in cuda_graphs.eager_reason(True, cuda, "reference")


class _ToyModel:
    """A forward whose rows depend on every input the check changes (ids, positions, seq_lens)."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.cfg = types.SimpleNamespace(vocab_size=1000)
        self.weight = torch.randn(3, 8)

    kernels_as_captured = staticmethod(contextlib.nullcontext)  # one kernel per op: nothing to choose

    def forward(self, ids, positions, batch, cache):
        rows = torch.stack([ids.float(), positions.float(), batch.attn.seq_lens.float()], dim=1)
        return rows @ self.weight


def _fake_capture(replay_rule):
    """A stand-in for DecodeGraphs._capture_one on CPU: a 'graph' whose replay applies `replay_rule`
    to the eager forward at replay time and at capture time."""

    def capture_one(self, b):
        captured = self._eager(b)
        out = captured.clone()

        def replay():
            out.copy_(replay_rule(self._eager(b), captured))

        self.graphs[b] = (types.SimpleNamespace(replay=replay), out)

    return capture_one


@pytest.fixture
def no_cuda_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _graphs(max_num_seqs=8):
    inputs = StepInputs(StepCapacity(rows=max_num_seqs, seqs=max_num_seqs, blocks=4, k1=1), torch.device("cpu"))
    return DecodeGraphs(_ToyModel(), None, inputs, max_num_seqs, max_model_len=64, scratch_slot=9)


def test_a_faithful_graph_passes_and_is_logged(monkeypatch, no_cuda_sync, caplog):
    monkeypatch.setattr(DecodeGraphs, "_capture_one", _fake_capture(lambda now, captured: now))
    graphs = _graphs()
    with caplog.at_level(logging.INFO, logger="qv"):
        graphs.capture()
    assert graphs.errors == {1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0}
    assert "decode steps replay CUDA graphs for batch sizes 1..8" in caplog.text
    assert int(graphs.seq_lens.max()) == 1 and int(graphs.ids.abs().max()) == 0  # inert again after the check


@pytest.mark.parametrize("rule", [
    lambda now, captured: captured,  # replays what it computed at capture: its inputs were frozen then
    lambda now, captured: now * 1.05,  # replays other arithmetic (a launch shape or host value baked in)
], ids=["frozen-inputs", "other-result"])
def test_a_disagreeing_graph_stops_with_its_batch_size(monkeypatch, no_cuda_sync, rule):
    monkeypatch.setattr(DecodeGraphs, "_capture_one", _fake_capture(rule))
    graphs = _graphs()
    with pytest.raises(StartupError, match=r"batch-1 decode CUDA graph disagrees.*QV_CUDA_GRAPHS=0"):
        graphs.capture()
    assert graphs.graphs == {}


def test_a_failed_capture_stops_with_its_batch_size(monkeypatch, no_cuda_sync):
    def broken(self, b):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_capture_one", broken)
    with pytest.raises(StartupError, match=r"capturing the batch-8 decode CUDA graph failed \(RuntimeError: "
                                           r"operation not permitted.*QV_CUDA_GRAPHS=0"):
        _graphs().capture()


TINY_LEVERS = dict(max_model_len=256, max_num_seqs=4)


def _as_on_a_gpu(monkeypatch, graphs_rule):
    """Engines built from here on capture fake graphs replaying `graphs_rule` (CPU, reference ops)."""
    from qv.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "eager_reason", lambda *a: None)
    monkeypatch.setattr(DecodeGraphs, "_capture_one", _fake_capture(graphs_rule))
    faithful_pieces(monkeypatch)  # steps with prompt rows: qv/engine/piecewise_graphs.py (tests/engine/test_piecewise_graphs.py)


def test_the_engine_does_not_start_on_a_disagreeing_graph(monkeypatch, no_cuda_sync, tiny_engine):
    _as_on_a_gpu(monkeypatch, lambda now, captured: now + 1.0)
    with pytest.raises(StartupError, match=r"batch-1 decode CUDA graph disagrees"):
        tiny_engine(**TINY_LEVERS)


def test_faithful_graphs_decode_as_the_eager_engine(tiny_engine, monkeypatch, no_cuda_sync):
    """The check's inputs are ones the real model takes, and decode steps go through DecodeGraphs.run."""
    from qv import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5 + 9 * i, 20 + 9 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in tiny_engine(**TINY_LEVERS).generate(prompts, params)]
    _as_on_a_gpu(monkeypatch, lambda now, captured: now)
    llm = tiny_engine(**TINY_LEVERS, piecewise_graph_max_rows=512)  # the prefill step replays the stand-in pieces
    assert llm.engine.stats.cuda_graph_sizes == (1, 2, 4)
    replays, run = [], DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, rows: replays.append(rows) or run(self, rows))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == eager
    assert replays == [3] * 5  # every step after the prefill: 3 rows, replayed from the batch-4 graph


def test_the_start_up_check_attends_over_keys(tiny_engine, monkeypatch, no_cuda_sync):
    """The check's sequences attend over pages of seeded random keys (the cache's first blocks, free at start-up),
    not over an all-zero block 0: a graph whose attention read nothing would have passed the check."""
    seen = []
    _as_on_a_gpu(monkeypatch, lambda now, captured: now)
    eager = DecodeGraphs._eager
    monkeypatch.setattr(DecodeGraphs, "_eager", lambda self, b: seen.append(
        (b, self.block_tables[:b].clone(), self.seq_lens[:b].clone())) or eager(self, b))
    llm = tiny_engine(**TINY_LEVERS)
    graphs, cache = llm.engine.runner.graphs, llm.engine.runner.cache
    b, tables, lens = max((s for s in seen if int(s[2].max()) > 1), key=lambda s: s[0])  # the largest size's check
    width = -(-int(lens.max()) // cache.block_size)
    assert tables[:, :width].flatten().tolist() == list(range(b * width))  # each sequence its own pages
    for kv in cache.kv.values():
        assert bool((kv.k[:b * width].flatten(1).abs().sum(-1) > 0).all())  # every page holds keys
        assert not kv.k[b * width:].any()  # and nothing past them
    assert not graphs.block_tables.any() and int(graphs.seq_lens.max()) == 1  # inert again after the check


def test_qv_serve_exits_with_the_message(monkeypatch):
    from qv.engine import async_engine as engine_module
    from qv.server.app import serve

    def failing_engine(cfg):
        check_replay(16, torch.ones(16, 4) * 1.1, torch.ones(16, 4))

    monkeypatch.setattr(engine_module, "AsyncLLMEngine", failing_engine)
    with pytest.raises(SystemExit) as info:
        serve(EngineConfig(port=0))
    assert isinstance(info.value.code, str)  # printed on stderr, exit status 1, no traceback
    assert info.value.code.startswith("qv: the engine did not start: the batch-16 decode CUDA graph disagrees")
    assert "relative error 1.00e-01" in info.value.code and "QV_CUDA_GRAPHS=0" in info.value.code


def test_metrics_say_whether_decode_replays_graphs(tiny_engine, caplog):
    from qv.engine.engine import EngineStats

    def exported(stats) -> dict[str, str]:
        text = ServerMetrics(types.SimpleNamespace(stats=lambda: stats), "m", 256).render().decode()
        return {line.split("{")[0]: line for line in text.splitlines() if line.startswith("qv:")}

    with caplog.at_level(logging.INFO, logger="qv"):
        engine = tiny_engine(max_model_len=256).engine
    assert "decode runs eagerly: the model runs on the CPU" in caplog.text
    on_cpu = exported(engine.stats)
    assert on_cpu["qv:cuda_graphs_enabled"].endswith(" 0.0")
    assert 'batch_sizes=""' in on_cpu["qv:cuda_graphs_info"]
    on_gpu = exported(EngineStats(cuda_graph_sizes=(1, 2, 4)))
    assert on_gpu["qv:cuda_graphs_enabled"].endswith(" 1.0")
    assert 'batch_sizes="1,2,4"' in on_gpu["qv:cuda_graphs_info"]
