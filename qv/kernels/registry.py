"""The op table: op name -> implementation per backend, and which backend is active.

Backends: "reference" (qv/kernels/reference.py, pure PyTorch fp32, the spec of every op),
"triton" (the Triton kernels beside each public wrapper) and "sm70" (raw CUDA m8n8k4 paths
for Volta, falling back to Triton for ops without one). "auto" uses the best kernels for the
device of the op's inputs and the reference ops on CPU.

The active backend is a process-wide choice made once at start-up (from the `kernels` lever);
tests switch it with the `backend(...)` context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

BACKENDS = ("auto", "reference", "triton", "sm70")
_CHAINS = {
    "reference": ("reference",),
    "triton": ("triton",),
    "sm70": ("sm70", "triton"),
}
_impls: dict[str, dict[str, Callable]] = {}
_active = "auto"


def register(op: str, backend: str, fn: Callable | None = None):
    """Register `fn` as the `backend` implementation of `op` (usable as a decorator)."""
    if backend not in _CHAINS:
        raise ValueError(f"unknown backend {backend!r}")

    def deco(f: Callable) -> Callable:
        _impls.setdefault(op, {})[backend] = f
        return f

    return deco(fn) if fn is not None else deco


def set_backend(name: str) -> None:
    global _active
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}: expected one of {', '.join(BACKENDS)}")
    _active = name


def get_backend() -> str:
    return _active


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    previous = _active
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def ops() -> dict[str, dict[str, Callable]]:
    """Every registered op and its implementations (read-only use)."""
    return _impls


def triton_can_run(device: torch.device) -> bool:
    """Triton runs on CUDA, or on CPU when the interpreter was enabled before triton was imported."""
    if device.type == "cuda":
        return True
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except ImportError:  # older triton
        return False


def _chain_for(device: torch.device) -> tuple[str, ...]:
    if _active != "auto":
        return _CHAINS[_active]
    if device.type != "cuda":
        return ("reference",)
    major, _ = torch.cuda.get_device_capability(device)
    # "auto" falls back to the reference op where no kernel exists yet; explicit backends never do.
    return ("sm70", "triton", "reference") if major == 7 else ("triton", "reference")


def impl(op: str, device: torch.device) -> Callable:
    """The implementation of `op` for tensors on `device` under the active backend."""
    table = _impls.get(op)
    if table is None:
        raise KeyError(f"unknown op {op!r}")
    chain = _chain_for(device)
    for name in chain:
        fn = table.get(name)
        if fn is None:
            continue
        if name in ("triton", "sm70") and not triton_can_run(device):
            raise RuntimeError(
                f"op {op}: the {name} backend needs a CUDA device (or TRITON_INTERPRET=1 set before "
                f"importing triton, for CPU tests); inputs are on {device}"
            )
        return fn
    raise NotImplementedError(f"op {op} has no implementation for backend {_active!r} (tried {', '.join(chain)})")
