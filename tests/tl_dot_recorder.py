"""Which Triton kernels ran, and whether any of them uses tl.dot (which the sm70 chain must never run: no
tensor-core path below sm_80, and wrong results there from Triton 3.3 on).

`record_launches()` wraps every `kernel[grid](...)` launch (triton's KernelInterface.__getitem__: the GPU JIT,
the CPU interpreter, autotuners and heuristics alike; launches inside a CUDA-graph capture too, which is
where replays come from). `uses_dot` reads a kernel's source and that of every @triton.jit helper it calls."""

from __future__ import annotations

import contextlib
import inspect
import re
import types

DOT = re.compile(r"\btl\s*\.\s*dot\w*\s*\(")
CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def python_function(kernel) -> types.FunctionType:
    """The Python function under a Triton kernel object (JITFunction, InterpretedFunction, Autotuner, ...)."""
    while not isinstance(kernel, types.FunctionType):
        kernel = kernel.fn
    return kernel


def _is_kernel(obj) -> bool:
    from triton.runtime.jit import JITCallable, KernelInterface

    return isinstance(obj, (JITCallable, KernelInterface))


def uses_dot(fn: types.FunctionType, _seen: set | None = None) -> bool:
    """Whether fn's source, or a Triton helper it calls by name (recursively), contains tl.dot(...)."""
    seen = set() if _seen is None else _seen
    if fn in seen:
        return False
    seen.add(fn)
    src = inspect.getsource(fn)
    if DOT.search(src):
        return True
    helpers = {fn.__globals__.get(name) for name in CALL.findall(src)}
    return any(uses_dot(python_function(h), seen) for h in helpers if h is not None and _is_kernel(h))


class Launches:
    """Kernels launched while recording, by module-qualified name."""

    def __init__(self):
        self.kernels: dict[str, types.FunctionType] = {}

    def names(self) -> list[str]:
        return sorted(fn.__name__ for fn in self.kernels.values())

    def with_dot(self) -> list[str]:
        """Module-qualified names of the launched kernels that use tl.dot."""
        return sorted(name for name, fn in self.kernels.items() if uses_dot(fn))


@contextlib.contextmanager
def record_launches():
    from triton.runtime.jit import KernelInterface

    launches = Launches()
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        fn = python_function(self)
        launches.kernels[f"{fn.__module__}.{fn.__qualname__}"] = fn
        return original(self, grid)

    KernelInterface.__getitem__ = getitem
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original
