"""Per-kernel table from an Nsight Compute run of bench/ncu_kernels.py (bench/gpu_ncu.sh calls it).

    python3 bench/ncu_summary.py LOG RAW_CSV

LOG is the combined output of the ncu run (its `CASE name` and `==PROF== Profiling "kernel"` lines
name each kernel's case); RAW_CSV is `ncu -i REPORT --page raw --csv`. For every kernel: time, DRAM
throughput (% of peak) and bytes, achieved vs theoretical occupancy, registers, issue-slot use,
cycles between a warp's instructions, and its largest stall reasons (cycles per issued instruction).
"""

from __future__ import annotations

import csv
import re
import sys


def kernel_cases(log: str) -> list[str]:
    cases, case = [], "?"
    for line in open(log, errors="replace"):
        if line.startswith("CASE "):
            case = line[5:].strip()
        elif re.search(r'==PROF== Profiling "', line):
            cases.append(case)
    return cases


SCALE = {"": 1, "%": 1, "cycle": 1, "inst": 1, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9,
         "usecond": 1e-6, "msecond": 1e-3, "second": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def num(row, key, unit=1.0):
    """row[key] in base units (bytes, seconds) divided by unit; nan where absent."""
    try:
        value, u = row[key]
        return float(value.replace(",", "")) * SCALE.get(u, float("nan")) / unit
    except (KeyError, ValueError):
        return float("nan")


def text(row, key):
    return row.get(key, ("?", ""))[0]


def main():
    log, raw = sys.argv[1], sys.argv[2]
    cases = kernel_cases(log)
    with open(raw, newline="") as f:
        rows = list(csv.DictReader(f))
    units = rows[0]  # the second line of the CSV: each metric's unit
    rows = [{k: (v, units.get(k, "")) for k, v in r.items()} for r in rows[1:]]
    print("| case | kernel | grid x block | regs | us | DRAM % | read MB | write MB | occ % (theor.) | issue % "
          "| cyc/inst | M warp-inst | top stalls (cycles per instruction) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        stalls = sorted(((num(r, k), re.sub(r"smsp__average_warps_issue_stalled_(.*)_per_issue_active.ratio", r"\1", k))
                         for k in r if k.startswith("smsp__average_warps_issue_stalled_")
                         and k.endswith("_per_issue_active.ratio")), key=lambda s: -(s[0] if s[0] == s[0] else 0))
        top = ", ".join(f"{name} {v:.1f}" for v, name in stalls[:4] if v == v)
        print(f"| {cases[i] if i < len(cases) else '?'} | {text(r, 'Kernel Name')[:40]} "
              f"| {text(r, 'launch__grid_size')} x {text(r, 'launch__block_size')} "
              f"| {text(r, 'launch__registers_per_thread')} | {num(r, 'gpu__time_duration.sum', 1e-6):.1f} "
              f"| {num(r, 'gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed'):.0f} "
              f"| {num(r, 'dram__bytes_read.sum', 1e6):.1f} | {num(r, 'dram__bytes_write.sum', 1e6):.1f} "
              f"| {num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.0f} "
              f"({num(r, 'sm__maximum_warps_per_active_cycle_pct'):.0f}) "
              f"| {num(r, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):.0f} "
              f"| {num(r, 'smsp__average_warp_latency_per_inst_issued.ratio'):.1f} "
              f"| {num(r, 'smsp__inst_executed.sum', 1e6):.2f} | {top} |")


if __name__ == "__main__":
    main()
