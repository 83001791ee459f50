"""The start-up memory plan in one record: where the device's bytes go (weights, KV blocks, GDN state
slots, prefix snapshots, speculation buffers, the share kept for activations and CUDA graphs) and what
that buys: the longest context and how many sequences of it fit. Logged at start and shown by `qv bench`.
Under tensor parallelism every figure is one rank's (its shard of the weights, its KV and GDN heads): the
ranks allocate the same blocks and slots, so the context figures hold for the whole group."""

from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 1 << 30


@dataclass
class MemoryPlan:
    device_bytes: int  # the device's memory (0 on the CPU)
    utilization: float  # gpu_memory_utilization
    weight_bytes: int  # the loaded weights' tensor storages (text model, MTP head, vision tower, Clef)
    kv_blocks: int
    block_size: int
    kv_block_bytes: int  # one block across every attention layer
    gdn_slots: int  # sequences' state slots (the scratch slot of graph padding rows not counted)
    gdn_slot_bytes: int  # conv + recurrent state of one sequence across every GDN layer
    snapshots: int  # GDN states kept for prefix reuse
    spec_bytes: int  # per-position states of speculative verification
    other_bytes: int  # Clef head states and other reserves
    reserve_bytes: int  # left for activations and CUDA graph pools
    max_model_len: int
    tensor_parallel_size: int = 1  # > 1: the byte figures are each rank's

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def gdn_bytes(self) -> int:
        return (self.gdn_slots + 1) * self.gdn_slot_bytes

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshots * self.gdn_slot_bytes

    @property
    def longest_context(self) -> int:
        """The longest sequence the KV blocks hold, up to max_model_len."""
        return min(self.max_model_len, self.kv_tokens)

    @property
    def seqs_at_longest(self) -> int:
        """Sequences of the longest context that fit at once (KV blocks and state slots both); each
        holds whole blocks, so a context that ends inside a block takes all of it."""
        per_seq = -(-self.longest_context // self.block_size)
        return min(self.gdn_slots, self.kv_blocks // max(1, per_seq))

    @property
    def context_at_most_seqs(self) -> int:
        """Tokens each sequence may hold when every state slot is in use (whole blocks each)."""
        return min(self.max_model_len, self.kv_blocks // max(1, self.gdn_slots) * self.block_size)

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("kv_tokens", "kv_bytes", "gdn_bytes", "snapshot_bytes", "longest_context", "seqs_at_longest",
                     "context_at_most_seqs"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        """One paragraph for the start-up log."""
        gib = lambda b: f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / (1 << 20):.1f} MiB"  # noqa: E731
        head = f"of {gib(self.device_bytes)} x {self.utilization:.2f}: " if self.device_bytes else ""
        if self.tensor_parallel_size > 1:
            head = f"per rank (tensor parallel {self.tensor_parallel_size}) {head}"
        return (f"memory plan {head}weights {gib(self.weight_bytes)}, KV {gib(self.kv_bytes)} ({self.kv_blocks} "
                f"blocks = {self.kv_tokens:,} tokens), GDN states {gib(self.gdn_bytes)} ({self.gdn_slots} slots + "
                f"1 scratch), prefix snapshots {gib(self.snapshot_bytes)} ({self.snapshots}), speculation "
                f"{gib(self.spec_bytes)}, other {gib(self.other_bytes)}, activations and graphs "
                f"{gib(self.reserve_bytes)}; "
                f"holds {self.seqs_at_longest} sequence(s) of {self.longest_context:,} tokens, or {self.gdn_slots} "
                f"of {self.context_at_most_seqs:,}")
