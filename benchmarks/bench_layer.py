"""Time a whole routed MoE layer (`fused_moe`, captured in a CUDA graph) against the sum of its phases' floors.

    python benchmarks/bench_layer.py [--targets roofline] [--models Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V3]
                                     [--m 1,8,64] [--json FILE]

Per row: align + gate/up GEMM + SiLU-and-mul + down GEMM (routing weights fused) + top-k sum, 4-bit, G = 128, fp16,
model shapes from `cupy_moe.models`. Floor: the sum of the two GEMM phases' rooflines, each the larger of its
traffic floor (the touched experts' packed weights, its activations read and its output written, over the copy
bandwidth) and its FLOP floor (2 * pairs * K * N over the fp16 matmul rate), both rates measured in the same run
(`cupy_moe.timing`). Time: one CUDA graph holds one call per routing set, the sets route to different experts so that
L2 does not hold the weights between calls, each call on the plan made for the row (`plan_moe`: no choice and no
allocation of scratch in a call); the median replay over the number of calls (`cupy_moe.timing.graph_time`).
Target (`cupy_moe.timing.layer_target`): floor / 0.70 + 3 us. --targets roofline: exit status 1 on a miss.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

from cupy_moe import configs
from cupy_moe.layer import fused_moe, plan_moe
from cupy_moe.models import get_model
from cupy_moe.weights import StackedGptqWeight
from cupy_moe.timing import copy_bandwidth, graph_time, layer_target, matmul_rate

DEFAULT_MODELS = "Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V3"


def bench(model, m, copy_bw, mm_rate, rotations=8, reps=30):
    shape = get_model(model)
    h, inter, e, a = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    w13, w2 = StackedGptqWeight.random(e, h, 2 * inter, seed=1), StackedGptqWeight.random(e, inter, h, seed=2)
    rng = np.random.default_rng(m)
    x = cp.asarray(rng.standard_normal((m, h)).astype(np.float16))
    sets = []
    for _ in range(rotations):  # each set routes to its own experts where E allows
        ids = np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32)
        weights = rng.dirichlet(np.ones(a), size=m).astype(np.float32)
        sets.append((cp.asarray(weights), cp.asarray(ids)))
    touched = float(np.mean([len(np.unique(cp.asnumpy(ids))) for _, ids in sets]))
    plan = plan_moe(m, w13, w2, a)
    t = graph_time([lambda w=w, i=i: fused_moe(x, w13, w2, w, i, plan=plan) for w, i in sets], reps=reps, warmup=3)
    p = m * a
    floor_bytes = floor = 0.0
    for w, rows in ((w13, m), (w2, p)):  # each phase: weights, activations read, outputs written; its roofline
        phase_bytes = touched * w.nbytes / e + rows * w.k * 2 + p * w.n * 2
        floor_bytes += phase_bytes
        floor += max(phase_bytes / copy_bw, 2.0 * p * w.k * w.n / mm_rate)
    return dict(model=shape.name, m=m, touched=touched, time_us=t * 1e6, floor_us=floor * 1e6,
                target_us=layer_target(floor) * 1e6, ratio=floor / t, tbps=floor_bytes / t / 1e12)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help="names from cupy_moe.models, comma-separated")
    ap.add_argument("--m", default="1,8,64", help="token counts M, comma-separated")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--targets", choices=["roofline"], default=None,
                    help="judge each row against cupy_moe.timing.layer_target; exit status 1 on a miss")
    args = ap.parse_args(argv)
    models = [get_model(name).name for name in args.models.split(",")]  # unknown names fail before any timing
    gpu = configs.gpu_info()
    copy_bw, mm_rate = copy_bandwidth(), matmul_rate()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {gpu.name}, "
          f"copy {copy_bw / 1e12:.2f} TB/s, matmul fp16 {mm_rate / 1e12:.0f} TFLOP/s")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"{'model':16s} {'M':>4s} {'experts':>7s} {'time us':>8s} {'floor us':>8s} {'target us':>9s} "
          f"{'floor/t':>7s} {'TB/s':>5s}")
    rows = []
    for model in models:
        for m in (int(v) for v in args.m.split(",")):
            r = bench(model, m, copy_bw, mm_rate)
            r["pass"] = r["time_us"] <= r["target_us"]
            rows.append(r)
            print(f"{model:16s} {m:4d} {r['touched']:7.1f} {r['time_us']:8.1f} {r['floor_us']:8.1f} "
                  f"{r['target_us']:9.1f} {r['ratio']:7.2f} {r['tbps']:5.2f}  {'' if r['pass'] else 'MISS'}",
                  flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    print(f"# {sum(r['pass'] for r in rows)}/{len(rows)} layer rows meet the layer target")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu.name, copy_bw=copy_bw, mm_rate=mm_rate, rows=rows),
                                              indent=1))
    return 1 if args.targets and not all(r["pass"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
