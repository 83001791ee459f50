"""Helpers for the kernel oracle tests (tests/oracles/test_<op>.py): the device, error bounds,
NaN-poisoned allocations inside the kernel under test, and paged-cache fixtures.

Every test runs the public op under the "triton" backend and the reference op on the same fresh
random inputs; on CPU the Triton kernels run through the interpreter at tiny shapes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from qv import kernels as K

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# relative RMS error bounds (DESIGN.md): fp32 paths 1e-5, 16-bit activations 1e-2
BOUND = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min)


@contextlib.contextmanager
def nan_empty():
    """torch.empty/empty_like return poisoned tensors meanwhile, so an output element a kernel
    forgets to write shows up as NaN (or the integer minimum)."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **kw: _poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: _poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def run_triton(fn, *args, **kwargs):
    with K.backend("triton"), nan_empty():
        return fn(*args, **kwargs)


def run_reference(fn, *args, **kwargs):
    with K.backend("reference"):
        return fn(*args, **kwargs)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEV)


def paged_layout(seq_lens: list[int], block_size: int, spare: int = 3):
    """Block tables [B, MB] int32 over shuffled physical blocks (a few left unused) and the total."""
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for m in need:
        tables.append(perm[i:i + m])
        i += m
    width = max([len(t) for t in tables] + [1])
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    return bt, tables, num_blocks


def slots_for(tables: list[list[int]], starts: list[int], ends: list[int], block_size: int) -> torch.Tensor:
    """slot_mapping of positions starts[b]..ends[b]-1 of every sequence, in batch order."""
    slots = []
    for table, s, e in zip(tables, starts, ends):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s, e)]
    return torch.tensor(slots, dtype=torch.int64, device=DEV)


def capture_graph(fn):
    """fn() captured into a CUDA graph on a side stream: (graph, what fn returned while capturing)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            result = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


def _cuda_kernels_can_run() -> bool:
    from qv.kernels.cuda_build import cupy_or_none

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8 and cupy_or_none() is not None


# the raw-CUDA kernels (cuda_build: the GEMV, decode attention) run on sm_80+ with CuPy
needs_cuda_kernels = pytest.mark.skipif(not _cuda_kernels_can_run(),
                                        reason="needs an sm_80+ GPU and CuPy (the gpu extra)")
