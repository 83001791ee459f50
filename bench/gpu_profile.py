"""GPU kernel times from a torch.profiler run, for the benchmarks' breakdowns."""

from __future__ import annotations

import torch


def kernel_times(prof, calls: int) -> list[tuple[str, float, float]]:
    """(kernel name, GPU ms per call, launches per call) of every CUDA kernel the profiled `calls`
    calls launched, largest first."""
    times: dict[str, list] = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0:
            t = times.setdefault(evt.key, [0.0, 0.0])
            t[0] += evt.device_time_total / calls / 1e3
            t[1] += evt.count / calls
    return sorted(((name, ms, n) for name, (ms, n) in times.items()), key=lambda r: -r[1])
