"""GPU kernel times from a torch.profiler run, for the benchmarks' breakdowns (the logic lives in
qv/bench/profile.py, shared with `qv bench --profile`)."""

from __future__ import annotations

from qv.bench.profile import kernel_table, kernel_times

__all__ = ["kernel_table", "kernel_times"]
