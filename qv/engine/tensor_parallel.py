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

from qv.errors import ConfigError
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
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
    if cfg.spec != "off":
        raise ConfigError(f"{why} spec={cfg.spec} yet: use spec=off")
    if cfg.prefix_caching:
        raise ConfigError(f"{why} prefix caching yet (its GDN snapshot copies would have to run on every rank): "
                          "use prefix_caching=0")
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
class StepMessage:
    """One step for the workers; `stop` ends their loop. arrays: name -> (byte offset in the upload
    buffer, dtype, shape); logits_calls: hidden rows [a, b) of each compute_logits call before the
    step's logits rows (prompt logprobs)."""

    nbytes: int = 0
    arrays: dict | None = None
    max_query_len: int = 0
    max_seq_len: int = 0
    logits_calls: tuple[tuple[int, int], ...] = ()
    stop: bool = False


def describe_step(buf: torch.Tensor, nbytes: int, ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
                  logits_calls: list[tuple[int, int]]) -> StepMessage:
    """Where a step's arrays lie in `buf` (they must all be views of it: the engine's runner lays them out there)."""
    if batch.gdn.num_spec_seqs:
        raise TensorParallelError("a step with speculative rows reached tensor parallelism (a bug: "
                                  "start-up refuses those levers)")
    tensors = dict(ids=ids, positions=positions, cu_seqlens_q=batch.cu_seqlens_q, slot_mapping=batch.attn.slot_mapping,
                   block_tables=batch.attn.block_tables, seq_lens=batch.attn.seq_lens,
                   state_slots=batch.gdn.state_slots, has_initial_state=batch.gdn.has_initial_state,
                   logits_indices=batch.logits_indices)
    if batch.delta_rows is not None:  # Clef rows: every rank adds its cut of the deltas to them
        tensors["delta_rows"] = batch.delta_rows
    base, arrays = buf.data_ptr(), {}
    for name, t in tensors.items():
        off = t.data_ptr() - base if t.numel() else 0  # an empty view may not point into the buffer
        if not t.is_contiguous() or off < 0 or off + t.numel() * t.element_size() > nbytes:
            raise TensorParallelError(f"step array {name} is not a contiguous view of the upload buffer (a bug)")
        arrays[name] = (off, t.dtype, tuple(t.shape))
    return StepMessage(nbytes, arrays, batch.max_query_len, batch.attn.max_seq_len, tuple(logits_calls))


def rebuild_step(buf: torch.Tensor, msg: StepMessage) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
    """(ids, positions, batch): views of a worker's copy of the upload bytes."""
    def view(name):
        off, dtype, shape = msg.arrays[name]
        n = 1
        for d in shape:
            n *= d
        return buf[off:off + n * dtype.itemsize].view(dtype).view(shape)

    batch = StepBatch(cu_seqlens_q=view("cu_seqlens_q"), max_query_len=msg.max_query_len,
                      attn=AttentionMeta(view("slot_mapping"), view("block_tables"), view("seq_lens"), msg.max_seq_len),
                      gdn=GDNMeta(view("state_slots"), view("has_initial_state")),
                      logits_indices=view("logits_indices"),
                      delta_rows=view("delta_rows") if "delta_rows" in msg.arrays else None)
    return view("ids"), view("positions"), batch


def run_step(model, cache, ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
             logits_calls) -> None:
    """A worker's share of a step: the forward and the driver's compute_logits calls, in its order."""
    hidden = model.forward(ids, positions, batch, cache)
    for a, b in logits_calls:
        model.compute_logits(hidden[a:b])
    if batch.logits_indices.numel():
        model.compute_logits(hidden[batch.logits_indices])


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
        model, make_cache = load(cfg, device, tp)
        num_blocks, num_slots = _recv_object(control)
        cache = make_cache(num_blocks, num_slots)
        buf = torch.empty(0, dtype=torch.uint8, device=device)
        while True:
            msg: StepMessage = _recv_object(control)
            if msg.stop:
                break
            if buf.numel() < msg.nbytes:
                buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=device)
            dist.broadcast(buf[:msg.nbytes], src=0)
            with torch.inference_mode():
                run_step(model, cache, *rebuild_step(buf, msg), msg.logits_calls)
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

    def send_plan(self, num_blocks: int, num_slots: int) -> None:
        """The cache every worker allocates (the driver's plan, so ids agree on every rank)."""
        with self.guard():
            self._send_object((num_blocks, num_slots))

    def send_step(self, upload: torch.Tensor, nbytes: int, ids, positions, batch, logits_calls) -> None:
        """Before the driver's forward: the step's message, then its upload bytes."""
        import torch.distributed as dist

        self._send_object(describe_step(upload, nbytes, ids, positions, batch, logits_calls))
        dist.broadcast(upload[:nbytes], src=0)

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
