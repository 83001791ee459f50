"""The op table: every op has a reference, a Triton implementation and an oracle test file here, listed in
registry.TABLE with a column per backend, and qv.kernels exports each op's wrapper."""

from __future__ import annotations

from pathlib import Path

from qv import kernels as K
from qv.kernels import registry


def test_every_op_has_reference_triton_and_oracle():
    ops = K.ops()
    assert len(ops) >= 15
    missing = []
    for op, impls in sorted(ops.items()):
        for backend in ("reference", "triton"):
            if backend not in impls:
                missing.append(f"{op}: no {backend} implementation")
        if not (Path(__file__).parent / f"test_{op}.py").exists():
            missing.append(f"{op}: no tests/oracles/test_{op}.py")
    assert not missing, "\n".join(missing)


def test_table_lists_each_op_per_backend():
    """Each row names every backend; a loaded implementation is the named module's function of the op's name,
    and qv.kernels.<op> is the public wrapper from the op's folder (the function, not the folder)."""
    assert set(registry.TABLE) == set(K.ops()) and set(K.__all__) >= set(registry.TABLE)
    for op, row in registry.TABLE.items():
        assert set(row) == {"reference", "triton", "sm70"}, op
        for backend, module in row.items():
            fn = K.ops()[op].get(backend)
            assert (fn is None) == (module is None), (op, backend)
            if fn is not None:
                assert (fn.__module__, fn.__name__) == (f"qv.kernels.{module}", op), (op, backend)
        wrapper = getattr(K, op)
        assert callable(wrapper) and wrapper.__module__ == f"qv.kernels.{op}", op
