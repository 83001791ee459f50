"""`qv kernels --arch sm_70` builds every sm70 kernel for Volta on a machine without a GPU (CUDA 12's NVRTC
from the nvidia-cuda-nvrtc-cu12 wheel, Triton's ptxas): no spills, m8n8k4 MMAs in every tensor-core kernel,
`.target sm_70` in every PTX it writes, and every kernel that an sm70 module launches listed in its BUILDS.
The checks are one function, `problems`, which the negative controls below show failing."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qv.kernels import ahead_of_time, registry
from qv.kernels.ahead_of_time import KernelReport
from qv.kernels.cuda_build import KERNEL_DIR

GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")


def build_problems() -> list[str]:
    """What BUILDS misses: an sm70 module without BUILDS, a .cu it names that BUILDS does not build, or a
    __global__ kernel of a built source with no instantiation in BUILDS."""
    out = []
    for op, row in registry.TABLE.items():
        if row["sm70"] is None:
            continue
        module = importlib.import_module(f"qv.kernels.{row['sm70']}")
        builds = getattr(module, "BUILDS", ())
        if not builds:
            out.append(f"{op}: qv.kernels.{row['sm70']} defines no BUILDS")
        named = {v for v in vars(module).values() if isinstance(v, str) and v.endswith(".cu")}
        out += [f"{op}: {src} is launched but not in BUILDS" for src in sorted(named - {b.source for b in builds})]
        for b in builds:
            built = {name.split("<")[0].strip() for name in b.names}
            kernels = set(GLOBAL.findall((KERNEL_DIR / b.source).read_text()))
            out += [f"{op}: kernel {k} of {b.source} has no instantiation in BUILDS" for k in sorted(kernels - built)]
    return out


def problems(reports: list[KernelReport], ptx_dir: Path | None = None) -> list[str]:
    """Spills, tensor-core kernels without m8n8k4 MMAs, PTX not for sm_70, and (with ptx_dir) kernels whose
    .ptx was not written; plus build_problems()."""
    out = build_problems()
    expected = {name for _, b in ahead_of_time.sm70_builds() for name in b.names}
    out += [f"{name}: in BUILDS but not compiled" for name in sorted(expected - {r.name for r in reports})]
    for r in reports:
        if r.spill_bytes:
            out.append(f"{r.name}: {r.spill_bytes} spill bytes")
        if r.tensor_cores and r.mma_m8n8k4 < 1:
            out.append(f"{r.name}: no m8n8k4 MMA in its PTX")
        if ".target sm_70" not in r.ptx:
            out.append(f"{r.name}: PTX not for sm_70")
        if ptx_dir is not None:
            f = ptx_dir / r.file_name
            if not f.exists() or ".target sm_70" not in f.read_text():
                out.append(f"{r.name}: no sm_70 PTX written at {f}")
    return out


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QV_")}
    run = subprocess.run([sys.executable, "-m", "qv.cli", "kernels", "--arch", "sm_70", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout, out


@pytest.fixture(scope="module")
def reports():
    return ahead_of_time.compile_all(70)


def test_every_sm70_kernel_builds_for_sm70(reports, cli_run):
    assert reports, "no sm70 kernel in any BUILDS"
    stdout, ptx_dir = cli_run
    assert problems(reports, ptx_dir) == []
    rows = [re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines()[3:]]
    table = {row[0]: row for row in rows if len(row) == 6}
    for r in reports:  # the printed table is the reports': registers, shared memory, spills, MMAs
        assert table[r.name][1:] == [r.op, str(r.registers), str(r.shared_bytes), "0", str(r.mma_m8n8k4)], stdout
        assert (ptx_dir / r.file_name).read_text() == r.ptx


def test_checks_fail_where_they_should(reports, monkeypatch, tmp_path):
    """Negative controls: a kernel dropped from BUILDS, a tensor-core kernel without MMAs, spills, PTX for
    another architecture and a .ptx not written are each reported."""
    r = next(r for r in reports if r.tensor_cores)
    doctored = [KernelReport(**{**vars(r), "mma_m8n8k4": 0, "spill_bytes": 8, "ptx": r.ptx.replace(
        ".target sm_70", ".target sm_80")})]
    found = problems(doctored, tmp_path)
    assert any("no m8n8k4 MMA" in p for p in found) and any("8 spill bytes" in p for p in found)
    assert any("PTX not for sm_70" in p for p in found) and any("no sm_70 PTX written" in p for p in found)
    assert any("in BUILDS but not compiled" in p for p in found)  # the other kernels are missing here

    from qv.kernels.linear import cuda_sm70

    build = cuda_sm70.BUILDS[0]
    fewer = build.__class__(build.source, tuple(n for n in build.names if "gemm" not in n), build.tensor_cores)
    monkeypatch.setattr(cuda_sm70, "BUILDS", (fewer,))
    assert any("kernel gptq_gemm_m884" in p and "no instantiation" in p for p in build_problems())
    monkeypatch.setattr(cuda_sm70, "BUILDS", ())
    assert any("defines no BUILDS" in p for p in build_problems())
    assert any("gptq_m884.cu is launched but not in BUILDS" in p for p in build_problems())


def test_ptxas_spills_are_read():
    """ptxas -v's spill bytes come through (a kernel capped at 32 registers with 64 values live)."""
    code = r"""
extern "C" __global__ void __launch_bounds__(1024, 2) spill(const float* __restrict__ x, float* y, int n) {
  float v[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) v[i] = x[threadIdx.x + i * n];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s = s * v[63 - i] + v[(i * 7) % 64];
  y[threadIdx.x] = s;
}"""
    rc, log, ptx = ahead_of_time.compile_ptx(ahead_of_time.nvrtc_for(70), code, [], 70)
    assert rc == 0, log
    stats = ahead_of_time._ptxas_report(ahead_of_time.find_ptxas(), ptx, 70)
    assert stats["registers"] <= 32 and stats["spill_bytes"] > 0


def test_missing_tools_are_one_line_errors(monkeypatch, tmp_path, capsys):
    from qv.cli import main

    monkeypatch.setenv("QV_PTXAS", str(tmp_path / "nope"))
    assert main(["kernels"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qv kernels: error: ptxas {str(tmp_path / 'nope')!r} (the ptxas lever) is not an executable file"]
    monkeypatch.delenv("QV_PTXAS")
    monkeypatch.setattr(ahead_of_time, "load_nvrtc", lambda major=None: None)
    assert main(["kernels", "--arch", "sm_70"]) == 2
    assert capsys.readouterr().err.strip() == (
        "qv kernels: error: NVRTC 12 not found (needed for sm_70): pip install nvidia-cuda-nvrtc-cu12")
    assert main(["kernels", "--arch", "sm_61"]) == 2
    assert "expected sm_NN with NN >= 70" in capsys.readouterr().err
