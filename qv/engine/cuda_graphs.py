"""CUDA graphs for decode steps: the model forward for B one-token rows is captured once per padded
batch size and replayed, so a decode step costs one graph launch instead of a Python walk over
every layer's ops.

Captured graphs read only static buffers, allocated here once and never reallocated. Padding rows
are inert: their KV writes are skipped (slot -1) and their GDN state lives in a scratch slot.
Kernel launch shapes may depend only on values fixed at capture (B, max_query_len 1, max_seq_len =
max_model_len), so the attention kernels early-exit per row on the device's seq_lens.
Every graph is checked against the eager forward at start-up; a mismatch disables graphs.
"""

from __future__ import annotations

import logging

import torch

from qv.model.batch import AttentionMeta, GDNMeta, StepBatch

log = logging.getLogger("qv")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, cache, max_num_seqs: int, max_blocks: int, max_model_len: int, scratch_slot: int):
        self.model, self.cache = model, cache
        self.max_seq_len = max_model_len
        self.scratch_slot = scratch_slot
        self.sizes = [b for b in BUCKETS if b <= max_num_seqs] or [max_num_seqs]
        if self.sizes[-1] < max_num_seqs:
            self.sizes.append(max_num_seqs)
        dev, n = model.device, self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.state_slots = torch.full((n,), scratch_slot, dtype=torch.int64, device=dev)
        self.has_init = torch.zeros(n, dtype=torch.bool, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _batch(self, b: int) -> StepBatch:
        return StepBatch(self.cu[:b + 1], 1,
                         AttentionMeta(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b], self.max_seq_len),
                         GDNMeta(self.state_slots[:b], self.has_init[:b]), self.cu[:b].long())

    def capture(self) -> bool:
        """Capture every size (largest first, sharing one pool); False (graphs off) if any replay
        disagrees with the eager forward on the same inputs."""
        try:
            for b in reversed(self.sizes):
                batch = self._batch(b)
                fwd = lambda: self.model.forward(self.ids[:b], self.positions[:b], batch, self.cache)  # noqa: E731
                self._reset_pad_rows(0)
                fwd()  # warm-up: JIT compiles and one-time host syncs stay out of the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = fwd()
                self.pool = graph.pool()
                self.graphs[b] = (graph, out)
                graph.replay()
                if not torch.allclose(out.float(), fwd().float(), rtol=1e-3, atol=1e-3):
                    raise RuntimeError(f"replay of the batch-{b} decode graph differs from the eager forward")
            torch.cuda.synchronize()
            return True
        except Exception as exc:  # graphs are an optimisation: fall back to eager, loudly
            log.warning("CUDA graphs disabled: %s", exc)
            self.graphs.clear()
            return False

    def _reset_pad_rows(self, start: int) -> None:
        self.slot_mapping[start:] = -1
        self.seq_lens[start:] = 1
        self.state_slots[start:] = self.scratch_slot
        self.has_init[start:] = False
        self.ids[start:] = 0
        self.positions[start:] = 0

    def bucket(self, b: int) -> int | None:
        return next((s for s in self.sizes if s >= b), None) if self.graphs else None

    def run(self, batch: StepBatch, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Replay for a decode batch (every row one token); returns hidden states [B, H]."""
        b = ids.shape[0]
        size = self.bucket(b)
        a = batch.attn
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(a.slot_mapping)
        self.block_tables[:b, :a.block_tables.shape[1]].copy_(a.block_tables)
        self.seq_lens[:b].copy_(a.seq_lens)
        self.state_slots[:b].copy_(batch.gdn.state_slots)
        self.has_init[:b].copy_(batch.gdn.has_initial_state)
        if size > b:
            self._reset_pad_rows(b)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:b]
