#!/usr/bin/env bash
# One device call that checks everything GPU-side; logs under $OUT (at most 8 files come back):
#   tests.log (the whole suite), memcheck.log, bench.txt + performance.png (one GEMM phase),
#   layer.txt (whole layer in a CUDA graph), demo.txt, tune.txt (python -m cupy_moe tune on one model), examples.txt;
#   when asked for: reads.txt (benchmarks/read_patterns.py) and ncu.txt + ncu_source.csv.gz + ncu_raw.txt.gz
#   (Nsight Compute on the rows of benchmarks/profile_rows.py, $NCU_ROWS: details, per-instruction stall samples and
#   every raw metric, e.g. the pipe utilizations).
# Usage (repository root): OUT=/some/dir bash benchmarks/gpu_check.sh
# STAGES picks stages (default all but reads and ncu); *_TIMEOUT bound each; BENCH_ARGS go to bench_gemm.py;
# TESTS_ARGS to pytest (default: the whole suite, whose NVRTC compile test alone takes about 3 minutes on a CPU
# machine; "-m gpu tests" runs only the tests that need the GPU, about 90 s on an H200).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${STAGES:-tests,memcheck,bench,layer,demo,tune,examples}
summary=("$(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>&1)")

stage() {  # stage NAME TIMEOUT LOG COMMAND...
  local name=$1 limit=$2 log=$3; shift 3
  [[ $STAGES == *$name* ]] || return 0
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  summary+=("$name rc=$? ($((SECONDS - t0)) s) :: $(grep -E 'passed|failed|ERROR SUMMARY|rows meet|check:|time per layer|winner|saved|bench_args|wrote|CHECKSUM' "$log" | tail -n 3 | tr '\n' ' ')")
}

stage reads "${READS_TIMEOUT:-90}" "$OUT/reads.txt" python3 benchmarks/read_patterns.py
stage ncu "${NCU_TIMEOUT:-300}" "$OUT/ncu.txt" bash -c 'ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
  "$ncu" --clock-control none --profile-from-start off --set full -f -o /tmp/prof python3 benchmarks/profile_rows.py ${NCU_ROWS:-} &&
  "$ncu" --import /tmp/prof.ncu-rep --page details &&
  "$ncu" --import /tmp/prof.ncu-rep --page source --csv --print-source sass | gzip > "$0/ncu_source.csv.gz" &&
  "$ncu" --import /tmp/prof.ncu-rep --page raw | gzip > "$0/ncu_raw.txt.gz"' "$OUT"
stage tests "${TESTS_TIMEOUT:-400}" "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider ${TESTS_ARGS:-tests}
stage bench "${BENCH_TIMEOUT:-260}" "$OUT/bench.txt" python3 benchmarks/bench_gemm.py --iters 8 --json /tmp/bench.json ${BENCH_ARGS:-}
[[ -f /tmp/bench.json ]] && python3 benchmarks/plot_bench.py /tmp/bench.json "$OUT/performance.png" >> "$OUT/bench.txt" 2>&1
stage demo "${DEMO_TIMEOUT:-80}" "$OUT/demo.txt" python3 -m cupy_moe demo
stage layer "${LAYER_TIMEOUT:-50}" "$OUT/layer.txt" python3 benchmarks/bench_layer.py
stage memcheck "${MEMCHECK_TIMEOUT:-70}" "$OUT/memcheck.log" \
  compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 benchmarks/memcheck_batch.py
stage tune "${TUNE_TIMEOUT:-120}" "$OUT/tune.txt" bash -c \
  'CUPY_MOE_CACHE_DIR=/tmp/tune python3 -m cupy_moe tune --models Qwen3-30B-A3B --m 1,64,1024 --reps 5 && cat /tmp/tune/*.json'
stage examples "${EXAMPLES_TIMEOUT:-30}" "$OUT/examples.txt" \
  bash -c 'for f in examples/*.py; do echo "== $f"; python3 "$f" || echo "FAILED $f"; done'

echo "==================== summary"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" 2>/dev/null | head -n 25
[[ -f $OUT/bench.txt ]] && grep -vE '^#' "$OUT/bench.txt" | awk '{printf "%-18s %-7s %5s %9s %6s %6s %7s %s\n", $1, $2, $3, $6, $9, $10, $12, $13}' | tail -n 100
[[ -f $OUT/layer.txt ]] && cat "$OUT/layer.txt"
[[ -f $OUT/demo.txt ]] && tail -n 4 "$OUT/demo.txt"
printf '%s\n' "${summary[@]}"
