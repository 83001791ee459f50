"""Tensor parallelism in the engine. The engine's process is the driver, rank 0: it schedules, samples
and detokenizes as at one rank. With tensor_parallel_size N it starts N-1 worker processes (spawned,
one per GPU: NCCL with rank r on cuda:r; gloo on the CPU) that load their shard of the model with the
same levers, allocate their caches from the driver's plan (so every block and slot id means the same
on every rank) and then follow the driver step by step.

Each step the driver broadcasts a StepMessage (where each array of the step lies in the runner's
packed upload buffer, the batch's two host ints, and the rows of every compute_logits call) on a gloo
control group, then the upload bytes themselves on the default group (on CUDA, in stream order after
the device fills async scheduling's pending ids). A worker rebuilds the StepBatch views from them,
runs model.forward and the same compute_logits calls (their all-reduces and all-gathers are the
collectives the driver joins) and discards the results.

Prefix caching keeps its bookkeeping (digests, LRU, reference counts, which block or snapshot row
holds what) on the driver only, but its copies of device state (GDN snapshot save and load, host-tier
offload and restore of KV blocks and snapshots) must happen on every rank's own shard. Every such copy
goes through the prefix cache's RowCopies (qv/engine/state_pool.py), which the driver logs as (pool,
rows, pool, rows); the next StepMessage carries the log, and each worker replays it on its own pools
(built from the driver's PrefixPlan by the same code, so every row id agrees) before that step's
forward: the same copies in the same order between the same forwards as on the driver. Each rank's
host tier holds its own shard, so kv_offload_bytes (like kv_cache_bytes) is per rank.

Speculative decoding (spec=ngram, mtp, auto) runs the same way: the message's SpecStep carries a
verifying step's GDN metadata (its cu_rest array in the upload), and every rank keeps its own
per-position states (its Speculator, over its shard's GDN heads). Sampling and verification happen
once, on the driver; their outcome (sampled ids, verified tokens, accepted counts) is broadcast on the
device right after, and each worker commits the accepted states and runs the MTP head's catch-up and
walk from it, on its shard of the head (drafts come from the gathered vocabulary-parallel logits, so
every rank drafts the same ids). N-gram drafts are host data of the driver's, in the step's ids.

Clef records: every rank attaches its cut of the low-rank deltas (qv/model/parallel.py, delta_shard)
and the step's `delta_rows` travel as one more array of the upload. The joint head and its per-record
state live on the driver only: it reads the driver's final-norm hidden rows, which the row-parallel
all-reduces leave whole on every rank, and runs no collective; its lexical vectors read a host copy of
the whole output embedding (rank 0's lm_head is a vocabulary slice). Workers load no head.

A worker that dies breaks the next collective (gloo and NCCL see the closed connection; a hung rank
hits the process group's timeout), and the driver then raises TensorParallelError naming the rank, its
exit code and its traceback; every later step raises it too. shutdown() (LLMEngine.shutdown, the
engine's finalizer, interpreter exit) stops the workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch

from qv.engine.lora_rows import LoraRows
from qv.engine.prefix_cache import PrefixPlan, replica_pools
from qv.engine.step_outputs import OutputShape, StepOutputs
from qv.errors import ConfigError
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
from qv.model.delta_bank import DeltaGroups
from qv.model.parallel import TPGroup

log = logging.getLogger("qv")

COLLECTIVE_TIMEOUT = timedelta(seconds=600)  # a rank silent this long (hung, or still loading) fails the step
DEATH_WAIT_S = 5.0  # after a failed collective, how long the driver waits for a dying worker's exit code
# the arrays of a step a worker needs, each a view of the upload buffer
STEP_ARRAYS = ("ids", "positions", "cu_seqlens_q", "slot_mapping", "block_tables", "seq_lens", "state_slots",
               "has_initial_state", "logits_indices")


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
    """One step for the workers; `stop` ends their loop. arrays: name -> (byte offset in the upload
    buffer, dtype, shape); logits_calls: hidden rows [a, b) of each compute_logits call before the
    step's logits rows (prompt logprobs); state_ops: the prefix cache's state-row copies since the last
    step, to replay before this one's forward (qv/engine/state_pool.py RowCopies)."""

    nbytes: int = 0
    arrays: dict | None = None
    max_query_len: int = 0
    max_seq_len: int = 0
    logits_calls: tuple[tuple[int, int], ...] = ()
    spec: SpecStep | None = None  # with speculation: arrays also holds cu_rest (verifying steps) and next_ids
    stop: bool = False
    state_ops: tuple = ()
    lora_ops: tuple = ()  # LoRA adapters written into device slots since the last step (qv/engine/lora_rows.py)
    delta_max_rows: int = 0  # rows grouped by delta-bank slot: the most in one slot


def describe_step(buf: torch.Tensor, nbytes: int, ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
                  logits_calls: list[tuple[int, int]], spec: SpecStep | None = None,
                  next_ids: torch.Tensor | None = None) -> StepMessage:
    """Where a step's arrays lie in `buf` (they must all be views of it: the engine's runner lays them out there).
    spec: the step's speculation (None: speculation off); next_ids: the MTP head's input ids, with spec."""
    if batch.gdn.num_spec_seqs and (spec is None or spec.num_spec_seqs != batch.gdn.num_spec_seqs):
        raise TensorParallelError("a step's speculative rows do not match its SpecStep (a bug)")
    tensors = dict(ids=ids, positions=positions, cu_seqlens_q=batch.cu_seqlens_q, slot_mapping=batch.attn.slot_mapping,
                   block_tables=batch.attn.block_tables, seq_lens=batch.attn.seq_lens,
                   state_slots=batch.gdn.state_slots, has_initial_state=batch.gdn.has_initial_state,
                   logits_indices=batch.logits_indices)
    if spec is not None:
        tensors["next_ids"] = next_ids
        if spec.num_spec_seqs:
            tensors["cu_rest"] = batch.gdn.cu_seqlens_rest
    if isinstance(batch.delta_rows, DeltaGroups):  # rows grouped by slot (LoRA adapters', Clef's)
        tensors["delta_rows"], tensors["delta_slot_start"] = batch.delta_rows.rows, batch.delta_rows.slot_start
    elif batch.delta_rows is not None:  # Clef rows: every rank adds its cut of the deltas to them
        tensors["delta_rows"] = batch.delta_rows
    base, arrays = buf.data_ptr(), {}
    for name, t in tensors.items():
        off = t.data_ptr() - base if t.numel() else 0  # an empty view may not point into the buffer
        if not t.is_contiguous() or off < 0 or off + t.numel() * t.element_size() > nbytes:
            raise TensorParallelError(f"step array {name} is not a contiguous view of the upload buffer (a bug)")
        arrays[name] = (off, t.dtype, tuple(t.shape))
    msg = StepMessage(nbytes, arrays, batch.max_query_len, batch.attn.max_seq_len, tuple(logits_calls), spec)
    if isinstance(batch.delta_rows, DeltaGroups):
        msg = dataclasses.replace(msg, delta_max_rows=batch.delta_rows.max_rows)
    return msg


def array_view(buf: torch.Tensor, msg: StepMessage, name: str) -> torch.Tensor:
    """The message's array `name` as a view of a worker's copy of the upload bytes."""
    off, dtype, shape = msg.arrays[name]
    n = 1
    for d in shape:
        n *= d
    return buf[off:off + n * dtype.itemsize].view(dtype).view(shape)


def rebuild_step(buf: torch.Tensor, msg: StepMessage, spec=None) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
    """(ids, positions, batch): views of a worker's copy of the upload bytes. spec: the worker's
    Speculator, whose per-position state buffers a verifying step's GDN layers fill."""
    def view(name):
        return array_view(buf, msg, name)

    s = msg.spec
    if s is not None and s.num_spec_seqs:
        gdn = spec.gdn_meta(view("state_slots"), view("has_initial_state"), s.num_spec_seqs, s.num_spec_tokens,
                            view("cu_rest"))
    else:
        gdn = GDNMeta(view("state_slots"), view("has_initial_state"))
    batch = StepBatch(cu_seqlens_q=view("cu_seqlens_q"), max_query_len=msg.max_query_len,
                      attn=AttentionMeta(view("slot_mapping"), view("block_tables"), view("seq_lens"), msg.max_seq_len),
                      gdn=gdn, logits_indices=view("logits_indices"),
                      delta_rows=_delta_rows(buf, msg))
    return view("ids"), view("positions"), batch


def _delta_rows(buf: torch.Tensor, msg: StepMessage):
    if "delta_slot_start" in msg.arrays:
        return DeltaGroups(array_view(buf, msg, "delta_rows"), array_view(buf, msg, "delta_slot_start"),
                           msg.delta_max_rows)
    return array_view(buf, msg, "delta_rows") if "delta_rows" in msg.arrays else None


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
        buf = torch.empty(0, dtype=torch.uint8, device=device)
        lora = None
        while True:
            msg: StepMessage = _recv_object(control)
            if msg.stop:
                break
            if buf.numel() < msg.nbytes:
                buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=device)
            dist.broadcast(buf[:msg.nbytes], src=0)
            with torch.inference_mode():
                replay_state_ops(pools, msg.state_ops)
                if msg.lora_ops:  # adapters paged into device slots on the driver: this rank's cut, same slots
                    lora = lora or LoraRows(model, cfg.max_loras, cfg.max_lora_rank)
                    lora.replay(msg.lora_ops)
                ids, positions, batch = rebuild_step(buf, msg, spec)
                hidden = run_step(model, cache, ids, positions, batch, msg.logits_calls)
                if msg.spec is not None:
                    follow_spec(spec, msg.spec, hidden, positions, batch, array_view(buf, msg, "next_ids"))
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


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

    def send_step(self, upload: torch.Tensor, nbytes: int, ids, positions, batch, logits_calls,
                  spec: SpecStep | None = None, next_ids: torch.Tensor | None = None) -> None:
        """Before the driver's forward: the step's message, then its upload bytes."""
        import torch.distributed as dist

        msg = describe_step(upload, nbytes, ids, positions, batch, logits_calls, spec, next_ids)
        if self._state is not None:  # the copies made since the last step, replayed before this forward
            msg = dataclasses.replace(msg, state_ops=self._state.take_log())
        if self._lora is not None:
            msg = dataclasses.replace(msg, lora_ops=self._lora.take_log())
        self._send_object(msg)
        dist.broadcast(upload[:nbytes], src=0)

    def send_outcome(self, s: SpecStep, sampled, tokens, n_acc) -> None:
        """After sampling and verification, before the MTP head (a step whose SpecStep has_outcome): what
        the workers commit and draft from. On the device, in stream order: no host sync."""
        import torch.distributed as dist

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
