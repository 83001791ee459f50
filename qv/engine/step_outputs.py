"""What a step sends back to the host, as one typed message. StepOutputs names every part; `parts`
is the one field list (name, rows, columns, float) for a step's OutputShape, and both `pack` (the
device side: one int64 tensor, floats bit-cast, for the step's single device-to-host copy, or the
tensor-parallel outcome broadcast) and `unpack` (the host side, or a worker's) walk it, so the
layout is written once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class OutputShape:
    """The sizes of a step's outputs, fixed when the step launches. top: logprobs per row (-1: none
    asked; 0: the chosen token's only); draft_k: MTP drafts per sequence (0: none)."""

    samplers: int  # sequences that sample one token
    verified: int = 0  # sequences that verify k1 - 1 drafts
    k1: int = 1
    sample_top: int = -1
    verify_top: int = -1
    draft_k: int = 0


@dataclass
class StepOutputs:
    """A step's outputs: device tensors before `pack`, host arrays (or a worker's tensors) after
    `unpack`. A part the step does not have is None."""

    sampled: object = None  # [samplers] sampled token ids
    sample_logprob: object = None  # [samplers] the sampled token's logprob
    sample_rank: object = None  # [samplers] 1 + tokens more likely than it
    sample_top_ids: object = None  # [samplers, sample_top]
    sample_top_logprobs: object = None  # [samplers, sample_top]
    verified: object = None  # [verified, k1] tokens after verification
    accepted: object = None  # [verified] accepted drafts per sequence
    verify_logprob: object = None  # [verified * k1]
    verify_rank: object = None  # [verified * k1]
    verify_top_ids: object = None  # [verified * k1, verify_top]
    verify_top_logprobs: object = None  # [verified * k1, verify_top]
    drafts: object = None  # [verified + samplers, draft_k] the MTP head's next drafts (verified sequences first)

    @staticmethod
    def parts(shape: OutputShape) -> list[tuple[str, int, int, bool]]:
        """(field, rows, columns, is float) of each part a step of this shape has, in packing order;
        columns 0 means a vector."""
        s, v, rows_v = shape.samplers, shape.verified, shape.verified * shape.k1
        out = []
        if s:
            out.append(("sampled", s, 0, False))
            out += _logprob_parts("sample", s, shape.sample_top)
        if v:
            out += [("verified", v, shape.k1, False), ("accepted", v, 0, False)]
            out += _logprob_parts("verify", rows_v, shape.verify_top)
        if shape.draft_k:
            out.append(("drafts", v + s, shape.draft_k, False))
        return out

    def pack(self, shape: OutputShape, device: torch.device) -> torch.Tensor:
        """The parts as one flat int64 tensor (float64 bit-cast), in `parts` order."""
        flat = []
        for name, rows, cols, is_float in self.parts(shape):
            t = getattr(self, name)
            if t is None or t.numel() != rows * max(cols, 1):
                raise RuntimeError(f"step output {name} has {None if t is None else t.numel()} values, "
                                   f"not {rows * max(cols, 1)} (a bug)")
            flat.append(t.reshape(-1).double().view(torch.int64) if is_float else t.reshape(-1).long())
        return torch.cat(flat) if flat else torch.empty(0, dtype=torch.int64, device=device)

    @classmethod
    def unpack(cls, packed, shape: OutputShape) -> "StepOutputs":
        """The inverse of `pack`, as views of `packed` (a NumPy int64 array or an int64 tensor)."""
        as_float = (lambda a: a.view(np.float64)) if isinstance(packed, np.ndarray) else (
            lambda a: a.view(torch.float64))
        out, off = cls(), 0
        for name, rows, cols, is_float in cls.parts(shape):
            n = rows * max(cols, 1)
            part = packed[off:off + n]
            off += n
            part = as_float(part) if is_float else part
            setattr(out, name, part.reshape(rows, cols) if cols else part)
        if off != len(packed):
            raise RuntimeError(f"{len(packed)} packed step outputs, {off} expected (a bug)")
        return out


def _logprob_parts(prefix: str, rows: int, top: int) -> list[tuple[str, int, int, bool]]:
    if top < 0:
        return []
    parts = [(f"{prefix}_logprob", rows, 0, True), (f"{prefix}_rank", rows, 0, False)]
    if top > 0:
        parts += [(f"{prefix}_top_ids", rows, top, False), (f"{prefix}_top_logprobs", rows, top, True)]
    return parts

