"""Kernels compiled inside serving steps. Triton compiles a kernel variant at its first launch with a new
class of arguments (a second or more, with every request waiting, and ~15 MiB of host memory kept: the 27B
soak in docs/BENCHMARKS.md). The warm-up compiles what serving should meet; this watch tells an operator, by
kernel name and specialization key, each variant a step compiled after it (the shapes the warm-up missed)."""

from __future__ import annotations

import logging
import sys

from qv.kernels.triton_utils import jit_kernels, variant_count, variant_keys

log = logging.getLogger("qv.engine")


class CompileWatch:
    def __init__(self, every: int = 16):
        """every: look only every this many calls (a look counts the variants of every qv kernel)."""
        self.every, self._calls = every, 0
        self.kernels: dict = {}
        self.seen: dict[str, int] = {}
        self.num_compiles = 0  # variants compiled since the watch began
        self._rescan(first=True)

    def _rescan(self, first: bool = False) -> None:
        """Kernels of modules imported since: a module first imported while serving brings its own, and each of
        their variants was compiled after the warm-up."""
        self._modules = len(sys.modules)
        for name, fn in jit_kernels().items():
            if name not in self.kernels:
                self.kernels[name] = fn
                self.seen[name] = variant_count(fn) if first else 0

    def check(self) -> int:
        """Variants compiled since the last look (each logged with its kernel and key), looking every `every` calls."""
        self._calls += 1
        if self._calls % self.every:
            return 0
        if len(sys.modules) != self._modules:
            self._rescan()
        new = 0
        for name, fn in self.kernels.items():
            count = variant_count(fn)
            if count > self.seen[name]:
                keys = variant_keys(fn)[self.seen[name] - count:]
                log.warning("Triton compiled %d variant(s) of %s inside a step after the warm-up (the warm-up never "
                            "met this class of arguments): %s", count - self.seen[name], name, "; ".join(keys)[:2000])
                new += count - self.seen[name]
                self.seen[name] = count
        self.num_compiles += new
        return new
