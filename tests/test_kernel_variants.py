"""Compiled Triton kernel variants and the engine's watch that counts and names those compiled inside steps
(the server's qv:kernel_compiles), and the process memory split beside it: what a soak reads to tell compiles
inside steps from other growth."""

from __future__ import annotations

import sys
import types

from triton.runtime.jit import JITFunction

from qv.kernels.triton_utils import compiled_variants
from qv.server.metrics import resident_memory_split


def _kernel(x_ptr, n):
    pass


def test_compiled_variants_counts_each_kernel_of_qv_on_every_device(monkeypatch):
    ours, theirs = JITFunction(_kernel), JITFunction(_kernel)
    ours.device_caches = {0: ({"a": 1, "b": 2}, {}), 1: ({"c": 3}, {})}  # (kernel cache, ...) per device
    theirs.device_caches = {0: ({"d": 4}, {})}
    monkeypatch.setitem(sys.modules, "qv.kernels.fake_op", types.SimpleNamespace(fake=ours, helper=len))
    monkeypatch.setitem(sys.modules, "elsewhere.op", types.SimpleNamespace(fake=theirs))
    got = compiled_variants()
    assert got["qv.kernels.fake_op.fake"] == 3
    assert not any(name.startswith("elsewhere") for name in got)  # only qv's kernels count


def test_resident_memory_split_reads_anonymous_and_file_backed_pages():
    status = "Name:\tpython\nVmRSS:\t  300 kB\nRssAnon:\t  200 kB\nRssFile:\t   96 kB\nRssShmem:\t    4 kB\n"
    assert resident_memory_split(status) == {"anon": 200 * 1024.0, "file": 96 * 1024.0}
    assert resident_memory_split("Name:\tpython\n") == {}  # a system that does not say: nothing, not zeros


def test_compile_watch_names_each_variant_compiled_after_it_began(monkeypatch, caplog):
    from qv.engine.compile_watch import CompileWatch

    fn = JITFunction(_kernel)
    fn.device_caches = {0: ({"[1, 'D']": 1}, {})}
    monkeypatch.setitem(sys.modules, "qv.kernels.watched_op", types.SimpleNamespace(kern=fn))
    watch = CompileWatch(every=1)
    assert watch.check() == 0 and watch.num_compiles == 0
    fn.device_caches[0][0]["[17, '']"] = 2  # a step met a new class of arguments
    with caplog.at_level("WARNING", logger="qv.engine"):
        assert watch.check() == 1
    assert "qv.kernels.watched_op.kern" in caplog.text and "[17, '']" in caplog.text and "[1, 'D']" not in caplog.text
    late = JITFunction(_kernel)  # a kernel of a module first imported while serving, compiled in that step
    late.device_caches = {0: ({"k": 1}, {})}
    monkeypatch.setitem(sys.modules, "qv.kernels.late_op", types.SimpleNamespace(kern=late))
    assert watch.check() == 1 and watch.num_compiles == 2
    assert watch.check() == 0


def test_compile_watch_looks_every_nth_call(monkeypatch):
    from qv.engine.compile_watch import CompileWatch

    fn = JITFunction(_kernel)
    fn.device_caches = {0: ({"a": 1}, {})}
    monkeypatch.setitem(sys.modules, "qv.kernels.watched_op", types.SimpleNamespace(kern=fn))
    watch = CompileWatch(every=3)
    fn.device_caches[0][0]["b"] = 2
    assert [watch.check() for _ in range(4)] == [0, 0, 1, 0]
