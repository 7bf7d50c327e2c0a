"""Time a whole routed MoE layer (`fused_moe`, captured in a CUDA graph) against the sum of its phases' floors.

    python benchmarks/bench_layer.py [--models Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V3] [--m 1,8,64] [--json FILE]

Per row: align + gate/up GEMM + SiLU-and-mul + down GEMM (routing weights fused) + top-k sum, 4-bit, G = 128, fp16,
model shapes from `cupy_moe.models`. Floor: the touched experts' packed w13 + w2 bytes, plus x read and the output
written, over the device copy bandwidth measured in the same run (`cupy_moe.timing.copy_bandwidth`). Time: one
CUDA graph holds one call per routing set, the sets route to different experts so that L2 does not hold the
weights between calls; the median replay over the number of calls (`cupy_moe.timing.graph_time`). Decode target at
M = 1: time <= 1.3 x floor + 10 us (a single token cannot hide launch and DRAM latency behind its few bytes).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np
from bench_gemm import random_weight

from cupy_moe.layer import fused_moe
from cupy_moe.models import get_model
from cupy_moe.timing import copy_bandwidth, graph_time

DEFAULT_MODELS = "Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V3"


def bench(model, m, copy_bw, rotations=8, reps=30):
    shape = get_model(model)
    h, inter, e, a = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    w13, w2 = random_weight(e, h, 2 * inter, 1), random_weight(e, inter, h, 2)
    rng = np.random.default_rng(m)
    x = cp.asarray(rng.standard_normal((m, h)).astype(np.float16))
    sets = []
    for _ in range(rotations):  # each set routes to its own experts where E allows
        ids = np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32)
        weights = rng.dirichlet(np.ones(a), size=m).astype(np.float32)
        sets.append((cp.asarray(weights), cp.asarray(ids)))
    touched = float(np.mean([len(np.unique(cp.asnumpy(ids))) for _, ids in sets]))
    t = graph_time([lambda w=w, i=i: fused_moe(x, w13, w2, w, i) for w, i in sets], reps=reps, warmup=3)
    floor_bytes = touched * (w13.nbytes + w2.nbytes) / e + 2 * x.nbytes
    floor = floor_bytes / copy_bw
    return dict(model=shape.name, m=m, touched=touched, time_us=t * 1e6, floor_us=floor * 1e6,
                target_us=(1.3 * floor + 10e-6) * 1e6, ratio=floor / t, tbps=floor_bytes / t / 1e12)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help="names from cupy_moe.models, comma-separated")
    ap.add_argument("--m", default="1,8,64", help="token counts M, comma-separated")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    models = [get_model(name).name for name in args.models.split(",")]  # unknown names fail before any timing
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    copy_bw = copy_bandwidth()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {gpu}, "
          f"copy {copy_bw / 1e12:.2f} TB/s; command: python {' '.join(sys.argv)}")
    print(f"{'model':16s} {'M':>4s} {'experts':>7s} {'time us':>8s} {'floor us':>8s} {'target us':>9s} "
          f"{'floor/t':>7s} {'TB/s':>5s}  M=1 target")
    rows = []
    for model in models:
        for m in (int(v) for v in args.m.split(",")):
            r = bench(model, m, copy_bw)
            rows.append(r)
            verdict = ("pass" if r["time_us"] <= r["target_us"] else "MISS") if m == 1 else ""
            print(f"{model:16s} {m:4d} {r['touched']:7.1f} {r['time_us']:8.1f} {r['floor_us']:8.1f} "
                  f"{r['target_us']:9.1f} {r['ratio']:7.2f} {r['tbps']:5.2f}  {verdict}", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, copy_bw=copy_bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
