"""Test helpers: one relative-error metric for every oracle comparison, NaN poisoning, and stopping
a server subprocess."""

from __future__ import annotations

import subprocess

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (with a tiny floor so an all-zero reference is usable)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, bound: float) -> float:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: output has NaN (unwritten or overflowed elements)"
    err = rel_err(out, ref)
    assert err < bound, f"{name}: relative error {err:.3e} >= bound {bound:.1e}"
    return err


def poisoned(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A tensor full of NaN (or the integer minimum), so an output a kernel forgets to write shows."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM a server subprocess; kill it if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
