#!/usr/bin/env bash
# Same-run A/B of kernel source versions: for each DIR given, copy its .cu/.cuh files over kernels/, time the same
# benchmark rows (bench_gemm.py, no baseline; prints time in us and the traffic-floor ratio), and put the
# checked-out kernels back at the end.
#   bash benchmarks/ab_kernels.sh DIR [DIR ...]     (ROWS overrides the rows; default: six decode rows per model)
# Typical use on the device: versions exported with
# `git archive REV kernels | tar -x --strip-components=1 -C abk/REV` into an ignored folder that the device call
# carries. A version listed twice (first and last) shows the drift of the run.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ROWS=${ROWS:---models Mixtral-8x7B,DeepSeek-V3 --m 1,16,64}
backup=$(mktemp -d)
cp kernels/*.cu kernels/*.cuh "$backup"/
for dir in "$@"; do
  cp "$dir"/*.cu* kernels/
  echo "=== $dir"
  timeout 150 python3 benchmarks/bench_gemm.py --iters 8 --no-baseline $ROWS 2>&1 | grep -vE "^# command" |
    awk '/^#/ {print; next} /^model / {print $1, $2, $3, $4, $5, $6, $10; next} {print $1, $2, $3, $4, $5, $6, $9}'
done
cp "$backup"/* kernels/
