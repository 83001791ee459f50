"""Triton grouped low-rank delta: one shrink launch (t = (x A^T) * scale for every slot's rows and rank
rows) and one expand launch (y += t B^T), each over (row block, slot, rank or column block). Programs
of a slot past its rows exit at once, so the grid may be sized by bounds (CUDA graphs). Few rows a slot
split the shrink's K over more programs (each a partial t, summed by the expand as it loads t: no atomics,
the same bits every run)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.grouped_delta.configs import FEW, MANY, MANY_ROWS, NO_DOT, shrink_splits
from qv.kernels.triton_utils import jit_per_step


@triton.jit
def _slot_rows(slot_start_ptr, s, num_rows, HAS_SLOTS: tl.constexpr):
    r0 = 0
    r1 = num_rows
    if HAS_SLOTS:  # one return: Triton types every return of a function alike, constexpr branch or not
        r0 = tl.load(slot_start_ptr + s).to(tl.int32)
        r1 = tl.load(slot_start_ptr + s + 1).to(tl.int32)
    return r0, r1


@triton.jit
def _row_tile(rows_ptr, m0, r1, BM: tl.constexpr):
    """BM of a slot's rows from m0 (masked at its end r1): their positions, mask and the x/y rows they name."""
    o_m = m0 + tl.arange(0, BM)
    m_m = o_m < r1
    return o_m, m_m, tl.load(rows_ptr + o_m, mask=m_m, other=0).to(tl.int64)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr, DOT: tl.constexpr):
    """a [M, R] @ b [R, N] in fp32: tl.dot, or (DOT off: sm_70, where Triton's tl.dot is wrong) CUDA-core sums."""
    if DOT:
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@jit_per_step("num_rows", "stride_split")  # stride_split: rows x rank
def shrink_kernel(t_ptr, x_ptr, rows_ptr, slot_start_ptr, a_ptr, scale_ptr, slot_rows_ptr, num_rows, K,
                  stride_t, stride_x, stride_a, M1, stride_split, K_SPLIT,
                  HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                  BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr):
    """Grid axis 2: rank block x split; split p sums K from p * K_SPLIT into partial p of t (K_SPLIT a multiple
    of BK)."""
    s = tl.program_id(1)
    r0, r1 = _slot_rows(slot_start_ptr, s, num_rows, HAS_SLOTS)
    m0 = r0 + tl.program_id(0) * BM
    lo = tl.load(slot_rows_ptr + s * M1)
    hi = tl.load(slot_rows_ptr + s * M1 + M1 - 1)
    j0 = lo + (tl.program_id(2) // SPLITS) * BR
    split = tl.program_id(2) % SPLITS
    if (m0 < r1) & (j0 < hi):
        o_m, m_m, row = _row_tile(rows_ptr, m0, r1, BM)
        o_j = j0 + tl.arange(0, BR)
        m_j = o_j < hi
        acc = tl.zeros([BM, BR], dtype=tl.float32)
        k_lo = split * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            b_x = tl.load(x_ptr + row[:, None] * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
            b_a = tl.load(a_ptr + o_j[:, None].to(tl.int64) * stride_a + o_k[None, :],
                          mask=m_j[:, None] & m_k[None, :], other=0.)
            acc += _mm(b_x, tl.trans(b_a), IEEE, DOT)
        acc *= tl.load(scale_ptr + o_j, mask=m_j, other=0.)[None, :]
        tl.store(t_ptr + split * stride_split + o_m[:, None].to(tl.int64) * stride_t + (o_j - lo)[None, :], acc,
                 mask=m_m[:, None] & m_j[None, :])


@jit_per_step("num_rows", "stride_split")
def expand_kernel(y_ptr, t_ptr, rows_ptr, slot_start_ptr, b_ptr, b_off_ptr, col_ptr, width_ptr, slot_rows_ptr,
                  member_cols_ptr, num_rows, N, stride_y, stride_t, stride_split,
                  HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, MEMBERS: tl.constexpr,
                  BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, ALIGN: tl.constexpr, SPLITS: tl.constexpr):
    s = tl.program_id(1)
    r0, r1 = _slot_rows(slot_start_ptr, s, num_rows, HAS_SLOTS)
    m0 = r0 + tl.program_id(0) * BM
    n0 = tl.program_id(2) * BN
    base = slot_rows_ptr + s * (MEMBERS + 1)
    lo = tl.load(base)
    # only the rank rows of members whose columns meet this block (a fused Linear's other members add 0)
    j_lo = tl.load(base + MEMBERS)
    j_hi = lo
    for m in tl.static_range(MEMBERS):
        hit = (tl.load(member_cols_ptr + m) < n0 + BN) & (tl.load(member_cols_ptr + m + 1) > n0)
        j_lo = tl.where(hit, tl.minimum(j_lo, tl.load(base + m)), j_lo)
        j_hi = tl.where(hit, tl.maximum(j_hi, tl.load(base + m + 1)), j_hi)
    if (m0 < r1) & (j_lo < j_hi):
        o_m, m_m, row = _row_tile(rows_ptr, m0, r1, BM)
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for j0 in range(j_lo, j_hi, BR):
            o_j = j0 + tl.arange(0, BR)
            m_j = o_j < j_hi
            p_t = t_ptr + o_m[:, None].to(tl.int64) * stride_t + (o_j - lo)[None, :]
            m_t = m_m[:, None] & m_j[None, :]
            b_t = tl.load(p_t, mask=m_t, other=0.)
            for split in tl.static_range(1, SPLITS):  # the shrink's partials over K, in a fixed order
                b_t += tl.load(p_t + split * stride_split, mask=m_t, other=0.)
            off = tl.load(b_off_ptr + o_j, mask=m_j, other=0)
            c = tl.load(col_ptr + o_j, mask=m_j, other=0)
            w = tl.load(width_ptr + o_j, mask=m_j, other=0)
            if ALIGN > 1:  # the bank says so (DeltaBankView.b_align): each B row's load goes ALIGN elements at once
                off = tl.multiple_of(off, ALIGN)
                c = tl.multiple_of(c, ALIGN)
                w = tl.multiple_of(w, ALIGN)
            rel = o_n[None, :] - c[:, None]
            m_b = m_j[:, None] & (rel >= 0) & (rel < w[:, None])
            b_b = tl.load(b_ptr + off[:, None] + rel, mask=m_b, other=0.)
            if IEEE:
                acc += _mm(b_t, b_b.to(tl.float32), IEEE, DOT)
            else:
                acc += _mm(b_t.to(b_b.dtype), b_b, IEEE, DOT)
        p_y = y_ptr + row[:, None] * stride_y + o_n[None, :]
        m_y = m_m[:, None] & m_n[None, :]
        b_y = tl.load(p_y, mask=m_y, other=0.).to(tl.float32)
        tl.store(p_y, (b_y + acc).to(y_ptr.dtype.element_ty), mask=m_y)


def grouped_delta(y, x, rows, slot_start, max_rows, bank, dot: bool = True):
    """In place on y; returns y (dot False: no tl.dot, the sm70 chain's form). fp32 tensors multiply in
    IEEE fp32 (no TF32), 16-bit ones on tensor cores
    with fp32 accumulation (the shrink's output t stays fp32 and is rounded once, for the expand)."""
    n, k = y.shape[-1], x.shape[-1]
    if y.stride(-1) != 1 or x.stride(-1) != 1 or bank.a.stride(-1) != 1:
        raise ValueError("grouped_delta: y, x and a need a unit inner stride")
    num_rows = rows.numel()
    if num_rows == 0 or max_rows == 0 or bank.max_slot_rank == 0:
        return y
    slots = 1 if slot_start is None else slot_start.shape[0] - 1
    has_slots = slot_start is not None
    ss = slot_start if has_slots else rows  # an unread pointer when every row runs slot 0
    ieee = x.dtype == torch.float32
    m1 = bank.slot_rows.shape[1]
    bm, br, bk, bn = (MANY if max_rows >= MANY_ROWS else FEW) if dot else NO_DOT
    splits = shrink_splits(max_rows, k, bk, x.device) if dot else 1
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    t = torch.empty(splits, num_rows, bank.max_slot_rank, dtype=torch.float32, device=x.device)
    row_blocks = triton.cdiv(max_rows, bm)  # grid axis 0: a slot's row blocks run side by side, sharing A/B tiles
    shrink_kernel[(row_blocks, slots, triton.cdiv(bank.max_slot_rank, br) * splits)](
        t, x, rows, ss, bank.a, bank.scale, bank.slot_rows, num_rows, k, t.stride(1), x.stride(0), bank.a.stride(0),
        m1, t.stride(0), k_split, HAS_SLOTS=has_slots, IEEE=ieee, DOT=dot, BM=bm, BR=br, BK=bk, SPLITS=splits)
    expand_kernel[(row_blocks, slots, triton.cdiv(n, bn))](
        y, t, rows, ss, bank.b, bank.b_off, bank.col, bank.width, bank.slot_rows, bank.member_cols, num_rows, n,
        y.stride(0), t.stride(1), t.stride(0), HAS_SLOTS=has_slots, IEEE=ieee, DOT=dot, MEMBERS=m1 - 1, BM=bm,
        BR=br, BN=bn, ALIGN=bank.b_align, SPLITS=splits)
    return y
