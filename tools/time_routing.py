"""Time MoELayer.route (router logits, then the choice of experts) for the routing of each model family, in this
checkout and optionally in another one, on the same inputs: CUDA-graph replays after warm-up, and how far the two
versions' choices agree (expert ids equal, largest weight difference).

    python tools/time_routing.py [OTHER_CHECKOUT] [--m 1,8,64,1024] [--reps 20]

Rows: DeepSeek-V3 (sigmoid scores, score-correction bias, 8 groups of which 4 stay, top-8 of 256, renormalized,
x 2.5), DeepSeek-V2 (softmax, 8 groups of which 3 stay, top-6 of 160, x 16), Qwen3-30B-A3B (softmax top-8 of 128,
renormalized), each with a random router of its hidden size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import cupy_moe
from cupy_moe.timing import graph_time
from compare_versions import import_other  # a sibling script: its folder is on sys.path when run as a script

ROUTING = {  # name: (H, E, A, MoELayerWeights routing fields)
    "DeepSeek-V3": (7168, 256, 8, dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                                       renormalize=True, routed_scaling_factor=2.5, bias=True)),
    "DeepSeek-V2": (5120, 160, 6, dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=8,
                                       topk_group=3, renormalize=False, routed_scaling_factor=16.0, bias=False)),
    "Qwen3-30B-A3B": (2048, 128, 8, dict(scoring_func="softmax", topk_method=None, n_group=None, topk_group=None,
                                         renormalize=True, routed_scaling_factor=1.0, bias=False)),
}


def layer_of(pkg, cp, name, rng):
    h, e, a, fields = ROUTING[name]
    fields = dict(fields)
    bias = cp.asarray((rng.standard_normal(e) * 0.1).astype(np.float32)) if fields.pop("bias") else None
    weights = pkg.checkpoint.MoELayerWeights(
        family="deepseek_v3", layer=0, hidden_size=h, intermediate_size=64, num_experts=e, w13=None, w2=None,
        router_weight=cp.asarray((rng.standard_normal((e, h)) * h ** -0.5).astype(np.float32)), top_k=a,
        e_score_correction_bias=bias, **fields)
    return pkg.MoELayer(weights)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, nargs="?", help="root of another checkout to compare with")
    ap.add_argument("--m", default="1,8,64,1024")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import cupy as cp
    versions = {"this": cupy_moe}
    if args.other:
        versions["other"] = import_other(args.other.resolve())
    print(f"{'routing':14s} {'M':>5s} " + " ".join(f"{v + ' us':>9s}" for v in versions) + "  agreement")
    for name in ROUTING:
        layers = {v: layer_of(pkg, cp, name, np.random.default_rng(1)) for v, pkg in versions.items()}
        for m in (int(v) for v in args.m.split(",")):
            xs = [cp.asarray(np.random.default_rng(s).standard_normal((m, ROUTING[name][0])).astype(np.float16))
                  for s in range(4)]
            times, results = {}, {}
            for v, layer in layers.items():
                results[v] = [cp.asnumpy(t) for t in layer.route(xs[0])]
                times[v] = graph_time([lambda x=x, layer=layer: layer.route(x) for x in xs], reps=args.reps) * 1e6
            agree = ""
            if "other" in results:
                (w0, i0), (w1, i1) = results["this"], results["other"]
                agree = (f"ids {np.mean((i0 == i1).all(axis=1)):.3f} of tokens, "
                         f"max weight difference {np.abs(w0 - w1).max():.1e}")
            print(f"{name:14s} {m:5d} " + " ".join(f"{t:9.1f}" for t in times.values()) + f"  {agree}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
