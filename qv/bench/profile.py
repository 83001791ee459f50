"""Kernel times from torch.profiler: what the device part of a step (or of any profiled call) is.
Used by `qv bench --profile` and by the side-by-side benchmarks in bench/."""

from __future__ import annotations

import time

import torch

TOP_KERNELS = 20  # rows of the printed per-kernel table (the JSON keeps them all)


def kernel_times(prof, calls: int, cuda: bool = True) -> list[tuple[str, float, float]]:
    """(kernel name, ms per call, launches per call) of every CUDA kernel the profiled `calls`
    calls launched, largest first; cuda=False: CPU ops by their own (self) time instead."""
    times: dict[str, list] = {}
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA or evt.device_time_total <= 0:
                continue
            total_us = evt.device_time_total
        else:
            if evt.device_type != torch.autograd.DeviceType.CPU or evt.self_cpu_time_total <= 0:
                continue
            total_us = evt.self_cpu_time_total
        t = times.setdefault(evt.key, [0.0, 0.0])
        t[0] += total_us / calls / 1e3
        t[1] += evt.count / calls
    return sorted(((name, ms, n) for name, (ms, n) in times.items()), key=lambda r: -r[1])


def kernel_table(prof, steps: int, top: int = 15) -> str:
    """GPU time and launches per step of the largest kernels, as an indented text block."""
    times = kernel_times(prof, steps)
    lines = [f"    {name[:70]:<70} {ms * 1e3:8.1f} us {n:6.1f} launches" for name, ms, n in times[:top]]
    total, launches = sum(ms for _, ms, _ in times), sum(n for _, _, n in times)
    return "\n".join(lines + [f"    total {total * 1e3:.1f} us of GPU time, {launches:.0f} kernels per step"])


def profile_steps(step, steps: int, device: torch.device) -> dict:
    """Run `step()` `steps` times under the profiler: per step, its wall time, the time the device
    was busy (kernel time summed) and every kernel's time, launches and share of the wall time."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - t0) / steps * 1e6
    times = kernel_times(prof, steps, cuda)
    busy_us = sum(ms for _, ms, _ in times) * 1e3
    kernels = [{"name": name, "us_per_step": ms * 1e3, "launches_per_step": n, "share": ms * 1e3 / wall_us}
               for name, ms, n in times]
    return {"steps": steps, "wall_us_per_step": wall_us, "busy_us_per_step": busy_us,
            "busy_share": busy_us / wall_us, "kernels": kernels, "device": "cuda" if cuda else "cpu"}


def profile_markdown(label: str, p: dict, top: int = TOP_KERNELS) -> str:
    """One profiled step as a markdown table, the busy-vs-wall line first."""
    what = "GPU busy" if p["device"] == "cuda" else "CPU op time (no GPU)"
    lines = [f"**{label}**: {what} {p['busy_us_per_step']:.1f} us of {p['wall_us_per_step']:.1f} us wall per step "
             f"({100 * p['busy_share']:.0f}%), {sum(k['launches_per_step'] for k in p['kernels']):.0f} launches",
             "", "| kernel | us/step | launches/step | share of step |", "| --- | ---: | ---: | ---: |"]
    for k in p["kernels"][:top]:
        name = k["name"].replace("|", "\\|")[:90]
        lines.append(f"| `{name}` | {k['us_per_step']:.1f} | {k['launches_per_step']:.1f} | {100 * k['share']:.1f}% |")
    if len(p["kernels"]) > top:
        rest = p["kernels"][top:]
        lines.append(f"| ({len(rest)} more) | {sum(k['us_per_step'] for k in rest):.1f} | "
                     f"{sum(k['launches_per_step'] for k in rest):.1f} | {100 * sum(k['share'] for k in rest):.1f}% |")
    return "\n".join(lines)
