#!/usr/bin/env bash
# One device call for the engine-level GPU checks and benchmarks; logs under $OUT.
#   bash bench/gpu_all.sh SECTION...    sections: tests oracles sm70 specgpu newgpu (side by side: sm70 oracles,
#   speculation and prompt-logprob GPU tests, graphs, the sm70 engine) engine spec spec27 ngram27 prefix
#   prefix27 clef clef27 clefmix mix27 soak27 soak27wait pieces27 kernels bench27 fp8_27 w12_27 top1 plp mask hostile27
#   cutlass nocompile rssprobe
# BENCH_KERNELS_ARGS passes options to bench/kernels.py (e.g. "--only attn,gdn --sweep attn,gdn");
# BENCH27_ARGS to `qv bench --preset 27b` (e.g. "--prefill-lengths 32768 --profile").
# The pytest sections run with OMP_NUM_THREADS=${PYTEST_THREADS:-4}: host-side fits (the MTP head's) crawl when
# every xdist worker takes all 16 cores.
set -u
. bench/device_env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  date -u; } > "$out/env.txt" 2>&1
run() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> "$out/env.txt"
}
for section in "$@"; do
  case $section in
    tests) run tests 100 env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/engine tests/clef -n 3 -p no:cacheprovider -rfE --durations=10 ;;
    oracles) run oracles 150 env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/oracles -n 8 -p no:cacheprovider -rfE --durations=5 ;;
    sm70) run sm70 ${SM70_S:-200} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/oracles/test_linear_sm70.py \
        tests/oracles/test_paged_attention_sm70.py tests/oracles/test_gated_delta_rule_sm70.py \
        tests/oracles/test_varlen_attention.py tests/oracles/test_sm70_chain.py tests/engine/test_sm70_engine_gpu.py \
        -n 4 -p no:cacheprovider -rfE ;;
    specgpu) run specgpu ${SPECGPU_S:-200} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/engine/test_engine_gpu.py \
        tests/spec/test_spec_distribution.py -p no:cacheprovider -rfE --durations=5 ;;
    spec27) run spec27 ${SPEC27_S:-240} python3 -m qv.cli bench --preset 27b --spec mtp --batch-sizes 1 \
        --contexts 131072 --prefill-lengths 32768,131072 --json "$out/spec27.json" ;;
    ngram27) run ngram27 ${NGRAM27_S:-150} python3 -m qv.cli bench --preset 27b --spec ngram --batch-sizes 1 \
        --contexts 32768 --prefill-lengths 32768 --json "$out/ngram27.json" ;;
    newgpu)  # the m8n8k4 oracles, the speculation and prompt-logprob GPU tests, the graph check: side by side
        run sm70 150 env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/oracles/test_linear_sm70.py tests/oracles/test_paged_attention_sm70.py \
          tests/oracles/test_gated_delta_rule_sm70.py tests/oracles/test_varlen_attention.py \
          tests/oracles/test_lm_head_top1.py -n 6 -p no:cacheprovider -rfE --durations=5 &
        run specgpu ${SPECGPU_S:-240} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/engine/test_engine_gpu.py tests/spec/test_spec_distribution.py \
          tests/oracles/test_sm70_chain.py tests/engine/test_prompt_logprobs.py -n 3 -p no:cacheprovider -rfE --durations=5 &
        run graphs 150 env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/engine/test_cuda_graphs_gpu.py -p no:cacheprovider -rfE &
        run sm70engine ${SM70ENGINE_S:-200} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/engine/test_sm70_engine_gpu.py -n 2 \
          -p no:cacheprovider -rfE --durations=5 &
        wait ;;
    hostile27)  # issue 40's attack suite against the 27B shapes (random weights, a random Clef head); HOSTILE27_K=hostile_load
                # runs only the combined load test
        python3 -c "from qv.bench.presets import write_preset; from qv.bench.clef_folder import add_clef; \
add_clef(write_preset('27b', '/tmp/qv-hostile27'), '27b')"
        run hostile27 ${HOSTILE27_S:-420} env QV_HOSTILE_MODEL=/tmp/qv-hostile27 python3 -m pytest -q tests/server/test_hostile.py \
          ${HOSTILE27_K:+-k $HOSTILE27_K} -s -p no:cacheprovider -rfE --durations=5 ;;
    mix27)  # issue 33 at the full 64 layers: the grouped delta beside its GEMM; records beside chats under each step
            # target (MIX27_TARGETS, bench/clef.py's --step-targets) in one model load, a mixed step profiled under the first;
            # MIX27_LEVERS="--lever piecewise_graph_max_rows=512" runs it with the piecewise graphs (any bench/clef.py
            # options, last, so "--lengths 1024 --counts 16" overrides the three lengths)
        run grouped ${GROUPED_S:-90} python3 bench/grouped_delta.py
        run mix27 ${MIX27_S:-420} python3 bench/clef.py --presets 27b --load-format random --layers-27b 0 \
          --counts 16,6,3 --step-targets ${MIX27_TARGETS:-2x,2.5x,30ms} --profile-mixed ${MIX27_LEVERS:-} ;;
    pieces27)  # the piecewise graphs' start-up check as the engine's start-up runs it (64 layers, Clef, bench/clef.py's
               # levers: a server's memory plan, no warm-up) with a bf16 and an int8 cache, and each size's eager forward
               # 16 more times (a race shows as a rate: the TMA GEMM tiles' gave 6 of 48 at 160-256 rows); PIECES27_KV="int8"
               # runs one cache dtype
        for kv in ${PIECES27_KV:-auto int8}; do
          run pieces27-$kv ${PIECES27_S:-200} python3 bench/piecewise_check.py --layers 64 --clef --capture together \
            --sizes all --no-warm-up --lever max_num_batched_tokens=8192 --lever max_model_len=1088 --lever kv_cache_bytes=0 \
            --lever kv_dtype=$kv --repeat 16; done ;;
    soak27)  # issue 33's load run: 64 clients (chats, half streamed, records; 10% of chat requests hang up) for SOAK27_S s.
             # It outlasts one device call (10 min with the start), so it runs detached; `soak27wait` in the next call
             # (the machine stays warm for 30 s) waits for its end and copies soak27.log / soak27.json under $out.
        mkdir -p /tmp/soak27
        setsid nohup bash -c "timeout $(( ${SOAK27_S:-480} + 400 )) python3 -m qv.cli bench serve --preset 27b --chats 54 \
          --records 10 --stream-fraction 0.5 --hangup-fraction 0.2 --record-lengths 1024,8192 --duration ${SOAK27_S:-480} \
          --settle 60 --probes 4 --json /tmp/soak27/soak27.json > /tmp/soak27/soak27.log 2>&1; echo rc=\$? > /tmp/soak27/rc" \
          > /dev/null 2>&1 < /dev/null & ;&  # on into soak27wait: wait while the call lasts, copy what there is
    soak27wait)
        while [ -d /tmp/soak27 ] && [ ! -f /tmp/soak27/rc ] && [ $SECONDS -lt ${CALL_S:-580} ]; do sleep 5; done
        cp /tmp/soak27/* "$out/" 2>/dev/null ;;
    nocompile)  # serving compiles no Triton kernel after the warm-up; the grouped deltas' GPU oracles (aligned B loads)
        run nocompile ${NOCOMPILE_S:-150} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu \
          tests/engine/test_compiles_after_warm_up_gpu.py tests/oracles/test_grouped_delta.py -p no:cacheprovider -rfE ;;
    rssprobe) run rssprobe ${RSSPROBE_S:-120} python3 bench/rss_probe.py ;;  # which suspect grows a server's anonymous RSS
    cutlass) run cutlass ${CUTLASS_S:-400} python3 bench/cutlass_probe.py --build-dir /tmp/qv-cutlass ;;  # needs the nvidia-cutlass wheel
    top1) run top1 60 python3 bench/lm_head_top1.py ;;
    mask) run mask 90 python3 bench/structured_mask.py --json "$out/mask.json" ;;
    plp) run plp 90 python3 bench/prompt_logprobs.py ;;
    engine) run engine 170 python3 bench/engine.py --json "$out/engine.json" ;;
    spec) run spec 110 python3 bench/spec.py --fitted .bench_models/tiny-spec --json "$out/spec.json" ;;
    prefix) run prefix 165 python3 bench/prefix.py --dir /tmp/qv-prefix-models --presets 0.5b --profile ;;
    prefix27) run prefix27 200 python3 bench/prefix.py --dir /tmp/qv-prefix-models --presets 27b ;;
    clef) run clef 420 python3 bench/clef.py --dir /tmp/qv-clef-models ;;
    clef27) run clef27 150 python3 bench/clef.py --dir /tmp/qv-clef-models --presets 27b ;;
    clefmix) for t in ${CLEFMIX_THRESHOLDS:-0}; do  # issue 24's case: four 32K records beside six chats
        run clefmix-$t 200 python3 bench/clef.py --dir /tmp/qv-clef-models --presets 27b --load-format random \
          --lengths 32768 --counts 4 --long-prefill-token-threshold $t; done ;;
    bench27) run bench27 ${BENCH27_S:-560} python3 -m qv.cli bench --preset 27b --json "$out/bench27.json" ${BENCH27_ARGS:-} ;;
    fp8_27)  # issue 36: block-FP8 prefill at 32K / 128K beside GPTQ-Int8 in the same call (target: <= 0.65x at 32K)
        run fp8oracles ${FP8_TESTS_S:-300} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu tests/oracles/test_linear_fp8.py tests/engine/test_fp8_engine_gpu.py \
          -p no:cacheprovider -rfE
        for q in gptq-int8 fp8; do
          run bench27-$q ${FP8_27_S:-280} python3 -m qv.cli bench --preset 27b --quantization $q --batch-sizes 1,16 \
            --contexts "" --prefill-lengths 32768,131072 --linears --json "$out/bench27-$q.json"; done ;;
    w12_27)  # issue 36: decode with W12 q/k/v against bf16 q/k/v (GPTQ-Int8 elsewhere, as the original ships it)
        run w12tests ${W12_TESTS_S:-300} env OMP_NUM_THREADS=${PYTEST_THREADS:-4} python3 -m pytest -q -m gpu \
          tests/oracles/test_linear_w12.py tests/engine/test_w12_engine_gpu.py -p no:cacheprovider -rfE
        python3 -c 'import json, sys; from qv.bench.presets import write_preset; d = write_preset("27b", sys.argv[1]); c = json.loads((d / "config.json").read_text()); c["quantization_config"]["dynamic"] = {r"-:.*self_attn\.[qkv]_proj$": {}}; (d / "config.json").write_text(json.dumps(c))' /tmp/qv-w12-27b
        for w in 0 1; do
          run bench27-w12-$w ${W12_27_S:-240} python3 -m qv.cli bench /tmp/qv-w12-27b --load-format random --kv-dtype int8 \
            --w12 $w --batch-sizes 1,16 --contexts 32768 --prefill-lengths 32768 --state-dir /tmp/qv-w12-state \
            --json "$out/bench27-w12-$w.json"; done ;;
    kernels) run kernels ${KERNELS_S:-240} python3 bench/kernels.py --json "$out/kernels.json" ${BENCH_KERNELS_ARGS:-} ;;
  esac
done
cat "$out/env.txt"
for f in "$out"/*.log; do echo "=== $f"; grep -E "^\||FAILED|Error|passed|failed|^    |ms\)" "$f" | tail -40; done
