"""Test helpers: one relative-error metric for every oracle comparison, NaN poisoning, the bounds of
statistical tests, stopping a server subprocess, and running greedy requests through an engine to the end."""

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


# The chance that a correct implementation fails a statistical test somewhere in one CI run. Each such
# test is seeded (tests/conftest.py) and splits this budget evenly among the checks of its file.
FALSE_ALARM_PER_RUN = 1e-6


def chi2_bound(df: int, checks: int) -> float:
    """The chi-square statistic with `df` degrees of freedom that a correct sampler exceeds with
    probability FALSE_ALARM_PER_RUN / checks (`checks`: the chi-square checks in its file, per run)."""
    from scipy.stats import chi2

    return float(chi2.isf(FALSE_ALARM_PER_RUN / checks, df))


def normal_bound(checks: int, two_sided: bool = True) -> float:
    """How many standard deviations a correct count stays within, but with probability
    FALSE_ALARM_PER_RUN / checks."""
    from scipy.stats import norm

    return float(norm.isf(FALSE_ALARM_PER_RUN / checks / (2 if two_sided else 1)))


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM a server subprocess; kill it if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_greedy(engine, requests: dict, max_tokens: int) -> dict:
    """requests {rid: (prompt ids, LoRA adapter name or None)}, all added at once and run to the end ->
    {rid: (tokens, the chosen tokens' logprobs)}."""
    from qv.engine.request import SamplingParams

    for rid, (ids, name) in requests.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                    logprobs=0), lora_name=name)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if c.logprobs else None
                done[out.request_id] = (list(c.token_ids), lps)
    return done
