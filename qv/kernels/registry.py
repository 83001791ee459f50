"""The op table: every op and its implementation per backend, and which backend is active.

Backends: "reference" (each op's reference.py, pure PyTorch fp32, the spec of the op), "triton" (its
Triton kernels, and the raw-CUDA ones they hand over to on sm_90) and "sm70" (raw CUDA m8n8k4 paths for
Volta, falling back to Triton for ops without one). "auto" uses the best kernels for the device of the
op's inputs and the reference ops on CPU.

The active backend is a process-wide choice made once at start-up (from the `kernels` lever);
tests switch it with the `backend(...)` context manager.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

import torch

BACKENDS = ("auto", "reference", "triton", "sm70")
_CHAINS = {
    "reference": ("reference",),
    "triton": ("triton",),
    "sm70": ("sm70", "triton"),
}

# op -> the module of each backend's implementation, under qv/kernels/<op>/; each defines a function named
# after the op with the wrapper's arguments (its shapes are in the op's __init__.py). None: no kernel yet.
# (An op folder's __init__.py must not import the top-level `triton`: its triton.py takes that name there.)
TABLE: dict[str, dict[str, str | None]] = {
    "rms_norm":         {"reference": "rms_norm.reference", "triton": "rms_norm.triton", "sm70": None},
    "gated_rms_norm":   {"reference": "gated_rms_norm.reference", "triton": "gated_rms_norm.triton", "sm70": None},
    "layer_norm":       {"reference": "layer_norm.reference", "triton": "layer_norm.triton", "sm70": None},
    "rope":             {"reference": "rope.reference", "triton": "rope.triton", "sm70": None},
    "rotary_embed":     {"reference": "rotary_embed.reference", "triton": "rotary_embed.triton", "sm70": None},
    "silu_mul":         {"reference": "silu_mul.reference", "triton": "silu_mul.triton", "sm70": None},
    "sigmoid_mul":      {"reference": "sigmoid_mul.reference", "triton": "sigmoid_mul.triton", "sm70": None},
    "gelu":             {"reference": "gelu.reference", "triton": "gelu.triton", "sm70": None},
    "linear":           {"reference": "linear.reference", "triton": "linear.triton", "sm70": "linear.cuda_sm70"},
    "grouped_delta":    {"reference": "grouped_delta.reference", "triton": "grouped_delta.triton",
                         "sm70": "grouped_delta.triton_sm70"},
    "write_kv":         {"reference": "write_kv.reference", "triton": "write_kv.triton", "sm70": None},
    "paged_attention":  {"reference": "paged_attention.reference", "triton": "paged_attention.triton",
                         "sm70": "paged_attention.cuda_sm70"},
    "varlen_attention": {"reference": "varlen_attention.reference", "triton": "varlen_attention.triton",
                         "sm70": "varlen_attention.torch_sdpa"},
    "causal_conv1d":    {"reference": "causal_conv1d.reference", "triton": "causal_conv1d.triton", "sm70": None},
    "gated_delta_rule": {"reference": "gated_delta_rule.reference", "triton": "gated_delta_rule.triton",
                         "sm70": "gated_delta_rule.cuda_sm70"},
    # no tl.dot in its kernels: sm70's chain falls back to the same Triton source
    "lm_head_top1":     {"reference": "lm_head_top1.reference", "triton": "lm_head_top1.triton", "sm70": None},
    # int64 hashing and one fp64 argmax: the reference's torch ops are the kernel, bit-identical on every device
    "race":             {"reference": "race.reference", "triton": "race.reference", "sm70": None},
}

_impls: dict[str, dict[str, Callable]] = {}
_active = "auto"


def load() -> None:
    """Import every implementation in TABLE (qv.kernels does, once, so a broken kernel module fails the import
    rather than the first forward step)."""
    for op, row in TABLE.items():
        if set(row) != set(_CHAINS):
            raise ValueError(f"op table: {op} lists backends {sorted(row)}, expected {sorted(_CHAINS)}")
        _impls[op] = {name: getattr(importlib.import_module(f"qv.kernels.{path}"), op)
                      for name, path in row.items() if path is not None}


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
    """Every op and its loaded implementations (read-only use)."""
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


def chain_for(device: torch.device) -> tuple[str, ...]:
    """The backends `impl` tries for tensors on `device`, in order, under the active backend."""
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
    chain = chain_for(device)
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
