#!/usr/bin/env bash
# One device call for the kernel layer: the benchmark table (bench/kernels.py) and the GPU oracle
# tests (pytest -m gpu tests/oracles, or the files in $QV_GPU_TESTS), logs under $OUT. Carry .whl
# (FLA wheels, see docs/BENCHMARKS.md) to get the FLA peer rows.
#   bash bench/gpu_kernels.sh [bench seconds] [test seconds] [extra bench.py args...]
set -u
. bench/device_env.sh
bench_s=${1:-180}
test_s=${2:-100}
shift 2 2>/dev/null || shift $#
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$out/gpu.txt"
timeout "$bench_s" python3 bench/kernels.py --json "$out/bench.json" "$@" > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/gpu.txt"
timeout "$test_s" python3 -m pytest -q -m gpu ${QV_GPU_TESTS:-tests/oracles} -n 8 -p no:cacheprovider --durations=15 -rfE \
  > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"
grep -E "^\||ceilings|FAILED|failed|best|GPU |    " "$out/bench.log" | tail -90
tail -40 "$out/tests.log"
