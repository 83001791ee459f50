"""Stand-ins for CUDA graph capture on the CPU, so the graphs' plumbing (buffers, padding, which steps
replay) runs in CI: a fake piecewise 'graph' replays by running its piece eagerly at the captured row
count, which is what a faithful capture replays. Padding rows of the cores' outputs are poisoned with
NaN before every step, so a real row that reads one shows."""

from __future__ import annotations

import types

import torch

from qv.engine.piecewise_graphs import PiecewiseGraphs


def faithful_pieces(monkeypatch, rule=None) -> list[tuple[int, int]]:
    """Patch PiecewiseGraphs so that capture makes fake graphs (rule(piece output) applied to the final
    hidden buffer at replay: a disagreeing graph) and run poisons the padding first. Returns the list
    that (rows, size) of every replayed step is appended to."""
    runs: list[tuple[int, int]] = []

    def capture_one(self, t):
        def piece(i):
            self._piece(i, t)
            if rule is not None and i == len(self.layers):
                out = self.buffers[("hidden", "", 0)][:t]
                out.copy_(rule(out))

        for i in range(len(self.layers) + 1):  # sizes the buffers, as the warm-up does
            self._piece(i, t)
        self.graphs[t] = [types.SimpleNamespace(replay=lambda i=i: piece(i)) for i in range(len(self.layers) + 1)]

    run = PiecewiseGraphs.run

    def poisoned_run(self, n, batch):
        t = self.bucket(n)
        for buf in self.core_out.values():
            buf[n:t] = float("nan")
        runs.append((n, t))
        return run(self, n, batch)

    monkeypatch.setattr(PiecewiseGraphs, "_capture_one", capture_one)
    monkeypatch.setattr(PiecewiseGraphs, "run", poisoned_run)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return runs
