"""The step's inputs: named persistent buffers, declared once (FIELDS) and sized from the step's
capacity (StepCapacity), as vLLM v1's InputBuffers and nano-vllm's graph_vars do, for the whole batch.

Every field lives at a fixed offset of one pinned host buffer and of one device buffer, allocated at
start-up and never again. The runner fills the host fields with NumPy; `send` copies the part of each
field the step used (parts closer than MERGE_GAP_BYTES go in one copy); the step's StepBatch is views
of the device fields (`batch`), cut by its StepShape. The decode CUDA graphs capture views of these
same device fields, so a replay copies nothing in: a step that replays a graph pads its fields to the
graph's size on the host (`pad`, inert rows) and the one upload carries the padding too. Tensor-parallel
workers hold the same declaration at the same capacity: the driver broadcasts the device buffer's
leading bytes (`worker_bytes`: the fields a worker reads come first) and the StepShape, and a worker
cuts the same views with the same code.

The sampling settings (their count varies with the penalties, biases and bans a step's requests ask
for) go into one more field, `sampling`, laid out per step by `alloc`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
from qv.model.delta_bank import DeltaGroups

MERGE_GAP_BYTES = 16384  # copying a gap this size costs less than the latency of one more small copy
ALIGN = 16  # Triton specializes kernels on 16-byte aligned pointers


@dataclass(frozen=True)
class StepCapacity:
    """The most one step holds: the one declaration that sizes the step's buffers (the runner's inputs,
    the vision steps' rows)."""

    rows: int  # token rows: the token budget, plus k draft rows a sequence with speculation
    seqs: int
    blocks: int  # block-table width: max_model_len and the speculative lookahead, in blocks
    k1: int  # rows of a verifying sequence (1 without speculation)
    # delta-bank slots a step's delta rows are grouped by (Clef's slot 0, then the LoRA adapters': max_loras + 1
    # with LoRA, 1 for Clef's deltas alone); 0: no deltas
    delta_slots: int = 0

    @property
    def lora_slots(self) -> bool:
        """Whether LoRA adapters' slots follow Clef's: their rows decode, so the decode graphs launch the grouped
        deltas (Clef's records never decode; empty launches would cost every decode step)."""
        return self.delta_slots > 1

    @classmethod
    def of(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
           spec_k: int = 0, delta_slots: int = 0) -> "StepCapacity":
        lookahead = 2 * spec_k + 2 if spec_k else 1
        return cls(rows=max_num_batched_tokens + spec_k * max_num_seqs, seqs=max_num_seqs,
                   blocks=-(-(max_model_len + lookahead) // block_size) + 1, k1=spec_k + 1, delta_slots=delta_slots)

    @property
    def sampling_bytes(self) -> int:
        """up to 10 settings (int64 or fp32) per logits row (k+1 rows a verified sequence), the bias and ban
        row lists, and alignment slack"""
        return (96 * self.k1 + 80) * (self.seqs + 1) + 16 * 64


@dataclass(frozen=True)
class InputField:
    name: str
    dtype: torch.dtype
    # what sizes it: "seqs", "seqs+1", "rows", "drafts" (seqs x k), "table" (seqs x blocks), "bytes",
    # "delta_slots+1"
    extent: str
    worker: bool  # tensor-parallel workers read it (these fields come first: one leading span is broadcast)


FIELDS = (
    InputField("cu_seqlens_q", torch.int32, "seqs+1", True),
    InputField("seq_lens", torch.int32, "seqs", True),
    InputField("has_initial_state", torch.bool, "seqs", True),
    InputField("state_slots", torch.int64, "seqs", True),
    InputField("cu_seqlens_rest", torch.int32, "seqs+1", True),  # verifying steps: the other sequences' rows
    InputField("ids", torch.int64, "rows", True),
    InputField("positions", torch.int64, "rows", True),
    InputField("slot_mapping", torch.int64, "rows", True),
    InputField("next_ids", torch.int64, "rows", True),  # the token after each row: the MTP head's input
    InputField("logits_indices", torch.int64, "rows", True),
    InputField("delta_rows", torch.int64, "rows", True),  # rows computed with low-rank deltas (Clef's, LoRA's)
    # with delta_slots: delta_rows[delta_slot_start[s]:delta_slot_start[s + 1]] run bank slot s
    InputField("delta_slot_start", torch.int64, "delta_slots+1", True),
    InputField("block_tables", torch.int32, "table", True),
    InputField("drafts", torch.int64, "drafts", False),  # the drafts being verified
    InputField("pending_rows", torch.int64, "seqs", False),  # rows whose id the last step sampled on the device
    InputField("pending_src", torch.int64, "seqs", False),  # their index in its sampled ids
    InputField("sampling", torch.uint8, "bytes", False),
)

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_,
          torch.uint8: np.uint8}


@dataclass(frozen=True)
class StepShape:
    """A step's sizes: what cuts the persistent fields into the step's views (and all a tensor-parallel
    worker needs besides the bytes)."""

    seqs: int
    rows: int
    logits: int  # rows with logits (logits_indices)
    width: int  # block-table columns
    max_query_len: int
    max_seq_len: int
    num_spec: int = 0  # the first num_spec sequences verify drafts; their spec_rows rows come first
    spec_rows: int = 0
    draft_k: int = 0
    delta_rows: int = 0  # rows with low-rank deltas (0: the step has none)
    delta_slot_starts: int = 0  # delta_slot_start entries filled (0: delta_rows are Clef's, all slot 0)
    delta_max_rows: int = 0  # the most delta rows of one slot (the grouped launch's grid)
    pending: int = 0
    pad_seqs: int = 0  # a replayed graph's size (0: eager, nothing padded)
    pad_rows: int = 0

    def used(self, f: InputField) -> int:
        """Elements of field f the step fills (padding included)."""
        seqs, rows = max(self.seqs, self.pad_seqs), max(self.rows, self.pad_rows)
        return {"cu_seqlens_q": self.seqs + 1, "cu_seqlens_rest": self.seqs - self.num_spec + 1 if self.num_spec else 0,
                "logits_indices": self.logits, "delta_rows": self.delta_rows,
                "delta_slot_start": self.delta_slot_starts, "drafts": self.num_spec * self.draft_k,
                "pending_rows": self.pending, "pending_src": self.pending, "sampling": 0,
                }.get(f.name, rows if f.extent == "rows" else seqs)


class StepInputs:
    """The fields of FIELDS at one capacity: `host[name]` (NumPy, whole extent) and `device_fields[name]`
    (torch, whole extent; block_tables [seqs, blocks], as the graphs capture it), each a view of one buffer
    allocated here. A step's block table lies `table_stride` columns a row: the step's own width when it
    runs eagerly (the upload carries no unused columns), `blocks` when a graph replays it."""

    def __init__(self, capacity: StepCapacity, device: torch.device):
        self.capacity, self.device = capacity, device
        cap = capacity
        extent = {"seqs": cap.seqs, "seqs+1": cap.seqs + 1, "rows": cap.rows, "drafts": cap.seqs * (cap.k1 - 1),
                  "table": cap.seqs * cap.blocks, "bytes": cap.sampling_bytes, "delta_slots+1": cap.delta_slots + 1}
        self.offsets: dict[str, int] = {}
        end = 0
        for f in FIELDS:
            self.offsets[f.name] = end
            end = _aligned(end + extent[f.extent] * f.dtype.itemsize)
        cuda = device.type == "cuda"
        self._host_bytes = torch.zeros(end, dtype=torch.uint8, pin_memory=cuda)
        self._dev_bytes = torch.zeros(end, dtype=torch.uint8, device=device)
        host_np = self._host_bytes.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.device_fields: dict[str, torch.Tensor] = {}
        for f in FIELDS:
            a, n = self.offsets[f.name], extent[f.extent]
            self.host[f.name] = host_np[a:a + n * f.dtype.itemsize].view(_NUMPY[f.dtype])
            self.device_fields[f.name] = self._dev_bytes[a:a + n * f.dtype.itemsize].view(f.dtype)
        self._host_table, self._dev_table = self.host["block_tables"], self.device_fields["block_tables"]
        self.device_fields["block_tables"] = self._dev_table.view(cap.seqs, cap.blocks)
        self._sampling_used = 0
        self.copied = torch.cuda.Event() if cuda else None

    # -- one step ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Before a step writes the host fields: the last step's copy may still be queued behind the GPU's
        work (a step that samples nothing has no sync), so wait for the event `mark` recorded after it."""
        if self.copied is not None:
            self.copied.synchronize()
        self._sampling_used = 0

    def alloc(self, n: int, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """n values of the step's sampling settings: (the host array to fill, the device view to read)."""
        base, cap = self.offsets["sampling"], self.capacity.sampling_bytes
        off = self._sampling_used
        end = off + n * dtype.itemsize
        if end > cap:
            raise RuntimeError(f"a step's sampling settings need more than the {cap}-byte field (a sizing bug)")
        self._sampling_used = _aligned(end)
        return (self._host_bytes.numpy()[base + off:base + end].view(_NUMPY[dtype]),
                self._dev_bytes[base + off:base + end].view(dtype))

    def pad(self, shape: StepShape, scratch_slot: int) -> None:
        """Inert padding rows and sequences up to a replayed graph's size: no KV writes (slot -1), GDN
        state in the scratch slot, one key attended (the table's first entry, always a valid block id)."""
        h, r, s = self.host, slice(shape.rows, shape.pad_rows), slice(shape.seqs, shape.pad_seqs)
        h["ids"][r] = h["positions"][r] = h["next_ids"][r] = 0
        h["slot_mapping"][r] = -1
        h["seq_lens"][s] = 1
        h["state_slots"][s] = scratch_slot
        h["has_initial_state"][s] = False

    def send(self, shape: StepShape) -> None:
        """The step's upload: the used part of every field, in as few copies as MERGE_GAP_BYTES allows."""
        for a, b in self._spans(shape):
            self._dev_bytes[a:b].copy_(self._host_bytes[a:b], non_blocking=True)

    def mark(self) -> None:
        """After the step's last host-to-device copy: what the next `begin` waits for."""
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device))

    def _spans(self, shape: StepShape, fields=FIELDS) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        for f in fields:
            a = self.offsets[f.name]
            if f.name == "sampling":
                n = self._sampling_used
            elif f.name == "block_tables":  # up to the last row's used columns
                seqs = max(shape.seqs, shape.pad_seqs)
                n = ((seqs - 1) * self.table_stride(shape) + shape.width) * f.dtype.itemsize if seqs else 0
            else:
                n = shape.used(f) * f.dtype.itemsize
            if n == 0:
                continue
            if spans and a - spans[-1][1] <= MERGE_GAP_BYTES:
                spans[-1] = (spans[-1][0], a + n)
            else:
                spans.append((a, a + n))
        return spans

    # -- the step's views ----------------------------------------------------------------------
    def table_stride(self, shape: StepShape) -> int:
        return self.capacity.blocks if shape.pad_seqs else shape.width

    def host_table(self, stride: int) -> np.ndarray:
        """The host block table laid out `stride` columns a row (table_stride), [seqs, stride]."""
        return self._host_table[:self.capacity.seqs * stride].reshape(self.capacity.seqs, stride)

    def field(self, name: str, n: int) -> torch.Tensor:
        """The device field's first n elements."""
        return self.device_fields[name][:n]

    def batch(self, shape: StepShape, spec=None) -> StepBatch:
        """The step's StepBatch: views of the device fields. spec: the Speculator, whose per-position state
        buffers a verifying step's GDN layers fill."""
        f, n = self.field, shape.seqs
        if shape.num_spec:
            gdn = spec.gdn_meta(f("state_slots", n), f("has_initial_state", n), shape.num_spec, shape.spec_rows,
                                f("cu_seqlens_rest", n - shape.num_spec + 1))
        else:
            gdn = GDNMeta(f("state_slots", n), f("has_initial_state", n))
        stride = self.table_stride(shape)
        tables = self._dev_table[:n * stride].view(n, stride)[:, :shape.width]
        return StepBatch(cu_seqlens_q=f("cu_seqlens_q", n + 1), max_query_len=shape.max_query_len,
                         attn=AttentionMeta(f("slot_mapping", shape.rows), tables, f("seq_lens", n), shape.max_seq_len),
                         gdn=gdn, logits_indices=f("logits_indices", shape.logits), delta_rows=self.delta_rows(shape))

    def delta_rows(self, shape: StepShape) -> torch.Tensor | DeltaGroups | None:
        """The step's delta rows: grouped by bank slot (delta_slot_starts), else Clef's plain rows, else None."""
        if not shape.delta_rows:
            return None
        rows = self.field("delta_rows", shape.delta_rows)
        if not shape.delta_slot_starts:
            return rows
        return DeltaGroups(rows, self.field("delta_slot_start", shape.delta_slot_starts), shape.delta_max_rows)

    def graph_delta_rows(self, rows: int, decode: bool = False) -> DeltaGroups | None:
        """What a CUDA graph of `rows` rows captures with delta_slots: the whole slot-start field (every replay
        fills every slot's start: a slot without rows is empty) and the rows, bounded by the graph's size.
        decode: None unless LoRA adapters' slots exist (StepCapacity.lora_slots)."""
        if not (self.capacity.lora_slots if decode else self.capacity.delta_slots):
            return None
        return DeltaGroups(self.field("delta_rows", rows), self.device_fields["delta_slot_start"], rows)

    # -- tensor parallelism --------------------------------------------------------------------
    @property
    def worker_buffer(self) -> torch.Tensor:
        """The device bytes a step's broadcast goes through (its leading `worker_bytes`)."""
        return self._dev_bytes

    def worker_bytes(self, shape: StepShape) -> int:
        """The leading bytes that hold every field a worker reads, as far as the step used them: from the
        shape alone, so the driver and every worker broadcast the same count."""
        spans = self._spans(shape, [f for f in FIELDS if f.worker])
        return spans[-1][1] if spans else 0


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
