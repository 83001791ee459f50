"""Tensor parallelism at the model level: the process group (TPGroup), each rank's geometry
(rank_config) and the rules that cut a loaded tensor into one rank's shard.

The standard (Megatron) splits, each rank holding 1/world of every large matrix:
- column-parallel (output dim N split, no communication): the fused QKV, gate/up, the GDN
  in-projections, and the GDN conv weight, A_log and dt_bias by the same heads;
- row-parallel (input dim K split, one all-reduce of the partial outputs): o_proj, the GDN
  out_proj, down_proj;
- vocabulary-parallel: the embedding (ids outside a rank's slice give zeros, then all-reduce) and the
  lm_head (each rank its slice of the logits, then all-gather to the full row; simple first, a
  sampler over sharded logits would gather less).
Clef's low-rank deltas are cut with their linear (delta_shard): B by the output columns of a
column-parallel one, A by the input rows of a row-parallel one (its partial delta joins the all-reduce).
Each rank takes a contiguous block of heads: query head h reads KV head h // (Hq/Hkv) and GDN value
head j reads key head j // (Hv/Hk), so rank r's query (value) heads read exactly its KV (key) heads.
A world of 1 shards nothing and calls no torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qv.errors import ConfigError
from qv.kernels.linear import FP8Weight, GPTQWeight
from qv.model.layers import Linear
from qv.model_config import ModelConfig

# the per-rank counts of a rank's ModelConfig view; everything derived from them (key/value/conv dims)
# follows, and so do the layers and cache allocation built from that view
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group. `group` is a torch.distributed ProcessGroup
    (None: the default group); loading needs only rank and world_size, forwards communicate."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"tensor parallel rank {self.rank} is outside a world of {self.world_size}")

    @classmethod
    def from_distributed(cls, group=None) -> "TPGroup":
        """The group of an initialized torch.distributed (the default group unless `group`)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' equally shaped `x`, concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def rank_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """`cfg` with one rank's head counts (the layers and caches of a rank are built from it)."""
    if world_size == 1:
        return cfg
    for name in HEAD_COUNTS + ("intermediate_size",):
        if getattr(cfg, name) % world_size:
            raise ConfigError(f"tensor parallel size {world_size} does not divide {name}={getattr(cfg, name)}")
    return dataclasses.replace(cfg, **{name: getattr(cfg, name) // world_size for name in HEAD_COUNTS})


# ---------------------------------------------------------------------------------------------
# slicing one loaded tensor for a rank
# ---------------------------------------------------------------------------------------------


def rank_block(n: int, tp: TPGroup, what: str) -> slice:
    """Rank's contiguous 1/world of `n` (heads, channels or input rows of `what`)."""
    if n % tp.world_size:
        raise ConfigError(f"{what}: tensor parallel size {tp.world_size} does not divide its {n} rows")
    per = n // tp.world_size
    return slice(tp.rank * per, (tp.rank + 1) * per)


def _piece_blocks(pieces: list[int], tp: TPGroup, what: str) -> list[slice]:
    """Rank's block of each piece of a concatenation ([q | k | v] channels), as slices of the whole."""
    out, start = [], 0
    for n in pieces:
        s = rank_block(n, tp, what)
        out.append(slice(start + s.start, start + s.stop))
        start += n
    return out


def _take(t: torch.Tensor, blocks: list[slice], dim: int) -> torch.Tensor:
    # a copy, never a view, so the full tensor's storage is freed once the loader drops it
    return torch.cat([t.narrow(dim, s.start, s.stop - s.start) for s in blocks], dim=dim)


def shard_rows(t: torch.Tensor, pieces: list[int], tp: TPGroup, what: str) -> torch.Tensor:
    """Rank's block of each piece of dim 0 (a conv weight's channels, A_log's heads, a bias)."""
    if tp.world_size == 1:
        return t
    return _take(t, _piece_blocks(pieces, tp, what), 0)


def _fp8_blocks(blocks: list[slice], size: int, block: int, dim: int, what: str, tp: TPGroup) -> list[slice]:
    """The scale rows (dim 0) or columns (dim 1) of an FP8 weight's slices `blocks` along a `size`-long dim cut
    in `block`s: each slice must start on a scale block and end on one or at the dim's end."""
    out = []
    for s in blocks:
        if s.start % block or (s.stop % block and s.stop != size):
            raise ConfigError(f"{what}: tensor parallel size {tp.world_size} cuts its FP8 weight at "
                              f"{'row' if dim == 0 else 'input'} {s.start if s.start % block else s.stop}, inside a "
                              f"{block}-wide scale block; each rank must hold whole blocks")
        out.append(slice(s.start // block, -(-s.stop // block)))
    return out


def _fp8_rows(w: FP8Weight, blocks: list[slice], what: str, tp: TPGroup) -> FP8Weight:
    scale_rows = _fp8_blocks(blocks, w.out_features, w.block[0], 0, what, tp)
    return FP8Weight(_take(w.weight, blocks, 0), _take(w.scale_inv, scale_rows, 0), w.block)


def column_shard(w: torch.Tensor | GPTQWeight | FP8Weight, pieces: list[int], tp: TPGroup, what: str):
    """Rank's output columns of a linear: its block of each piece of N (dense [N, K] rows, GPTQ
    qweight/scales/zeros columns, g_idx over K staying whole; FP8 rows and their scale blocks' rows)."""
    if tp.world_size == 1:
        return w
    blocks = _piece_blocks(pieces, tp, what)
    if isinstance(w, FP8Weight):
        return _fp8_rows(w, blocks, what, tp)
    if isinstance(w, GPTQWeight):
        zeros = None if w.zeros is None else _take(w.zeros, blocks, 1)
        return GPTQWeight(_take(w.qweight, blocks, 1), _take(w.scales, blocks, 1), zeros, w.g_idx.clone(),
                          w.group_size, w.bits)
    return _take(w, blocks, 0)


def row_shard(w: torch.Tensor | GPTQWeight, tp: TPGroup, what: str):
    """Rank's block of the input rows K of a linear. A GPTQ shard keeps whole groups: the groups its
    rows use are used by no other rank's rows (else an error naming `what`); their scales/zeros are
    kept and g_idx renumbered to them. A 4-bit shard starts and ends on a packed byte row (even K)."""
    if tp.world_size == 1:
        return w
    s = rank_block(w.shape[1], tp, what)
    if isinstance(w, FP8Weight):
        cols = _fp8_blocks([s], w.in_features, w.block[1], 1, what, tp)[0]
        return FP8Weight(w.weight[:, s].contiguous(), w.scale_inv[:, cols].contiguous(), w.block)
    if not isinstance(w, GPTQWeight):
        return w[:, s].contiguous()
    here = w.g_idx[s].long()
    groups = torch.unique(here)  # sorted
    elsewhere = torch.cat([w.g_idx[:s.start], w.g_idx[s.stop:]]).long()
    if bool(torch.isin(elsewhere, groups).any()):
        raise ConfigError(f"{what}: tensor parallel size {tp.world_size} splits its {w.in_features} inputs into "
                          f"{s.stop - s.start}-row shards that cut GPTQ groups (group size {w.group_size}); "
                          "each rank must hold whole groups")
    renumber = torch.full((w.scales.shape[0],), -1, dtype=torch.long, device=here.device)
    renumber[groups] = torch.arange(groups.numel(), device=here.device)
    zeros = None if w.zeros is None else w.zeros[groups].contiguous()
    per_byte = 8 // w.bits
    if s.start % per_byte or s.stop % per_byte:
        raise ConfigError(f"{what}: tensor parallel size {tp.world_size} splits its {w.in_features} inputs at row "
                          f"{s.start if s.start % per_byte else s.stop}, inside a byte of packed {w.bits}-bit codes")
    rows = slice(s.start // per_byte, s.stop // per_byte)
    return GPTQWeight(w.qweight[rows].clone(), w.scales[groups].contiguous(), zeros,
                      renumber[here].to(torch.int32), w.group_size, w.bits)


def shard_linear(w, bias: torch.Tensor | None, split: str | None, tp: TPGroup | None, what: str,
                 pieces: list[int] | None = None) -> Linear:
    """The rank's Linear for a loaded weight: split None (replicated), "column" (each of `pieces` of N
    split; default one piece) or "row" (K split; outputs all-reduced, a bias added by rank 0 only)."""
    if tp is None or tp.world_size == 1 or split is None:
        return Linear(w, bias)
    if split == "column":
        pieces = pieces or [w.shape[0]]
        out = Linear(column_shard(w, pieces, tp, what), None if bias is None else shard_rows(bias, pieces, tp, what))
        out.pieces = pieces
    elif split == "row":
        out = Linear(row_shard(w, tp, what), bias if tp.rank == 0 else None, reduce=tp)
    else:
        raise ValueError(f"unknown split {split!r}: expected None, 'column' or 'row'")
    out.shard = split
    return out


def delta_shard(a: torch.Tensor, b: torch.Tensor, split: str | None, pieces: list[int] | None, tp: TPGroup | None,
                what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's factors of a low-rank delta (x A^T) B^T (A [r, K], B [N, r]) on a Linear cut by `split`, as
    its weight is cut: column-parallel keeps A whole and takes B's rows of the rank's block of each of
    `pieces` (the rank's output columns); row-parallel takes A's columns of the rank's input rows and
    keeps B whole, so each rank adds a partial delta that the base output's all-reduce sums once."""
    if tp is None or tp.world_size == 1 or split is None:
        return a, b
    if split == "column":
        return a, _take(b, _piece_blocks(pieces or [b.shape[0]], tp, what), 0)
    if split == "row":
        return a[:, rank_block(a.shape[1], tp, what)].contiguous(), b
    raise ConfigError(f"{what}: a low-rank delta on a {split}-parallel linear is not built")


# ---------------------------------------------------------------------------------------------
# vocabulary-parallel embedding and lm_head
# ---------------------------------------------------------------------------------------------


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """Rank's ids [start, end): ceil(V / world) each, the last rank's slice shorter when V is not divisible."""
    per = -(-vocab_size // tp.world_size)
    start = min(tp.rank * per, vocab_size)
    if per * (tp.world_size - 1) >= vocab_size:
        raise ConfigError(f"vocabulary of {vocab_size} is too small for tensor parallel size {tp.world_size}")
    return start, min(start + per, vocab_size)


def vocab_shard(w: torch.Tensor | GPTQWeight, tp: TPGroup) -> torch.Tensor | GPTQWeight:
    """Rank's rows of an embedding table [V, H], or its output columns of an lm_head weight."""
    start, end = vocab_range(w.shape[0], tp)
    if isinstance(w, FP8Weight):
        return _fp8_rows(w, [slice(start, end)], "lm_head", tp)
    if isinstance(w, GPTQWeight):
        block = [slice(start, end)]
        zeros = None if w.zeros is None else _take(w.zeros, block, 1)
        return GPTQWeight(_take(w.qweight, block, 1), _take(w.scales, block, 1), zeros, w.g_idx.clone(), w.group_size,
                          w.bits)
    return w[start:end].clone()


def vocab_parallel_embed(table: torch.Tensor, ids: torch.Tensor, start: int, tp: TPGroup) -> torch.Tensor:
    """Embedding rows of `ids` from rank slices `table` (ids start..start+len): zeros for ids outside
    it, summed over the ranks. Masked by arithmetic, not by indexing, so no host sync."""
    local = ids - start
    inside = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)] * inside.unsqueeze(-1).to(table.dtype)
    return tp.all_reduce_sum(rows)


class VocabParallelLMHead(Linear):
    """The lm_head over a rank's vocabulary slice; a call all-gathers every rank's logits into [T, V]."""

    def __init__(self, weight: torch.Tensor | GPTQWeight, vocab_size: int, tp: TPGroup):
        super().__init__(weight)
        self.vocab_size, self.tp = vocab_size, tp
        self.shard = "vocab"

    def __call__(self, x: torch.Tensor, delta_rows: torch.Tensor | None = None) -> torch.Tensor:
        y = super().__call__(x, delta_rows)
        per = -(-self.vocab_size // self.tp.world_size)
        if y.shape[-1] < per:  # the last rank's shorter slice; the gather needs equal shapes
            y = torch.nn.functional.pad(y, (0, per - y.shape[-1]))
        return self.tp.all_gather(y, dim=-1)[..., :self.vocab_size]
