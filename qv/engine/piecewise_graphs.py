"""CUDA graphs for steps with prompt rows, in pieces (vLLM's piecewise CUDA graphs): the forward's
token-wise parts (norms, every linear with its low-rank deltas, rotary embedding, the MLPs) are
captured once per padded row count, and only the parts across rows (each layer's attention over the
KV cache, the GDN conv and recurrence, qv/model/qwen3_5.py DecoderLayer.core) run eagerly between
the replays. An eager forward costs ~1.5 ms of host time a layer whatever its rows, so a step of a
few hundred rows at 64 layers was host-bound; replayed, a layer costs its core's launches and one
graph launch.

Piece i (0 < i < L) is layer i-1's after_core and layer i's before_core; piece 0 the embedding and
layer 0's before_core, piece L the last after_core and the final norm. Pieces talk to the eager
cores through static buffers, one set per layer kind ([max rows, ...], outside the graphs' pool):
a piece copies its core inputs and its carry (the gate or z, the residual) into them, the core reads
its rows' part and its output is copied into the kind's core-output buffer that the next piece
captured. So no tensor of the graphs' pool outlives its graph, every piece is self-contained, and
all pieces of every size share one pool (with the decode graphs').

The pieces read the step's own input fields (ids, positions; qv/engine/step_inputs.py) and the
grouped delta rows over its delta fields (every replay launches the grouped deltas; an empty slot
does nothing). A step of n rows replays the smallest size t >= n: rows n..t are padding (StepInputs.pad:
token 0 at position 0) that the token-wise pieces compute and nothing reads.

At start-up every size is checked once as the decode graphs are (qv/engine/cuda_graphs.py): captured on
inert rows, replayed on t rows of sequences from position 0 (their keys in the cache's first blocks,
free then) against the eager forward on the same buffers, same kernels; a disagreement or a failed
capture stops start-up with a StartupError naming the size."""

from __future__ import annotations

import logging

import torch

from qv.engine.cuda_graphs import REPLAY_BOUND, check_replay, replay_error
from qv.engine.step_inputs import StepInputs
from qv.errors import StartupError
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch

log = logging.getLogger("qv")
ROW_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048)
HINT = "QV_PIECEWISE_GRAPH_MAX_ROWS=0 runs steps with prompt rows eagerly"


class PiecewiseGraphs:
    def __init__(self, model, cache, inputs: StepInputs, max_rows: int, scratch_slot: int, deltas: bool = True,
                 pool=None):
        self.model, self.cache, self.inputs = model, cache, inputs
        # the grouped deltas over the step's delta fields (not where deltas stream from host memory: every replay
        # would copy them all)
        self.deltas = deltas and inputs.capacity.delta_slots > 0
        self.layers = model.layers
        cap = inputs.capacity
        self.seq_rows = (cap.blocks - 1) * cache.block_size  # the check's sequences: at most max_model_len each
        max_rows = min(max_rows, cap.rows, cap.seqs * self.seq_rows)
        self.sizes = [t for t in ROW_BUCKETS if t <= max_rows] or [max_rows]
        if self.sizes[-1] < max_rows:
            self.sizes.append(max_rows)
        self.scratch_slot = scratch_slot
        f = inputs.device_fields
        self.ids, self.positions = f["ids"], f["positions"]
        dev, dtype, top = model.device, model.dtype, self.sizes[-1]
        # what each eager core writes and the next piece reads, one per layer kind
        self.core_out = {layer.kind: torch.zeros(top, layer.mixer.core_width, dtype=dtype, device=dev)
                         for layer in self.layers}
        self.buffers: dict[tuple, torch.Tensor] = {}  # (role, kind, index) -> [top, ...]: core inputs, carries
        self.counts: dict[tuple[str, str], int] = {}  # (role, kind) -> how many tensors
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.errors: dict[int, float] = {}
        self.pool = pool

    # -- the pieces ----------------------------------------------------------------------------
    def _delta_rows(self, t: int):
        return self.inputs.graph_delta_rows(t) if self.deltas else None

    @torch.inference_mode()  # as the model's forward (the decode graphs capture that)
    def _piece(self, i: int, t: int) -> None:
        """Piece i over the buffers' first t rows (module docstring)."""
        delta = self._delta_rows(t)
        if i == 0:
            h, residual = self.model.embed(self.ids[:t]), None
        else:
            layer = self.layers[i - 1]
            carry = [self.buffers[("carry", layer.kind, j)][:t] for j in range(self.counts[("carry", layer.kind)])]
            h, residual = layer.after_core(self.core_out[layer.kind][:t], carry, delta)
        if i == len(self.layers):
            self._store(("hidden", "", 0), self.model.final_norm(h, residual), t)
            return
        layer = self.layers[i]
        core_in, carry = layer.before_core(h, residual, self.positions[:t], delta)
        for role, tensors in (("core", core_in), ("carry", carry)):
            self.counts[(role, layer.kind)] = len(tensors)
            for j, x in enumerate(tensors):
                self._store((role, layer.kind, j), x, t)

    def _store(self, key: tuple, x: torch.Tensor, t: int) -> None:
        buf = self.buffers.get(key)
        if buf is None:  # first seen in the eager warm-up of the largest size, outside any capture
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"piecewise graphs: buffer {key} first seen while capturing (a bug)")
            buf = self.buffers[key] = torch.zeros((self.sizes[-1],) + tuple(x.shape[1:]), dtype=x.dtype,
                                                  device=x.device)
        buf[:t].copy_(x)

    @torch.inference_mode()
    def _cores_and_pieces(self, n: int, batch: StepBatch, piece) -> torch.Tensor:
        """The forward of n rows: piece(i) for each piece, each layer's core eagerly between them."""
        piece(0)
        for i, layer in enumerate(self.layers):
            core_in = [self.buffers[("core", layer.kind, j)][:n] for j in range(self.counts[("core", layer.kind)])]
            self.core_out[layer.kind][:n].copy_(layer.core(core_in, batch, self.cache))
            piece(i + 1)
        return self.buffers[("hidden", "", 0)][:n]

    # -- capture and check ---------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every size (largest first: it sizes the buffers), then check each against the eager
        forward. StartupError naming the size where a capture fails or a replay disagrees."""
        with self.model.kernels_as_captured():
            for t in reversed(self.sizes):
                self._guarded(t, "capturing", self._capture_one)
            for t in self.sizes:
                self.errors[t] = self._guarded(t, "checking", self._check)
        log.info("steps with prompt rows replay piecewise CUDA graphs up to %d rows (%d sizes, %d pieces each; "
                 "worst replay vs eager error %.1e)", self.sizes[-1], len(self.sizes), len(self.layers) + 1,
                 max(self.errors.values()))

    def _guarded(self, t: int, what: str, step):
        try:
            return step(t)
        except Exception as exc:  # any failure stops start-up, naming the size: no silent eager fallback
            self.graphs.clear()
            if isinstance(exc, StartupError):
                raise
            raise StartupError(f"{what} the {t}-row piecewise CUDA graphs failed ({type(exc).__name__}: {exc}). "
                               f"{HINT}.") from exc

    def _capture_one(self, t: int) -> None:
        self.ids[:t] = 0  # inert rows, as StepInputs.pad makes them: the check then runs on other inputs
        self.positions[:t] = 0
        if self.deltas:
            self.inputs.device_fields["delta_slot_start"].zero_()  # every slot empty
        graphs = []
        for i in range(len(self.layers) + 1):
            self._piece(i, t)  # warm-up: JIT compiles and one-time host work stay out of the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._piece(i, t)
            self.pool = g.pool()
            graphs.append(g)
        self.graphs[t] = graphs

    def _check_inputs(self, t: int) -> StepBatch:
        """t rows as sequences from position 0 (as long as max_model_len allows) on the step's fields: their
        keys written to the cache's first blocks (free at start-up: no sequence reads a block it did not write),
        so attention runs over real keys, from the pages where the kernel reads them there (an int8 cache);
        GDN states in the scratch slot; token ids other than a capture's zeros."""
        f, dev = self.inputs.device_fields, self.ids.device
        rows = torch.arange(t, device=dev)
        n = -(-t // self.seq_rows)
        cu = torch.arange(n + 1, device=dev, dtype=torch.int32) * self.seq_rows
        cu[-1] = t
        self.ids[:t] = (rows * 7919 + 13) % self.model.cfg.vocab_size
        self.positions[:t] = rows % self.seq_rows
        f["seq_lens"][:n] = (cu[1:] - cu[:-1]).to(f["seq_lens"].dtype)
        f["state_slots"][:n] = self.scratch_slot
        f["has_initial_state"][:n] = False
        bs = self.cache.block_size
        width = -(-min(t, self.seq_rows) // bs)
        f["block_tables"][:n] = 0
        if n * width <= self.cache.num_blocks:
            blocks = torch.arange(n * width, device=dev).view(n, width)
            f["block_tables"][:n, :width] = blocks.to(f["block_tables"].dtype)
            pos = self.positions[:t].long()
            f["slot_mapping"][:t] = blocks[rows // self.seq_rows, pos // bs] * bs + pos % bs
        else:  # a cache too small to hold them (tiny test caches): no KV writes, attention over block 0
            f["slot_mapping"][:t] = -1
        if self.inputs.capacity.delta_slots:
            f["delta_slot_start"].zero_()  # every slot empty
        return StepBatch(cu, min(t, self.seq_rows),
                         AttentionMeta(f["slot_mapping"][:t], f["block_tables"][:n, :width], f["seq_lens"][:n],
                                       min(t, self.seq_rows)),
                         GDNMeta(f["state_slots"][:n], f["has_initial_state"][:n]), cu[1:].long() - 1,
                         delta_rows=self._delta_rows(t))

    def _check(self, t: int) -> float:
        batch = self._check_inputs(t)
        replay = self.run(t, batch).clone()
        eager = self.model.forward(self.ids[:t], self.positions[:t], batch, self.cache)
        torch.cuda.synchronize()
        hint = HINT
        if not replay_error(replay, eager) <= REPLAY_BOUND:
            # only for the message: the same pieces run eagerly tell a capture that replays other work from a split
            # that departs from the forward; each run again, a replay or a forward that is not deterministic
            pieces = self._cores_and_pieces(t, batch, lambda i: self._piece(i, t)).clone()
            again = self.run(t, batch).clone()
            eager_again = self.model.forward(self.ids[:t], self.positions[:t], batch, self.cache)
            hint += (f" (the replay vs the same pieces run eagerly: {replay_error(replay, pieces):.1e}; the replay "
                     f"again vs the first: {replay_error(again, replay):.1e}; the eager forward again vs the first: "
                     f"{replay_error(eager_again, eager):.1e})")
        return check_replay(t, replay, eager, graph=f"{t}-row piecewise graphs", hint=hint)

    # -- steps ---------------------------------------------------------------------------------
    def bucket(self, rows: int) -> int | None:
        return next((t for t in self.sizes if t >= rows), None) if self.graphs else None

    def run(self, n: int, batch: StepBatch) -> torch.Tensor:
        """The forward of a step of n rows whose upload filled the input fields, padded to its size
        (StepInputs.pad), with `batch` its eager StepBatch (the cores'); returns the hidden states [n, H]."""
        graphs = self.graphs[self.bucket(n)]
        return self._cores_and_pieces(n, batch, lambda i: graphs[i].replay())
