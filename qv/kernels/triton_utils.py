"""Small helpers shared by the Triton kernels: block sizes, SM count, row views, and the varlen
sequence search of the attention and chunked-GDN kernels."""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl


def jit_per_step(*counts: str):
    """triton.jit for a kernel that takes counts which change from step to step (rows, sequences, positions):
    Triton compiles a variant per class of each integer argument (equal to 1, a multiple of 16, other), so a
    step whose counts meet a new class of classes would stall on a compile (a second or more) in the middle of
    serving and keep one more module in host memory; these arguments are left unspecialized (they bound masks
    and searches, where the classes buy nothing)."""
    return triton.jit(do_not_specialize=list(counts))


def jit_kernels() -> dict:
    """qv's Triton kernels the process has imported, by module.name (launched or not)."""
    from triton.runtime.jit import JITFunction

    out = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("qv.kernels") or module is None:
            continue
        for attr, fn in list(vars(module).items()):
            if isinstance(fn, JITFunction) and hasattr(fn, "device_caches"):
                out[f"{name}.{attr}"] = fn
    return out


def variant_keys(fn) -> list[str]:
    """The specialization keys of a Triton kernel's compiled variants, oldest first, over every device (each
    names the argument classes and constexprs it was compiled for)."""
    return [str(key) for caches in list(fn.device_caches.values()) for key in list(caches[0])]


def variant_count(fn) -> int:
    """Compiled variants of one Triton kernel, over every device."""
    return sum(len(caches[0]) for caches in list(fn.device_caches.values()))


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each of qv's Triton kernels, by module.name (all devices): a count that grows while
    serving means kernels compiling inside steps."""
    return {name: variant_count(fn) for name, fn in jit_kernels().items()}


def next_pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return triton.next_power_of_2(max(int(n), int(floor), 1))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device` (a small fixed number under the CPU interpreter, to keep grids tiny)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def rows2d(x: torch.Tensor) -> torch.Tensor:
    """x viewed as [rows, last_dim] with a unit inner stride (copying only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def interpreting(device: torch.device) -> bool:
    return device.type != "cuda"


def row_blocks(n_rows: int, d: int) -> tuple[int, int]:
    """(rows, padded row length) of a row-norm program: whole rows, at most 16 and about 4096 values a program."""
    block_d = next_pow2(d)
    block_r = max(1, min(16, 4096 // block_d))
    return block_r, block_d


@triton.jit
def find_seq(cu_ptr, x, B, BQ: tl.constexpr, VIRTUAL: tl.constexpr):
    """Largest b in [0, B) with start(b) <= x; start(b) = cu[b] (tokens) or cu[b] // BQ + b (tiles)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        v = tl.load(cu_ptr + mid)
        if VIRTUAL:
            v = v // BQ + mid
        if v <= x:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid in a GEMM grid where GROUP_M row tiles sweep the columns
    together, so the programs running at once share weight tiles in L2."""
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * n_n) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * n_n)) % size_m, (pid % (GROUP_M * n_n)) // size_m


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] output tile (grouped_tile's order over grid axis 0): its row and column
    offsets, int64 so row * stride cannot overflow, and their in-bounds masks."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    o_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return o_m, o_n, o_m < M, o_n < N
