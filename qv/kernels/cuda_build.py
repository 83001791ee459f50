"""Building and launching qv's raw-CUDA kernels (the .cu files in the op folders): NVRTC compiles a
template instantiation through CuPy (the `gpu` extra) at first use, and launches go on torch's current
stream. A failed build or module load is reported once and remembered, so callers fall back to their
Triton kernels instead of raising in every decode step."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qv.kernels.triton_utils import num_sms

KERNEL_DIR = Path(__file__).parent
COMPILE_OPTIONS = ("-std=c++17",)
HEADER = "cuda_common.cuh"

# benchmarks and profilers set this: eager calls then run the raw-CUDA kernels too (their GPU time, not
# the host-time policy of worth_launching, is what those tools measure)
EAGER_ALWAYS = False
_AS_CAPTURED = threading.local()  # .on: this thread's eager calls choose kernels as a graph capture does
_BUILT: dict[tuple, tuple | None] = {}  # (file, name, device) -> (function, registers) or None


@dataclass(frozen=True)
class KernelBuild:
    """One raw-CUDA source and the template instantiations of it that ship: what `qv kernels --arch` compiles
    ahead of time and `qv doctor` checks. Each op's cuda_sm70.py lists its own in BUILDS."""

    source: str  # under KERNEL_DIR, e.g. "linear/gptq_gemv_m884.cu"
    names: tuple[str, ...]  # template instantiations, as NVRTC name expressions
    tensor_cores: bool  # its PTX must hold mma.sync m8n8k4 instructions (on sm_70)


@functools.lru_cache(maxsize=None)
def cupy_or_none():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def source_text(source: str) -> str:
    """The code of KERNEL_DIR/source (a path such as "linear/gptq_gemv_mma.cu") with the shared header, and
    any other header it #includes by a quoted path relative to itself (an op folder's own), pasted in place
    of the #include lines, each once (so NVRTC needs no include path, and CuPy's compile cache, keyed by
    the code, sees a change to a header too)."""
    path = KERNEL_DIR / source
    include = f'#include "{Path(os.path.relpath(KERNEL_DIR / HEADER, path.parent)).as_posix()}"\n'
    code = path.read_text()
    if include not in code:
        raise ValueError(f"{source}: expected the line {include.strip()!r}")
    return _paste_includes(code, path.parent, set())


def _paste_includes(code: str, folder: Path, pasted: set[Path]) -> str:
    def paste(match: re.Match) -> str:
        header = (folder / match.group(1)).resolve()
        if header in pasted:
            return ""
        pasted.add(header)
        return _paste_includes(header.read_text().replace("#pragma once\n", ""), header.parent, pasted)

    return re.sub(r'^#include "([^"]+)"\n', paste, code, flags=re.M)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def is_built(source: str, name: str, index: int) -> bool:
    """Whether `name` was built (or tried) on device `index`: a graph capture must not trigger a build."""
    return (source, name, index) in _BUILT


def build(source: str, name: str, index: int):
    """The kernel `name` (a template instantiation) from KERNEL_DIR/source on device `index`, as
    (CuPy function, registers per thread), or None if NVRTC or the module load failed. (The shared-memory
    carveout stays the driver's choice: preferring all shared memory measured slower for both kernels, whose
    loads in flight need the L1; re-measure: python bench/kernels.py --only decode,gemv.)"""
    key = (source, name, index)
    if key not in _BUILT:
        cupy = cupy_or_none()
        try:
            with cupy.cuda.Device(index):
                module = cupy.RawModule(code=source_text(source), options=COMPILE_OPTIONS,
                                        name_expressions=(name,))
                function = module.get_function(name)
                _BUILT[key] = (function, function.num_regs)
        except Exception as e:  # noqa: BLE001 - any build or load error means: use the other kernels
            warnings.warn(f"qv: the CUDA kernel {name} did not build ({type(e).__name__}: {e}); "
                          "its op falls back (to the Triton kernels; under the sm70 backend, to the reference "
                          "math)", RuntimeWarning, stacklevel=3)
            _BUILT[key] = None
    return _BUILT[key]


def kernel_for(source: str, name: str, device: torch.device, nbytes: int, cfg: dict):
    """(function, registers) of kernel `name` for a call reading `nbytes`, or None where it should not run:
    a CUDA graph is being captured before it was built (NVRTC and module loads do not belong in a
    capture), the build failed, or worth_launching says no (after building, so that an engine's eager
    warm-up compiles what its graph capture will use)."""
    index = device_index(device)
    if not is_built(source, name, index) and torch.cuda.is_current_stream_capturing():
        return None
    built = build(source, name, index)
    if built is None or not worth_launching(nbytes, cfg):
        return None
    return built


def resident_blocks(regs: int, threads: int, device: torch.device, cap: int = 16) -> int:
    """Blocks of `threads` threads the SMs hold at once, by registers (allocated in units of 8 a thread)."""
    return max(1, min(cap, 65536 // (threads * ((regs + 7) // 8 * 8)))) * num_sms(device)


def worth_launching(nbytes: int, cfg: dict) -> bool:
    """Whether a raw-CUDA kernel should run for a call reading `nbytes`. A CuPy launch costs more host time
    than a Triton one (re-measure: python bench/host_launch.py), which eager steps (speculative
    verification, delta rows) pay in full when they are host-bound. So: always while a CUDA graph is being
    captured (replays cost no host time) or under same_kernels_as_capture, and eagerly only from
    cfg["eager_min_bytes"] on, where the GPU time exceeds the host time."""
    return (EAGER_ALWAYS or torch.cuda.is_current_stream_capturing() or getattr(_AS_CAPTURED, "on", False)
            or nbytes >= cfg.get("eager_min_bytes", 0))


@contextlib.contextmanager
def same_kernels_as_capture():
    """Within: this thread's eager calls run the kernels a CUDA graph capture would (worth_launching says
    yes), so an eager forward can be compared with a graph's replay kernel for kernel (the decode graphs'
    start-up check; their Triton twins differ by rounding, which compounds over 64 bf16 layers)."""
    previous = getattr(_AS_CAPTURED, "on", False)
    _AS_CAPTURED.on = True
    try:
        yield
    finally:
        _AS_CAPTURED.on = previous


def pointer(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(t.data_ptr() if t is not None else 0)


def launch(kernel, grid, block, args, device: torch.device, shared_mem: int = 0) -> None:
    """Launch on torch's current stream of `device` (so CUDA graphs capture it like a torch op), with
    `shared_mem` bytes of dynamic shared memory."""
    cupy = cupy_or_none()
    index = device_index(device)
    with cupy.cuda.Device(index), _stream(torch.cuda.current_stream(device).cuda_stream, index):
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=64)
def _stream(handle: int, device_index: int):
    """torch's stream as a CuPy stream (kept: a launch per decode step should not build one; keyed by
    device too, since handle 0, the legacy default stream, is the same number on every device)."""
    cupy = cupy_or_none()
    try:  # CuPy >= 14 (ExternalStream is deprecated there)
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    except (AttributeError, TypeError, ValueError):
        return cupy.cuda.ExternalStream(handle)


class _StreamHandle:
    """The CUDA stream protocol (``__cuda_stream__``) around a raw handle."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)
