#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer memcheck on a small fuzz batch, the benchmark; logs under $OUT.
# Usage (repository root): OUT=/some/dir bash benchmarks/gpu_check.sh [bench args...]
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${STAGES:-tests,memcheck,bench}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader > "$OUT/gpu.txt" 2>&1
summary=()

if [[ $STAGES == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_align.py tests/test_gpu_gemm.py \
    ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1
  summary+=("tests rc=$? :: $(tail -n 1 "$OUT/tests.log")")
fi

if [[ $STAGES == *memcheck* ]]; then
  cat > /tmp/fuzz_batch.py <<'PY'
import sys, numpy as np
sys.path.insert(0, "tests")
import test_gpu_gemm as t
rng = np.random.default_rng(7)
for i in range(6):
    case = dict(e=int(rng.choice([1, 8, 60])), m=int(rng.choice([0, 1, 17, 70])), a=1, k=int(rng.choice([64, 256])),
                n=int(rng.choice([32, 96])), bits=int(rng.choice([4, 8])), group_size=int(rng.choice([32, 64, -1])),
                sym=bool(i % 2), act_order=bool(i % 3 == 0), dtype_name="float16", routed=bool(i % 2),
                kind="uniform", block_m=[16, 64][i % 2])
    case["a"] = int(min(case["e"], 1 + i % 3))
    t.run_case(rng, **case)
import cupy as cp
from cupy_moe.align import moe_align_block_size
moe_align_block_size(cp.asarray(rng.integers(0, 64, size=(5000, 4)).astype(np.int32)), 16, 64)  # multi-CTA path
cp.cuda.Device().synchronize()
print("fuzz batch ok")
PY
  timeout ${MEMCHECK_TIMEOUT:-200} compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
    python3 /tmp/fuzz_batch.py > "$OUT/memcheck.log" 2>&1
  summary+=("memcheck rc=$? :: $(grep -E 'ERROR SUMMARY|fuzz batch ok' "$OUT/memcheck.log" | tr '\n' ' ')")
fi

if [[ $STAGES == *sweep* ]]; then
  timeout ${SWEEP_TIMEOUT:-150} python3 benchmarks/sweep_tiles.py > "$OUT/sweep.txt" 2>&1
  summary+=("sweep rc=$?")
  W=$(grep '^winners' "$OUT/sweep.txt" | tail -n 1)
  if [[ -n $W ]]; then
    D=${W#*decode=}; D=${D%% *}; P=${W#*prefill=}
    BENCH_ARGS="${BENCH_ARGS:-} --decode-tile $D --prefill-tile $P"
  fi
fi

if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_gemm.py --json "$OUT/bench.json" ${BENCH_ARGS:-} \
    > "$OUT/bench.txt" 2>&1
  summary+=("bench rc=$?")
fi

echo "==================== summary"
cat "$OUT/gpu.txt"
grep -E "passed|failed|Error|error" "$OUT/tests.log" 2>/dev/null | tail -n 15
[[ -f "$OUT/sweep.txt" ]] && grep -v "^#" "$OUT/sweep.txt" | tail -n 40
[[ -f "$OUT/bench.txt" ]] && cat "$OUT/bench.txt" | tail -n 110
printf '%s\n' "${summary[@]}"
