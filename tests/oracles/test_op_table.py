"""Every op in the table has a reference, a Triton implementation and an oracle test file here."""

from __future__ import annotations

from pathlib import Path

from qv import kernels as K


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
