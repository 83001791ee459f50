"""The low-rank deltas one Linear may add, for every slot at once: Clef's (slot 0: its LoRA and deabl
modules) and the served LoRA adapters' (slots 1..). A pool of rank rows allocated once (CUDA graphs
and the memory plan see fixed tensors); writing a slot rewrites its region and its row table only.

Layout (qv.kernels.grouped_delta.DeltaBankView): rank row j = one rank of one module: its A row, its
scale, and its B column over the module's output columns (a member of a fused Linear), stored flat. A
slot owns a fixed region of rank rows and of B elements; its rows are packed at the region's start,
sorted by member. An adapter of rank r on members m costs exactly r * (K + N_m) elements, however
the Linear is fused."""

from __future__ import annotations

import math

import numpy as np
import torch

from qv import kernels as K
from qv.kernels.grouped_delta import DeltaBankView, DeltaGroups  # noqa: F401 - the engine imports DeltaGroups here


class DeltaBank:
    def __init__(self, in_features: int, member_sizes: list[int], rank_rows: list[int], b_elems: list[int],
                 dtype: torch.dtype, device: torch.device | str, pin: bool = False):
        """rank_rows[s] / b_elems[s]: the capacity of slot s. pin: pinned host memory, streamed per use."""
        self.in_features, self.member_sizes = in_features, list(member_sizes)
        self.member_cols = np.concatenate([[0], np.cumsum(member_sizes)]).astype(np.int32)
        self.rank_rows, self.b_elems = list(rank_rows), list(b_elems)
        self.row_base = np.concatenate([[0], np.cumsum(rank_rows)]).astype(np.int64)
        self.b_base = np.concatenate([[0], np.cumsum(b_elems)]).astype(np.int64)
        self.device, self.pin = torch.device(device), pin
        p, w = int(self.row_base[-1]), int(self.b_base[-1])

        def zeros(*shape, dt=dtype):
            t = torch.zeros(*shape, dtype=dt, device=self.device)
            return t.pin_memory() if pin else t

        self.a, self.b = zeros(p, in_features), zeros(max(w, 1))
        self.b_off, self.col, self.width = zeros(p, dt=torch.int64), zeros(p, dt=torch.int32), zeros(p, dt=torch.int32)
        self.scale = zeros(p, dt=torch.float32)
        self.slot_rows_host = np.repeat(self.row_base[:-1, None], len(member_sizes) + 1, axis=1).astype(np.int32)
        self.slot_rows = zeros(*self.slot_rows_host.shape, dt=torch.int32)
        self.slot_rows.copy_(torch.from_numpy(self.slot_rows_host))
        self.member_cols_t = zeros(len(self.member_cols), dt=torch.int32)
        self.member_cols_t.copy_(torch.from_numpy(self.member_cols))
        self._view: DeltaBankView | None = None

    @property
    def num_slots(self) -> int:
        return len(self.rank_rows)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.b_off, self.col, self.width, self.scale))

    def member_of(self, start: int, end: int) -> int:
        """The member whose output columns are [start, end)."""
        for m in range(len(self.member_sizes)):
            if self.member_cols[m] == start and self.member_cols[m + 1] == end:
                return m
        raise ValueError(f"no member of this Linear has output columns [{start}, {end}) "
                         f"(members {self.member_cols.tolist()})")

    def need(self, pieces: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> tuple[int, int]:
        """(rank rows, B elements) that `pieces` take: (member, a [r, K], b [N_m, r], scale) each."""
        return sum(a.shape[0] for _, a, _, _ in pieces), sum(b.numel() for _, _, b, _ in pieces)

    def write(self, slot: int, pieces: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> None:
        """Make slot `slot` compute these modules (replacing what it held). Shapes are checked here."""
        for m, a, b, _ in pieces:
            if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != self.in_features
                    or b.shape != (self.member_sizes[m], a.shape[0])):
                raise ValueError(f"delta for member {m}: A {tuple(a.shape)}, B {tuple(b.shape)}; the Linear has "
                                 f"{self.in_features} inputs and {self.member_sizes[m]} outputs there")
        rows, elems = self.need(pieces)
        if rows > self.rank_rows[slot] or elems > self.b_elems[slot]:
            raise ValueError(f"slot {slot} holds {self.rank_rows[slot]} rank rows and {self.b_elems[slot]} B elements; "
                             f"these deltas need {rows} and {elems}")
        pieces = sorted(pieces, key=lambda p: p[0])  # stable: a member's modules stay in the given order
        r0, b0 = int(self.row_base[slot]), int(self.b_base[slot])
        counts = np.zeros(len(self.member_sizes), dtype=np.int64)
        if pieces:
            a_rows = torch.cat([a for _, a, _, _ in pieces]).to(self.a.dtype)
            b_flat = torch.cat([b.t().reshape(-1) for _, _, b, _ in pieces]).to(self.b.dtype)  # each rank's column
            widths = np.concatenate([np.full(a.shape[0], self.member_sizes[m]) for m, a, _, _ in pieces])
            cols = np.concatenate([np.full(a.shape[0], self.member_cols[m]) for m, a, _, _ in pieces])
            scales = np.concatenate([np.full(a.shape[0], s, dtype=np.float32) for _, a, _, s in pieces])
            offs = b0 + np.concatenate([[0], np.cumsum(widths)[:-1]])
            for m, a, _, _ in pieces:
                counts[m] += a.shape[0]
            self.a[r0:r0 + rows].copy_(a_rows)
            self.b[b0:b0 + elems].copy_(b_flat)
            self.b_off[r0:r0 + rows].copy_(torch.from_numpy(offs.astype(np.int64)))
            self.col[r0:r0 + rows].copy_(torch.from_numpy(cols.astype(np.int32)))
            self.width[r0:r0 + rows].copy_(torch.from_numpy(widths.astype(np.int32)))
            self.scale[r0:r0 + rows].copy_(torch.from_numpy(scales))
        self.slot_rows_host[slot] = r0 + np.concatenate([[0], np.cumsum(counts)])
        self.slot_rows.copy_(torch.from_numpy(self.slot_rows_host))

    def clear(self, slot: int) -> None:
        self.write(slot, [])

    def grow(self, rank_rows: list[int], b_elems: list[int]) -> None:
        """Append slots of these capacities (existing slots keep their contents and offsets)."""
        p, w = sum(rank_rows), sum(b_elems)
        old_slots = self.num_slots

        def cat(t, n, *shape):
            z = torch.zeros(n, *shape, dtype=t.dtype, device=self.device)
            out = torch.cat([t, z])
            return out.pin_memory() if self.pin else out

        self.a = cat(self.a, p, self.in_features)
        used = int(self.b_base[-1])  # b keeps one placeholder element while empty
        self.b = cat(self.b[:used], w if used + w else 1)
        self.b_off, self.col, self.width = cat(self.b_off, p), cat(self.col, p), cat(self.width, p)
        self.scale = cat(self.scale, p)
        self.rank_rows += list(rank_rows)
        self.b_elems += list(b_elems)
        self.row_base = np.concatenate([[0], np.cumsum(self.rank_rows)]).astype(np.int64)
        self.b_base = np.concatenate([[0], np.cumsum(self.b_elems)]).astype(np.int64)
        new = np.repeat(self.row_base[old_slots:-1, None], len(self.member_sizes) + 1, axis=1).astype(np.int32)
        self.slot_rows_host = np.concatenate([self.slot_rows_host, new])
        self.slot_rows = torch.from_numpy(self.slot_rows_host.copy()).to(self.device)
        if self.pin:
            self.slot_rows = self.slot_rows.pin_memory()
        self._view = None

    def view(self, device: torch.device) -> DeltaBankView:
        if self._view is None:
            self._view = DeltaBankView(self.a, self.b, self.b_off, self.col, self.width, self.scale, self.slot_rows,
                                       self.member_cols_t, max(self.rank_rows, default=0), self.b_align)
        v = self._view
        if v.a.device == device:
            return v
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731 - pinned host deltas, streamed for this use
        return DeltaBankView(move(v.a), move(v.b), move(v.b_off), move(v.col), move(v.width), move(v.scale),
                             move(v.slot_rows), move(v.member_cols), v.max_slot_rank, v.b_align)

    @property
    def b_align(self) -> int:
        """The largest power of two up to 8 dividing every member's width and every slot's B base: then it divides
        every rank row's b_off, col and width (write lays a slot's B columns out back to back from its base)."""
        return math.gcd(8, *map(int, self.member_sizes), *map(int, self.b_base))  # a divisor of 8: 1, 2, 4 or 8

    def apply(self, y: torch.Tensor, x: torch.Tensor, delta_rows: torch.Tensor | DeltaGroups) -> torch.Tensor:
        """y += each delta row's slot delta (a plain row tensor: every row runs slot 0, Clef's)."""
        if isinstance(delta_rows, DeltaGroups):
            g = delta_rows
            return K.grouped_delta(y, x, g.rows, g.slot_start, g.max_rows, self.view(x.device))
        return K.grouped_delta(y, x, delta_rows, None, delta_rows.numel(), self.view(x.device))
