"""Per-kernel table from an Nsight Compute run of bench/ncu_kernels.py (bench/gpu_ncu.sh calls it).

    python3 bench/ncu_summary.py LOG RAW_CSV
    python3 bench/ncu_summary.py --source SOURCE_CSV [N]

LOG is the combined output of the ncu run (its `CASE name` and `==PROF== Profiling "kernel"` lines
name each kernel's case); RAW_CSV is `ncu -i REPORT --page raw --csv`. For every kernel: time, DRAM
throughput (% of peak) and bytes, achieved vs theoretical occupancy, registers, issue-slot use,
cycles between a warp's instructions, and its largest stall reasons (cycles per issued instruction).
--source: one kernel's SASS (`ncu -i REPORT --page source --csv --print-source sass -k NAME`): the
stall reasons over the whole kernel and the N instructions with the most stall samples.
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


def source_top(path: str, n: int = 25):
    rows = list(csv.reader(open(path, newline="")))
    hdr = next(r for r in rows if "Address" in r)
    data = [r for r in rows[rows.index(hdr) + 1:] if len(r) == len(hdr)]
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [(i, h[6:]) for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]

    def val(r, i):
        try:
            return int(r[i].replace(",", ""))
        except ValueError:
            return 0
    i_s, i_e = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    total = sum(val(r, i_s) for r in data) or 1
    by = sorted(((sum(val(r, i) for r in data), name) for i, name in reasons), reverse=True)
    print(f"{path}: {total} stall samples, {sum(val(r, i_e) for r in data)} warp instructions executed")
    print("  by reason: " + ", ".join(f"{name} {100 * v / total:.0f}%" for v, name in by[:8]))
    for k in sorted(sorted(range(len(data)), key=lambda k: -val(data[k], i_s))[:n]):
        r = data[k]
        top = sorted(((val(r, i), name) for i, name in reasons), reverse=True)[:2]
        print(f"  {k:5d} {100 * val(r, i_s) / total:5.1f}%  {r[col['Source']].strip()[:64]:64s} "
              f"{top[0][1]}, {top[1][1]}")


def main():
    if sys.argv[1] == "--source":
        source_top(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 25)
        return
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
