"""Tensor parallelism in the engine. The engine's process is the driver, rank 0: it schedules, samples
and detokenizes as at one rank. With tensor_parallel_size N it starts N-1 worker processes (spawned,
one per GPU: NCCL with rank r on cuda:r; gloo on the CPU) that load their shard of the model with the
same levers, allocate their caches from the driver's plan (so every block and slot id means the same
on every rank) and then follow the driver step by step.

Each step the driver broadcasts a StepMessage (the step's StepShape and capacity, and the rows of
every compute_logits call) on a gloo control group, then the leading bytes of its input buffer on the
default group (on CUDA, in stream order after the device fills async scheduling's pending ids). A
worker holds the same named input fields (qv/engine/step_inputs.py, allocated from the same
StepCapacity, so every field lies where the driver's does), cuts the same StepBatch views from the
shape, runs model.forward and the same compute_logits calls (their all-reduces and all-gathers are
the collectives the driver joins) and discards the results.

Prefix caching keeps its bookkeeping (digests, LRU, reference counts, which block or snapshot row
holds what) on the driver only, but its copies of device state (GDN snapshot save and load, host-tier
offload and restore of KV blocks and snapshots) must happen on every rank's own shard. Every such copy
goes through the prefix cache's RowCopies (qv/engine/state_pool.py), which the driver logs as (pool,
rows, pool, rows); the next StepMessage carries the log, and each worker replays it on its own pools
(built from the driver's PrefixPlan by the same code, so every row id agrees) before that step's
forward: the same copies in the same order between the same forwards as on the driver. Each rank's
host tier holds its own shard, so kv_offload_bytes (like kv_cache_bytes) is per rank.

Speculative decoding (spec=ngram, mtp, auto) runs the same way: the step's shape says which rows
verify (their cu_seqlens_rest is an input field like the others), and every rank keeps its own
per-position states (its Speculator, over its shard's GDN heads). Sampling and verification happen
once, on the driver; their outcome (sampled ids, verified tokens, accepted counts) is broadcast on the
device right after, and each worker commits the accepted states and runs the MTP head's catch-up and
walk from it, on its shard of the head (drafts come from the gathered vocabulary-parallel logits, so
every rank drafts the same ids). N-gram drafts are host data of the driver's, in the step's ids.

Clef records: every rank attaches its cut of the low-rank deltas (qv/model/parallel.py, delta_shard)
and the step's `delta_rows` are one more input field. The joint head and its per-record
state live on the driver only: it reads the driver's final-norm hidden rows, which the row-parallel
all-reduces leave whole on every rank, and runs no collective; its lexical vectors read a host copy of
the whole output embedding (rank 0's lm_head is a vocabulary slice). Workers load no head.

Served LoRA adapters: every rank reserves the same delta-bank slots; the driver's slot writes (slot,
adapter folder, load id) ride the next StepMessage (lora_ops) and each worker writes its own cut of the
adapter into the same slot before that forward. The rows grouped by slot are the input fields
`delta_rows` and `delta_slot_start`, received by name like the others.

A worker that dies breaks the next collective (gloo and NCCL see the closed connection; a hung rank
hits the process group's timeout), and the driver then raises TensorParallelError naming the rank, its
exit code and its traceback; every later step raises it too. shutdown() (LLMEngine.shutdown, the
engine's finalizer, interpreter exit) stops the workers.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import traceback
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch

from qv.engine.lora_rows import LoraRows
from qv.engine.prefix_cache import PrefixPlan, replica_pools
from qv.engine.prompt_logprobs import prompt_logits_calls
from qv.engine.step_inputs import StepCapacity, StepInputs, StepShape
from qv.engine.step_outputs import OutputShape, StepOutputs
from qv.errors import ConfigError
from qv.model.batch import StepBatch
from qv.model.parallel import TPGroup

log = logging.getLogger("qv")

COLLECTIVE_TIMEOUT = timedelta(seconds=600)  # a rank silent this long (hung, or still loading) fails the step
DEATH_WAIT_S = 5.0  # after a failed collective, how long the driver waits for a dying worker's exit code


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


# ---------------------------------------------------------------------------------------------
# start-up checks
# ---------------------------------------------------------------------------------------------


def check_levers(cfg, media: bool, device: torch.device) -> None:
    """ConfigError naming the lever for each part not built for tensor_parallel_size > 1 (media: the
    vision tower would load)."""
    n = cfg.tensor_parallel_size
    why = f"tensor_parallel_size {n} (> 1) does not support"
    if cfg.cuda_graphs and device.type == "cuda":
        raise ConfigError(f"{why} CUDA graphs yet (the all-reduces would be captured): use cuda_graphs=0")
    if media:
        raise ConfigError(f"{why} images and videos yet: use media_max_images=0 and media_max_videos=0")
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ConfigError(f"tensor_parallel_size {n} needs {n} CUDA devices; {torch.cuda.device_count()} are visible")
    if device.type == "cuda" and device.index not in (None, 0):
        raise ConfigError(f"with tensor_parallel_size > 1 rank r runs on cuda:r: use device=cuda, not {device}")


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


# ---------------------------------------------------------------------------------------------
# the step message
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecStep:
    """A step's speculation, for the workers: the first num_spec_seqs sequences verify (num_spec_tokens
    rows, k1 each; their GDN states kept per position), `samplers` sample one token each, and `mtp` is
    the MTP head's work after the step (Speculator.mtp_work: "draft", "catch_up" or None), its walk's
    attention bounded by draft_max_len keys."""

    num_spec_seqs: int
    num_spec_tokens: int
    k1: int
    samplers: tuple[int, ...]
    mtp: str | None
    draft_max_len: int

    @property
    def has_outcome(self) -> bool:
        """Whether the driver broadcasts the step's outcome (sampled ids, verified tokens, accepted counts)
        after its logits: the workers commit or draft from it."""
        return bool(self.num_spec_seqs or self.mtp)


@dataclass(frozen=True)
class StepMessage:
    """One step for the workers; `stop` ends their loop. shape: the step's sizes, which cut the input
    fields (of `capacity`) into its views; logits_calls: hidden rows [a, b) of each compute_logits call
    before the step's logits rows (prompt logprobs); state_ops: the prefix cache's state-row copies since
    the last step, to replay before this one's forward (qv/engine/state_pool.py RowCopies)."""

    shape: StepShape | None = None
    capacity: StepCapacity | None = None
    logits_calls: tuple[tuple[int, int], ...] = ()
    spec: SpecStep | None = None  # with speculation
    stop: bool = False
    state_ops: tuple = ()
    lora_ops: tuple = ()  # LoRA adapters written into device slots since the last step (qv/engine/lora_rows.py)


def run_step(model, cache, ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
             logits_calls) -> torch.Tensor:
    """A worker's share of a step: the forward and the driver's compute_logits calls, in its order. The
    hidden states, for the speculation that follows."""
    hidden = model.forward(ids, positions, batch, cache)
    for a, b in logits_calls:
        model.compute_logits(hidden[a:b])
    if batch.logits_indices.numel():
        model.compute_logits(hidden[batch.logits_indices])
    return hidden


def follow_spec(spec, s: SpecStep, hidden: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
                next_ids: torch.Tensor) -> None:
    """A worker's speculation after the logits, as the runner's: the driver's outcome (receive_outcome),
    the commit of each verified sequence's accepted state, the MTP head's catch-up and walk."""
    if not batch.logits_indices.numel():  # nothing sampled: the head's KV only catches up
        if s.mtp:
            spec.catch_up(positions, hidden, batch, next_ids)
        return
    if not s.has_outcome:
        return
    sampled, tokens, n_acc = receive_outcome(s, hidden.device)
    if s.num_spec_seqs:
        spec.commit(batch.gdn.state_slots[:s.num_spec_seqs], n_acc)
    if s.mtp:
        draft_rows = spec.mtp_inputs(next_ids, batch.logits_indices, s.num_spec_seqs, tokens, n_acc, sampled, s.mtp)
        spec.mtp_eager(positions, hidden, batch, next_ids, draft_rows, spec.drafting_seqs(s.num_spec_seqs, s.samplers),
                       s.draft_max_len)


def outcome_shape(s: SpecStep) -> OutputShape:
    """The parts of a step's StepOutputs the workers receive: sampled ids, verified tokens, accepted counts."""
    return OutputShape(samplers=len(s.samplers), verified=s.num_spec_seqs, k1=s.k1)


def receive_outcome(s: SpecStep, device: torch.device):
    """(sampled [len(samplers)] or None, tokens [S, k1] or None, n_acc [S] or None) from the driver's broadcast."""
    import torch.distributed as dist

    shape = outcome_shape(s)
    packed = torch.empty(sum(rows * max(cols, 1) for _, rows, cols, _ in StepOutputs.parts(shape)),
                         dtype=torch.int64, device=device)
    dist.broadcast(packed, src=0)
    o = StepOutputs.unpack(packed, shape)
    return o.sampled, o.verified, o.accepted


def replay_state_ops(pools, ops: tuple) -> None:
    """The driver's prefix-cache state copies since the last step, on this rank's own pools, in its order."""
    if not ops:
        return
    if pools is None:
        raise TensorParallelError("prefix-cache state copies reached a worker planned without prefix caching (a bug)")
    pools.replay(ops)


# ---------------------------------------------------------------------------------------------
# the worker process
# ---------------------------------------------------------------------------------------------


def _init(rank: int, world: int, port: int, device: torch.device):
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    # the step messages are Python objects: a gloo group on the host beside NCCL's
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else None
    return TPGroup.from_distributed(), control


def _recv_object(control):
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def worker_main(rank: int, levers: dict, device: torch.device, port: int, errors, load) -> None:
    """A worker's life: join the group, load the shard (load: qv.engine.build.load_rank), allocate the
    cache the driver planned, follow the steps."""
    import torch.distributed as dist

    from qv.config import EngineConfig

    try:
        cfg = EngineConfig(**levers)
        world = cfg.tensor_parallel_size
        if device.type == "cpu" and (os.cpu_count() or 1) > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
        device = rank_device(device, rank)
        tp, control = _init(rank, world, port, device)
        model, make_cache, make_spec = load(cfg, device, tp)
        num_blocks, num_slots, prefix_plan = _recv_object(control)
        cache = make_cache(num_blocks, num_slots)
        pools = replica_pools(prefix_plan, cache)  # the prefix cache's state pools over this rank's shard
        spec = make_spec(cache)  # the per-position states and MTP head of speculation on this rank's shard
        inputs = None  # the step's input fields, as the driver's (allocated at the first step's capacity)
        lora = None  # the LoRA adapters this rank wrote into its slots (the driver's lora_ops)
        while True:
            msg: StepMessage = _recv_object(control)
            if msg.stop:
                break
            if inputs is None or inputs.capacity != msg.capacity:
                inputs = StepInputs(msg.capacity, device)
            shape = msg.shape
            dist.broadcast(inputs.worker_buffer[:inputs.worker_bytes(shape)], src=0)
            with torch.inference_mode():
                replay_state_ops(pools, msg.state_ops)
                if msg.lora_ops:  # adapters paged into device slots on the driver: this rank's cut, same slots
                    lora = lora or LoraRows(model, cfg.max_loras, cfg.max_lora_rank)
                    lora.replay(msg.lora_ops)
                ids, positions, batch = inputs.field("ids", shape.rows), inputs.field("positions", shape.rows), \
                    inputs.batch(shape, spec)
                hidden = run_step(model, cache, ids, positions, batch, msg.logits_calls)
                if msg.spec is not None:
                    follow_spec(spec, msg.spec, hidden, positions, batch, inputs.field("next_ids", shape.rows))
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


class SingleRank:
    """The runner's tensor parallelism at one rank: no workers, nothing to send."""

    def guard(self):
        return contextlib.nullcontext()

    def send_step(self, inputs, st, vocab_size: int) -> None:
        pass

    def send_outcome(self, s, sampled, tokens, n_acc) -> None:
        pass

    def mirror_state(self, copies) -> None:
        pass

    def mirror_lora(self, lora) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPDriver:
    """Rank 0's side: the workers, the groups, the step broadcast and the failure checks. load: how a
    worker loads its shard (qv.engine.build.load_rank, passed in: build imports this module)."""

    def __init__(self, cfg, device: torch.device, load):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise ConfigError("torch.distributed is already initialized in this process (another tensor-parallel "
                              "engine still running?): shut it down first (LLMEngine.shutdown())")
        self.world = cfg.tensor_parallel_size
        self.error: str | None = None
        self._closed = self._joined = False
        self._state = None  # the prefix cache's RowCopies, logging (mirror_state)
        self._lora = None  # the LoRA adapters' slot writes, logging (mirror_lora)
        port = _free_port()
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        levers = cfg.model_dump()
        self.workers = [ctx.Process(target=worker_main, args=(r, levers, device, port, self._errors, load), daemon=True,
                                    name=f"qv-tp-rank{r}") for r in range(1, self.world)]
        for w in self.workers:
            w.start()
        log.info("tensor parallel: %d ranks (%s), workers %s", self.world, "nccl" if device.type == "cuda" else "gloo",
                 [w.pid for w in self.workers])
        try:
            self.group, self._control = _init(0, self.world, port, device)
            self._joined = True
        except BaseException:
            self.shutdown()
            raise

    def send_plan(self, num_blocks: int, num_slots: int, prefix_plan: PrefixPlan) -> None:
        """The cache every worker allocates (the driver's plan, so ids agree on every rank), and the prefix
        cache's pools (snapshot and host rows) it mirrors."""
        with self.guard():
            self._send_object((num_blocks, num_slots, prefix_plan))

    def mirror_state(self, copies) -> None:
        """Log the prefix cache's state-row copies (a RowCopies) so that each step carries them to the workers."""
        copies.start_log()
        self._state = copies

    def mirror_lora(self, lora) -> None:
        """Log LoRA slot writes (a LoraRows) so that each step carries them to the workers."""
        lora.start_log()
        self._lora = lora

    def send_step(self, inputs: StepInputs, st, vocab_size: int) -> None:
        """Before the driver's forward (st: the runner's step): the step's message, then the leading bytes of
        its input fields. With speculation, st.tp_spec: the workers' view of it, for send_outcome."""
        import torch.distributed as dist

        shape = st.shape
        st.tp_spec = SpecStep(shape.num_spec, shape.spec_rows, inputs.capacity.k1, tuple(st.samplers), st.mtp,
                              st.draft_max_len) if inputs.capacity.k1 > 1 else None
        state_ops = self._state.take_log() if self._state is not None else ()  # replayed before this forward
        lora_ops = self._lora.take_log() if self._lora is not None else ()  # slot writes, before this forward
        self._send_object(StepMessage(shape, inputs.capacity, tuple(prompt_logits_calls(st.seqs, st.cu, vocab_size)),
                                      st.tp_spec, state_ops=state_ops, lora_ops=lora_ops))
        dist.broadcast(inputs.worker_buffer[:inputs.worker_bytes(shape)], src=0)

    def send_outcome(self, s: SpecStep | None, sampled, tokens, n_acc) -> None:
        """After sampling and verification, before the MTP head (a step whose SpecStep has_outcome): what
        the workers commit and draft from. On the device, in stream order: no host sync."""
        import torch.distributed as dist

        if s is None or not s.has_outcome:
            return

        device = next(t.device for t in (sampled, tokens, n_acc) if t is not None)
        outcome = StepOutputs(sampled=sampled, verified=tokens, accepted=n_acc)
        dist.broadcast(outcome.pack(outcome_shape(s), device), src=0)

    def _send_object(self, obj) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([obj], src=0, group=self._control)

    @contextmanager
    def guard(self):
        """Around everything that joins a collective: a dead worker or failed collective becomes
        TensorParallelError (and stays: the ranks' caches no longer agree)."""
        if self.error is not None:
            raise TensorParallelError(self.error)
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            self._fail(None)
        try:
            yield
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception | None):
        for w in self.workers:
            w.join(timeout=DEATH_WAIT_S / len(self.workers))
        reports = {}
        while True:
            try:
                rank, text = self._errors.get_nowait()
            except (queue.Empty, OSError, ValueError):  # ValueError: closed by shutdown
                break
            reports[rank] = text
        dead = [(r, w.exitcode) for r, w in enumerate(self.workers, start=1) if w.exitcode is not None]
        if dead:
            parts = [f"rank {r} exited with code {code}" + (f":\n{reports[r]}" if r in reports else "")
                     for r, code in dead]
            self.error = "tensor parallel worker died: " + "; ".join(parts)
        else:
            self.error = f"a tensor parallel collective failed with every worker alive: {exc}"
        log.error("%s", self.error)
        raise TensorParallelError(self.error) from exc

    def shutdown(self) -> None:
        """Stop the workers (a stop message where they can still take one) and leave the group."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        if self._joined and self.error is None and all(w.is_alive() for w in self.workers):
            try:
                self._send_object(StepMessage(stop=True))
            except Exception as exc:  # a worker died just now: terminated below
                log.warning("tensor parallel: the stop message failed: %s", exc)
        for w in self.workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
                w.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._errors.close()
