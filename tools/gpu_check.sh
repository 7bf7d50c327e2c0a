#!/usr/bin/env bash
# One call that checks everything GPU-side and makes the performance figures; logs under $OUT:
#   tests.log (the test suite), memcheck.log (compute-sanitizer over the GPU tests of the kernels),
#   bench.txt + bench.json + performance.png (one GEMM phase against the roofline, as in docs/performance.md),
#   layer.txt (a whole layer in a CUDA graph), routing.txt (tools/time_routing.py, against $OTHER's when given),
#   demo.txt, tune.txt + tuned/ (python -m cupy_moe tune and the table it writes), examples.txt,
#   compare.txt + compare.json (with OTHER=<another checkout>: tools/compare_versions.py);
#   when asked for: reads.txt (the memory-read probes tools/read_patterns.py and tools/read_floor.py), ncu.txt +
#   ncu_<row>.csv.gz (Nsight Compute on the first GEMM launch of each row of $NCU_ROWS, model:phase:M comma-separated:
#   the details page, and per-instruction stall samples of the SASS), ablation.txt + ablation.json
#   (tools/ablation.py: the GEMM kernels timed with parts of their main loops compiled out or changed; ABLATION_ARGS,
#   default --m 1024,4096, the prefill kernel's rows; --m 1,8 takes the decode kernel's; ABLATION_VARIANTS, the
#   variant names to time, comma-separated, spaces kept), retune.txt + retune/ (this GPU's shipped tuned table
#   refreshed: `python -m cupy_moe tune` at $RETUNE_M on every model into retune/tuned/, that table merged into a copy
#   of this checkout and raced against it by tools/compare_versions.py in $RETUNE_ROUNDS rounds into retune/race.json,
#   and the entries that won the race added to a copy of cupy_moe/configs/tuned/: retune/accepted/, what to ship).
# Usage (repository root, cupy_moe installed or PYTHONPATH=.): OUT=/some/dir bash tools/gpu_check.sh
# STAGES picks stages (default all but reads, ncu, ablation and retune); *_TIMEOUT bound each; BENCH_ARGS go to
# bench_gemm.py, TUNE_ARGS to python -m cupy_moe tune (default one model), COMPARE_ARGS to tools/compare_versions.py;
# PACK=1 packs $OUT; TESTS_ARGS to pytest (default: the suite of the README's command, GPU tests included; "-m gpu
# tests" runs only the tests that need the GPU); MEMCHECK_ARGS to the pytest run under compute-sanitizer. Where
# pytest-xdist is installed, the tests stage runs in $WORKERS processes (default 8) on the one GPU and memcheck in
# $MEMCHECK_WORKERS (default 4); 0 runs a stage in one. compute-sanitizer follows the worker processes (a kernel writing
# out of bounds, run by 2 workers under it: 64 reports, exit status 9). Run memcheck after the tests stage, which leaves
# every kernel in CuPy's disk cache (memcheck alone on a fresh machine, H200, 8 workers: 7 of its tests in 330 s; after
# the tests stage, H100: all 223 in 70-85 s with 4 workers, and not done in 150 s with 8).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${STAGES:-tests,memcheck,bench,compare,layer,routing,demo,tune,examples}
xdist() {  # xdist N: pytest options that spread a stage over N processes, where pytest-xdist is installed
  python3 -c "import xdist" 2>/dev/null && (($1 > 0)) && echo "-n $1"
}
tests_workers=$(xdist "${WORKERS:-8}") memcheck_workers=$(xdist "${MEMCHECK_WORKERS:-4}")
summary=("$(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>&1)")

stage() {  # stage NAME TIMEOUT LOG COMMAND...
  local name=$1 limit=$2 log=$3; shift 3
  [[ ,$STAGES, == *,$name,* ]] || return 0
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  summary+=("$name rc=$? ($((SECONDS - t0)) s) :: $(grep -E 'passed|failed|ERROR SUMMARY|rows meet|check:|time per layer|saved|wrote|checksums|entries added' "$log" | tail -n 3 | tr '\n' ' ')")
}

stage reads "${READS_TIMEOUT:-180}" "$OUT/reads.txt" bash -c 'python3 tools/read_patterns.py && python3 tools/read_floor.py --m 1,16'
stage ncu "${NCU_TIMEOUT:-400}" "$OUT/ncu.txt" bash -c '
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
  for row in ${0//,/ }; do
    IFS=: read -r model phase m <<< "$row"
    echo "==================== $model $phase M=$m"
    "$ncu" --clock-control none --set full --kernel-name regex:moe_gemm --launch-count 1 -f -o /tmp/ncu_row \
      python3 benchmarks/bench_gemm.py --models "$model" --phases "$phase" --m "$m" --iters 1 --no-baseline &&
    "$ncu" --import /tmp/ncu_row.ncu-rep --page details &&
    "$ncu" --import /tmp/ncu_row.ncu-rep --page source --csv --print-source sass | gzip > "$1/ncu_${model}_${phase}_$m.csv.gz"
  done' "${NCU_ROWS:-Qwen3-30B-A3B:gate_up:1,Mixtral-8x7B:gate_up:64,Mixtral-8x7B:gate_up:256,Mixtral-8x7B:gate_up:4096}" "$OUT"
stage ablation "${ABLATION_TIMEOUT:-300}" "$OUT/ablation.txt" \
  python3 tools/ablation.py --json "$OUT/ablation.json" ${ABLATION_ARGS:---m 1024,4096} \
  ${ABLATION_VARIANTS:+--variants "$ABLATION_VARIANTS"}
stage tests "${TESTS_TIMEOUT:-900}" "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider $tests_workers ${TESTS_ARGS:-tests}
stage memcheck "${MEMCHECK_TIMEOUT:-400}" "$OUT/memcheck.log" \
  compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider $memcheck_workers -m gpu ${MEMCHECK_ARGS:-tests/test_gpu_gemm.py tests/test_gpu_align.py tests/test_gpu_layer.py -k "not large and not 2_pow_24"}
stage bench "${BENCH_TIMEOUT:-550}" "$OUT/bench.txt" \
  python3 benchmarks/bench_gemm.py --targets roofline --json "$OUT/bench.json" ${BENCH_ARGS:-}
[[ -f $OUT/bench.json ]] && python3 benchmarks/plot_bench.py "$OUT/bench.json" "$OUT/performance.png" >> "$OUT/bench.txt" 2>&1
[[ -n ${OTHER:-} ]] && stage compare "${COMPARE_TIMEOUT:-400}" "$OUT/compare.txt" \
  python3 tools/compare_versions.py "$OTHER" --json "$OUT/compare.json" ${COMPARE_ARGS:-}
stage layer "${LAYER_TIMEOUT:-120}" "$OUT/layer.txt" python3 benchmarks/bench_layer.py --targets roofline
stage routing "${ROUTING_TIMEOUT:-120}" "$OUT/routing.txt" python3 tools/time_routing.py ${OTHER:-}
stage demo "${DEMO_TIMEOUT:-120}" "$OUT/demo.txt" python3 -m cupy_moe demo
# the tuner writes this GPU's table (the format of cupy_moe/configs/tuned/) to $OUT/tuned/
stage tune "${TUNE_TIMEOUT:-180}" "$OUT/tune.txt" env CUPY_MOE_CACHE_DIR="$OUT/tuned" \
  python3 -m cupy_moe tune ${TUNE_ARGS:---models Qwen3-30B-A3B --m 1,64,1024 --reps 5}
# retune: a shipped tuned table refreshed in one stage (tools/README.md, "Refreshing a shipped tuned table")
stage retune "${RETUNE_TIMEOUT:-540}" "$OUT/retune.txt" bash -c '
  set -e
  out=$(cd "$1" && pwd)/retune m=$2 rounds=$3 here=$PWD cand=$(mktemp -d) empty=$(mktemp -d)
  trap "rm -rf $cand $empty" EXIT
  rm -rf "$out" && mkdir -p "$out/tuned"
  CUPY_MOE_CACHE_DIR="$out/tuned" python3 -m cupy_moe tune --m "$m" --reps 5
  table=$(ls "$out"/tuned/*.json)
  cp -r cupy_moe kernels pyproject.toml tools "$cand"/
  python3 tools/accept_tuned.py merge "$table" "$cand/cupy_moe/configs/tuned"
  # exit status 1 where the bits differ: another configuration may add in another order
  (cd "$cand" && CUPY_MOE_CACHE_DIR="$empty" PYTHONPATH=. python3 tools/compare_versions.py "$here" --rows gemm \
    --m "$m" --rounds "$rounds" --reps 20 --json "$out/race.json") || [[ $? == 1 ]]
  cp -r cupy_moe/configs/tuned "$out/accepted"
  CUPY_MOE_CACHE_DIR="$empty" python3 tools/accept_tuned.py accept "$table" "$out/race.json" "$out/accepted"
  ' retune "$OUT" "${RETUNE_M:-128,256,512,1024}" "${RETUNE_ROUNDS:-3}"
stage examples "${EXAMPLES_TIMEOUT:-60}" "$OUT/examples.txt" \
  bash -c 'for f in examples/*.py; do echo "== $f"; python3 "$f" || echo "FAILED $f"; done'

echo "==================== summary"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" 2>/dev/null | head -n 25
[[ -f $OUT/bench.txt ]] && grep -vE '^#' "$OUT/bench.txt" | tail -n 130
[[ -f $OUT/layer.txt ]] && cat "$OUT/layer.txt"
[[ -f $OUT/demo.txt ]] && tail -n 4 "$OUT/demo.txt"
printf '%s\n' "${summary[@]}"
# PACK=1: everything in one archive (for a remote runner that brings back only a few files)
if [[ ${PACK:-0} == 1 ]]; then
  tar czf /tmp/gpu_check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check.tgz "$OUT/"
fi
