"""CUDA graphs for decode steps: the model forward for B one-token rows is captured once per padded
batch size and replayed, so a decode step costs one graph launch instead of a Python walk over
every layer's ops.

Captured graphs read the step's own input fields (qv/engine/step_inputs.py: persistent device
buffers, never reallocated), so a replay copies nothing in: the step's upload has already written
them, padded to the graph's size with inert rows (StepInputs.pad: KV writes skipped with slot -1,
GDN state in a scratch slot). The few tensors made on the device after the forward (the MTP head's
draft rows, verification's accepted counts) are copied into the graph's own buffers. Kernel launch
shapes may depend only on values fixed at capture (B, max_query_len 1, max_seq_len = max_model_len),
so the attention kernels early-exit per row on the device's seq_lens.

At start-up, once every size is captured, each graph is replayed on inputs other than the capture's
(token ids, positions, per-row seq_lens; the sequences' pages hold seeded random keys, written to the
cache's first blocks while they are free) and compared with the eager forward on the same buffers,
run with the same kernels (the model's kernels_as_captured: eagerly, small calls would otherwise
take their Triton twins, whose rounding differs). A graph that disagrees, or a capture that fails,
stops start-up with a StartupError naming the batch size; QV_CUDA_GRAPHS=0 runs decode eagerly
instead. Graphs never turn themselves off silently.
"""

from __future__ import annotations

import logging
import math

import torch

from qv.errors import StartupError
from qv.engine.step_inputs import StepInputs
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch

log = logging.getLogger("qv")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# the same kernels on the same inputs agree but for reduction order (every split-K sum runs in split order,
# so bit for bit); a launch shape, pointer or host value frozen at capture moves whole rows by O(1)
REPLAY_BOUND = 1e-3
EAGER_HINT = "QV_CUDA_GRAPHS=0 (qv serve --cuda-graphs 0) runs decode eagerly"


def replay_error(replay: torch.Tensor, eager: torch.Tensor) -> float:
    """The worst row's ||replay - eager|| / ||eager|| in float64 (inf if either holds NaN or inf). Relative
    RMS rather than allclose: one number that scales with the rows' size, where a fixed per-element
    atol/rtol trips on bf16 rounding of outliers and of near-zero elements. Per row, so one wrong row
    among 256 still shows."""
    r, e = replay.double().flatten(1), eager.double().flatten(1)
    if r.shape != e.shape or not (torch.isfinite(r).all() and torch.isfinite(e).all()):
        return math.inf
    if r.numel() == 0:
        return 0.0
    return ((r - e).norm(dim=1) / e.norm(dim=1).clamp_min(1e-30)).max().item()


def check_replay(b: int, replay: torch.Tensor, eager: torch.Tensor, bound: float = REPLAY_BOUND,
                 graph: str = "", hint: str = EAGER_HINT) -> float:
    """The replay_error of a graph (by default the batch-b decode graph; `graph` names another); StartupError
    (naming it and the error) above `bound`."""
    err = replay_error(replay, eager)
    if not err <= bound:
        raise StartupError(
            f"the {graph or f'batch-{b} decode CUDA graph'} disagrees with the eager forward on the same kernels "
            f"(worst row's relative error {err:.2e} > {bound:.0e}): a kernel replays something other than what it "
            f"ran when captured. {hint}.")
    return err


def eager_reason(enabled: bool, device: torch.device, backend: str) -> str | None:
    """Why decode steps run eagerly, or None where they replay CUDA graphs."""
    if not enabled:
        return "cuda_graphs is off (QV_CUDA_GRAPHS=0)"
    if device.type != "cuda":
        return f"the model runs on the {device.type.upper()}, not a CUDA GPU"
    if backend == "reference":
        return "the reference kernels (QV_KERNELS=reference) are not captured"
    return None


class DecodeGraphs:
    """The graphs of one row shape: `rows_per_seq` 1 (plain decode) or k+1 (verification of k drafts, with
    the speculator's per-position GDN states), one per padded batch size. With an MTP speculator, each
    size also holds the head's work after the forward ("draft": catch-up plus the k-step walk; for plain
    decode also "catch_up" alone), replayed on the forward's output states."""

    def __init__(self, model, cache, inputs: StepInputs, max_num_seqs: int, max_model_len: int, scratch_slot: int,
                 rows_per_seq: int = 1, spec=None, pool=None):
        self.model, self.cache, self.spec = model, cache, spec
        self.q = rows_per_seq
        self.max_seq_len = max_model_len
        self.scratch_slot = scratch_slot
        # no step holds more sequences than its rows allow (a token budget below max_num_seqs caps a decode step)
        max_num_seqs = min(max_num_seqs, inputs.capacity.rows // self.q, inputs.capacity.seqs)
        self.sizes = [b for b in BUCKETS if b <= max_num_seqs] or [max_num_seqs]
        if self.sizes[-1] < max_num_seqs:
            self.sizes.append(max_num_seqs)
        dev, n = model.device, self.sizes[-1]
        t = n * self.q
        # the step's input fields, whole: each size's graph reads their first b sequences' part
        f = inputs.device_fields
        self.ids, self.positions, self.slot_mapping, self.next_ids = f["ids"], f["positions"], f["slot_mapping"], \
            f["next_ids"]
        self.block_tables, self.seq_lens = f["block_tables"], f["seq_lens"]
        self.state_slots, self.has_init = f["state_slots"], f["has_initial_state"]
        # the graph's constants: every sequence runs q rows, each of them with logits where q > 1
        self.cu = torch.arange(0, t + 1, self.q, dtype=torch.int32, device=dev)
        self.rows = torch.arange(t, device=dev)
        self.no_rest = torch.zeros(1, dtype=torch.int32, device=dev)
        # made on the device after the forward: each drafting sequence's last valid row, verification's counts
        self.draft_rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.draft_valid = torch.zeros(n, dtype=torch.bool, device=dev)
        self.num_accepted = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # verification: the GDN state commit
        self.mtp_graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.errors: dict[int, float] = {}  # batch size -> replay_error at the start-up check
        self.pool = pool
        self.inputs = inputs  # with LoRA's delta slots, every graph launches the grouped deltas over its fields

    @property
    def label(self) -> str:
        return "decode" if self.q == 1 else f"verification ({self.q} rows a sequence)"

    def _batch(self, b: int) -> StepBatch:
        t = b * self.q
        if self.q == 1:
            gdn = GDNMeta(self.state_slots[:b], self.has_init[:b])
        else:  # every sequence verifies: its rows keep per-position GDN states, none are left over
            gdn = self.spec.gdn_meta(self.state_slots[:b], self.has_init[:b], b, t, self.no_rest)
        return StepBatch(self.cu[:b + 1], self.q,
                         AttentionMeta(self.slot_mapping[:t], self.block_tables[:b], self.seq_lens[:b], self.max_seq_len),
                         gdn, self.rows[:t] if self.q > 1 else self.cu[:b].long(),
                         delta_rows=self.inputs.graph_delta_rows(t, decode=True))

    def mtp_kinds(self, b: int) -> tuple[str, ...]:
        """The head's graphs size b holds: "draft" where a batch that can verify next step (at most
        spec.max_seqs sequences) pads up to b, "catch_up" for plain decode."""
        if self.spec is None or not self.spec.uses_mtp:
            return ()
        i = self.sizes.index(b)
        drafting = i == 0 or self.sizes[i - 1] < self.spec.max_seqs
        return (("draft",) if drafting else ()) + (("catch_up",) if self.q == 1 else ())

    def capture(self) -> None:
        """Capture every size (largest first, sharing one pool), then check each replay against the eager
        forward (after all captures, so one capture overwriting memory another graph holds shows too).
        Raises StartupError naming the batch size where a capture fails or a replay disagrees."""
        with self.model.kernels_as_captured():  # the warm-ups and the checks run what the captures run
            for b in reversed(self.sizes):
                self._guarded(b, "capturing", self._capture_one)
            self._write_check_keys()
            for b in self.sizes:
                self.errors[b] = self._guarded(b, "checking", self._check)
        log.info("%s steps replay CUDA graphs for batch sizes 1..%d (%s; worst replay vs eager error %.1e)%s",
                 self.label, self.sizes[-1], ", ".join(map(str, self.sizes)), max(self.errors.values()),
                 ", the MTP head's drafts too" if self.mtp_graphs else "")

    def _guarded(self, b: int, what: str, step):
        try:
            return step(b)
        except Exception as exc:  # any failure stops start-up, naming the size: no silent eager fallback
            self.graphs.clear()
            self.mtp_graphs.clear()
            self.commit_graphs.clear()
            if isinstance(exc, StartupError):
                raise
            raise StartupError(f"{what} the batch-{b} {self.label} CUDA graph failed ({type(exc).__name__}: {exc}). "
                               f"{EAGER_HINT}.") from exc

    def _eager(self, b: int) -> torch.Tensor:
        return self.model.forward(self.ids[:b * self.q], self.positions[:b * self.q], self._batch(b), self.cache)

    def _eager_mtp(self, b: int, kind: str) -> torch.Tensor | None:
        """The head's work on the batch-b forward graph's output states."""
        t, hidden = b * self.q, self.graphs[b][1]
        out = self.spec.catch_up(self.positions[:t], hidden, self._batch(b), self.next_ids[:t])
        if kind == "catch_up":
            return None
        return self.spec.walk(out, self.positions[:t], self.draft_rows[:b], self.block_tables[:b], self.draft_valid[:b],
                              self.max_seq_len)

    def _captured(self, fn):
        """(graph, output) of `fn` captured in the shared pool, after one eager warm-up run (JIT compiles and
        one-time host syncs stay out of the graph)."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph, out

    def _capture_one(self, b: int) -> None:
        self._make_inert()
        self.graphs[b] = self._captured(lambda: self._eager(b))
        for kind in self.mtp_kinds(b):
            self.mtp_graphs[(b, kind)] = self._captured(lambda: self._eager_mtp(b, kind))
        if self.q > 1:  # the commit of the accepted positions' GDN states: ~3 small copies a layer, one launch here
            self.commit_graphs[b] = self._captured(lambda: self._eager_commit(b))[0]

    def _eager_commit(self, b: int) -> None:
        self.spec.commit(self.state_slots[:b], self.num_accepted[:b])

    def _check(self, b: int) -> float:
        err = check_replay(b, *self.replay_and_eager(b))
        if (b, "draft") in self.mtp_graphs:
            replay, eager = self.mtp_replay_and_eager(b)
            if not torch.equal(replay, eager):
                wrong = (replay != eager).any(dim=1).sum().item()
                raise StartupError(f"the batch-{b} MTP draft CUDA graph disagrees with the eager head on {wrong} of "
                                   f"{b} sequences' drafts. {EAGER_HINT}.")
        return err

    def _check_width(self, b: int) -> int:
        """Blocks each of the check's b sequences attends over (its keys' pages), or 0 where the cache cannot
        hold them all (tiny test caches: the sequences then attend over block 0)."""
        if self.cache is None or not self.cache.kv:
            return 0
        longest = max((7 * i) % max(1, self.max_seq_len - self.q) for i in range(b)) + self.q
        width = -(-longest // self.cache.block_size)
        fits = b * width <= self.cache.num_blocks and width <= self.block_tables.shape[1]
        return width if fits else 0

    def _write_check_keys(self) -> None:
        """Seeded random keys and values in the cache blocks the largest size's check attends over (free at
        start-up: a sequence reads only blocks it wrote), so the check compares attention over real keys
        rather than over an all-zero block."""
        n = self.sizes[-1] * self._check_width(self.sizes[-1])
        if not n:
            return
        gen = torch.Generator(device=self.ids.device).manual_seed(0)
        for kv in self.cache.kv.values():
            for x in (kv.k, kv.v):
                if x.dtype == torch.int8:
                    x[:n] = torch.randint(-127, 128, x[:n].shape, generator=gen, device=x.device, dtype=x.dtype)
                else:
                    x[:n] = torch.randn(x[:n].shape, generator=gen, device=x.device, dtype=torch.float32).to(x.dtype)
            for scale in (kv.k_scale, kv.v_scale):
                if scale is not None:
                    scale[:n] = torch.rand(scale[:n].shape, generator=gen, device=scale.device) * 0.02 + 1e-3

    def _fill_check_inputs(self, b: int) -> None:
        q, t = self.q, b * self.q
        rows = torch.arange(t, device=self.ids.device)
        base = (rows // q * 7) % max(1, self.max_seq_len - q)
        self.ids[:t] = (rows * 7919 + 13) % self.model.cfg.vocab_size
        self.positions[:t] = base + rows % q
        self.seq_lens[:b] = (base[::q] + q).to(torch.int32)  # each sequence attends over a different length
        self.next_ids[:t] = (rows * 104729 + 7) % self.model.cfg.vocab_size
        width = self._check_width(b)
        if width:  # each sequence its own pages, holding _write_check_keys' keys
            tables = torch.arange(b * width, device=self.ids.device).view(b, width)
            self.block_tables[:b, :width] = tables.to(self.block_tables.dtype)

    def replay_and_eager(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch-b graph's replay and the eager forward on the same buffers, holding inputs other than
        the capture's (zeros, length 1) so that a value the graph froze at capture shows, attending over
        _write_check_keys' keys. The rows stay inert: no KV writes (slot -1), GDN state in the scratch slot,
        never read."""
        self._fill_check_inputs(b)
        graph, out = self.graphs[b]
        graph.replay()
        replay = out.clone()
        eager = self._eager(b)
        torch.cuda.synchronize()
        self._make_inert()
        return replay, eager

    def mtp_replay_and_eager(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft graph's drafts and the eager head's on the forward graph's output (no KV writes)."""
        self._fill_check_inputs(b)
        self.graphs[b][0].replay()
        self.draft_rows[:b] = torch.arange(b, device=self.ids.device) * self.q + (self.q - 1)
        self.draft_valid[:b] = False
        graph, drafts = self.mtp_graphs[(b, "draft")]
        graph.replay()
        replay = drafts.clone()
        eager = self._eager_mtp(b, "draft")
        torch.cuda.synchronize()
        self._make_inert()
        return replay, eager

    def _make_inert(self) -> None:
        """Start-up only (captures and checks): every row of the largest size inert, as StepInputs.pad makes
        a step's padding."""
        t, n = self.sizes[-1] * self.q, self.sizes[-1]
        self.slot_mapping[:t] = -1
        self.ids[:t] = 0
        self.positions[:t] = 0
        self.next_ids[:t] = 0
        self.seq_lens[:n] = 1
        self.block_tables[:n] = 0
        self.state_slots[:n] = self.scratch_slot
        self.has_init[:n] = False
        self.draft_rows.zero_()
        self.draft_valid.zero_()
        self.num_accepted.zero_()

    def bucket(self, b: int) -> int | None:
        return next((s for s in self.sizes if s >= b), None) if self.graphs else None

    def run(self, num_rows: int) -> torch.Tensor:
        """Replay the forward of a step of num_rows rows (rows_per_seq a sequence) whose upload filled the
        input fields, padded to its size (StepInputs.pad); returns the hidden states [num_rows, H]."""
        graph, out = self.graphs[self.bucket(num_rows // self.q)]
        graph.replay()
        return out[:num_rows]

    def can_run_mtp(self, b: int, kind: str) -> bool:
        size = self.bucket(b)
        return size is not None and (size, kind) in self.mtp_graphs

    def run_mtp(self, kind: str, b: int, draft_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Replay the head's work after `run` (same step, b sequences; its next_ids are the step's input
        field): draft_rows [b] (kind "draft"). Returns the drafts [b, k] or None (catch_up)."""
        size = self.bucket(b)
        if draft_rows is not None:
            self.draft_rows[:b].copy_(draft_rows)
            self.draft_valid[:b] = True
            if size > b:  # padding sequences draft nothing, from row 0 (a stale row may lie past this size)
                self.draft_rows[b:size] = 0
                self.draft_valid[b:size] = False
        graph, drafts = self.mtp_graphs[(size, kind)]
        graph.replay()
        return None if drafts is None else drafts[:b]

    def run_commit(self, num_accepted: torch.Tensor) -> bool:
        """Replay the GDN state commit after `run` (same batch): num_accepted [b]. False where no commit graph
        was captured for the batch's size (the caller commits eagerly)."""
        b = num_accepted.shape[0]
        size = self.bucket(b)
        if size not in self.commit_graphs:
            return False
        self.num_accepted[:b].copy_(num_accepted)
        self.commit_graphs[size].replay()
        return True
