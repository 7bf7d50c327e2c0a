"""Time every split-K factor of one block size on the decode rows (the data behind configs.choose_config's split).

    python benchmarks/sweep_splits.py [--block-m 16] [--m 1,4,16,64] [--models A,B]

Per (model, phase, M) whose heuristic block size is --block-m: each split S = 1..8 that leaves a slice at least two
stages, timed as tune does (a CUDA graph of 4 calls over different routings, median of 10 replays; random 4-bit
weights, G = 128). One line per row: the time of every S, the heuristic's pick and the fastest; the last line, the
geometric mean and the worst of pick / fastest.
"""
import argparse
import math
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp  # noqa: E402
from cupy_moe import configs, tune  # noqa: E402
from cupy_moe.align import moe_align_block_size  # noqa: E402
from cupy_moe.gemm import fused_moe_gemm  # noqa: E402

SPLITS = (1, 2, 3, 4, 5, 6, 8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-m", type=int, default=16, choices=configs.SUPPORTED_BLOCK_M)
    ap.add_argument("--m", default="1,4,16,64")
    ap.add_argument("--models", default=",".join(configs.MODEL_SHAPES))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    table = configs.tuned_table()
    losses = []
    for model in args.models.split(","):
        h, inter, e, a = configs.MODEL_SHAPES[model]
        for phase, k, n in (("gate_up", h, 2 * inter), ("down", inter, h)):
            weight = tune._random_weight(cp, e, k, n, 4, 128, seed=1)
            for m in (int(v) for v in args.m.split(",")):
                rows, top_k = (m, a) if phase == "gate_up" else (m * a, 1)
                key = configs.tuning_key(e, k, n, 4, 128, m * a)
                table.pop(key, None)
                with warnings.catch_warnings():  # the "no tuned config" note
                    warnings.simplefilter("ignore")
                    pick = configs.choose_config(rows, e, top_k, k, n, 4, 128)
                if pick.block_m != args.block_m:
                    continue
                ids = [cp.asarray(np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32))
                       for _ in range(tune.ROTATIONS)]
                x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float16))
                out = cp.empty((m * a, n), cp.float16)
                aligned = [moe_align_block_size(t, args.block_m, e) for t in ids]
                calls = [lambda al=al: fused_moe_gemm(x, weight, *al, top_k, out=out) for al in aligned]
                max_split = configs.max_split_k(k, pick.ku)
                times = {}
                for s in (s for s in SPLITS if s <= max_split):
                    table[key] = {"block_m": args.block_m, "split_k": s}  # choose_config returns it now
                    times[s] = tune._graph_time(cp, stream, calls, 10) * 1e6
                del table[key]
                best = min(times, key=times.get)
                losses.append(times[pick.split_k] / times[best])
                print(f"{model:18s} {phase:7s} {m:5d}  " + " ".join(f"{s}:{t:.1f}" for s, t in times.items())
                      + f"  | pick {pick.split_k} best {best} ({losses[-1]:.3f})", flush=True)
            weight = None  # free before the next phase
            cp.get_default_memory_pool().free_all_blocks()
    if losses:
        print(f"# pick / best: geometric mean {math.exp(np.mean(np.log(losses))):.3f}, worst {max(losses):.3f} "
              f"over {len(losses)} rows")


if __name__ == "__main__":
    main()
