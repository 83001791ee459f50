#!/usr/bin/env bash
# One device call: Nsight Compute over the kernel benchmark cases (bench/ncu_kernels.py), then a
# per-kernel table (bench/ncu_summary.py). Logs, the raw CSV and the report land under $OUT.
#   bash bench/gpu_ncu.sh [groups: decode,gemv,gdn,step,attn] [ncu set: full|detailed|basic]
# NCU_SOURCE="kernel_regex ..." also prints, per kernel, the instructions with the most stall samples.
set -u
. bench/device_env.sh
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
"$ncu" --version | tail -1
# clocks left as the machine sets them (device README); one profiled call per case
"$ncu" --profile-from-start off --clock-control none --set "${2:-full}" --import-source no -f -o "$out/prof" \
  python3 bench/ncu_kernels.py --only "${1:-decode,gemv,gdn,step,attn}" > "$out/ncu.log" 2>&1
echo "ncu rc=$?"
"$ncu" -i "$out/prof.ncu-rep" --page raw --csv > "$out/raw.csv" 2> "$out/raw.err"
"$ncu" -i "$out/prof.ncu-rep" --page details --csv > "$out/details.csv" 2>> "$out/raw.err"
python3 bench/ncu_summary.py "$out/ncu.log" "$out/raw.csv" | tee "$out/summary.md"
grep -v "==PROF==" "$out/ncu.log" | tail -15
# per-instruction view (executed instructions, stall samples) of the kernels named in $NCU_SOURCE
if [ -n "${NCU_SOURCE:-}" ]; then
  for k in $NCU_SOURCE; do
    "$ncu" -i "$out/prof.ncu-rep" --page source --csv --print-source sass -k "regex:$k" > "$out/source_$k.csv" 2>> "$out/raw.err"
    python3 bench/ncu_summary.py --source "$out/source_$k.csv" 20
  done
fi
