"""Time candidate tile shapes on a few representative rows (the data behind configs.py's choices).

    python benchmarks/sweep_tiles.py
Prints one line per (candidate, row): time in us and the fraction of the traffic floor / matmul rate.
"""
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gemm as bg  # noqa: E402
from cupy_moe import configs  # noqa: E402
from cupy_moe.configs import GemmConfig  # noqa: E402

DECODE = [GemmConfig(1, 1, 4, 1, 4, 4), GemmConfig(1, 1, 4, 1, 2, 6), GemmConfig(1, 1, 4, 1, 2, 4),
          GemmConfig(1, 1, 4, 1, 4, 2)]
# tc kernel (moe_gemm_tc): block_m 64 and 128 at 3/4/5 stages; choose_config picks the block size per row
PREFILL = [GemmConfig(2, 2, 4, 1, 1, st, kind="tc") for st in (3, 4, 5)]
DECODE_ROWS = [("Mixtral-8x7B", "gate_up", 16), ("Qwen3-30B-A3B", "gate_up", 64), ("DeepSeek-V3", "down", 16),
               ("Qwen3-30B-A3B", "down", 1)]
PREFILL_ROWS = [("Mixtral-8x7B", "gate_up", 4096), ("Qwen3-30B-A3B", "gate_up", 4096), ("DeepSeek-V3", "down", 1024)]


def main():
    copy_bw, mm_rate = bg.copy_bandwidth(), bg.matmul_rate()
    winners = {}
    for block_m, cands, rows in ((16, DECODE, DECODE_ROWS), (64, PREFILL, PREFILL_ROWS)):
        best = None
        for cand in cands:
            logt = 0.0
            if block_m == 16:
                configs.DECODE = cand
                configs.KERNEL_SHAPES[16] = cand
            else:  # same stage count for both tc block sizes
                configs.PREFILL = cand
                configs.PREFILL_128 = replace(configs.PREFILL_128, stages=cand.stages)
                configs.KERNEL_SHAPES[64], configs.KERNEL_SHAPES[128] = configs.PREFILL, configs.PREFILL_128
            for model, phase, m in rows:
                r = bg.bench_row(model, phase, m, copy_bw, mm_rate, 10, rotations=4, baseline=False)
                logt += math.log(r["time_us"])
                print(f"sweep {cand.mt},{cand.warps_m},{cand.warps_n},{cand.ng},{cand.ku},{cand.stages} {model:14s} {phase:7s} {m:5d} "
                      f"S={r['split_k']:2d} {r['time_us']:9.1f} us floor {r['floor_ratio']:.2f} "
                      f"flops {r['flop_ratio']:.2f}", flush=True)
            if best is None or logt < best[0]:
                best = (logt, cand)
        c = best[1]
        winners[block_m] = f"{c.mt},{c.warps_m},{c.warps_n},{c.ng},{c.ku},{c.stages}"
    print(f"winners decode={winners[16]} prefill={winners[64]}")


if __name__ == "__main__":
    main()
