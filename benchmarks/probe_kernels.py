"""Where does the GEMM time go? Time a few rows with parts of the kernels left out (CUPY_MOE_PROBE bits, see
kernels/moe_gemm.cu): 1 = no weight loads, 2 = no dequantization, 4 = no mma. Results are wrong under a probe;
only the times mean something.

    python benchmarks/probe_kernels.py [--rows all|decode|prefill] [--probes 0,1,2,4,6,3,7]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gemm as bg  # noqa: E402

ROWS = [("Mixtral-8x7B", "gate_up", 1), ("Mixtral-8x7B", "gate_up", 16), ("Mixtral-8x7B", "gate_up", 64),
        ("Qwen3-30B-A3B", "down", 1), ("DeepSeek-V3", "down", 16),
        ("Mixtral-8x7B", "gate_up", 4096), ("Qwen3-30B-A3B", "gate_up", 4096)]
PROBES = {0: "full", 1: "no weight loads", 2: "no dequant", 4: "no mma", 6: "loads only", 3: "mma only",
          7: "nothing but A/scales"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", choices=["all", "decode", "prefill"], default="all")
    ap.add_argument("--probes", default=",".join(str(b) for b in PROBES))
    args = ap.parse_args()
    rows = [r for r in ROWS if args.rows == "all" or (r[2] <= 64) == (args.rows == "decode")]
    probes = [int(b) for b in args.probes.split(",")]
    copy_bw, mm_rate = bg.copy_bandwidth(), bg.matmul_rate()
    print(f"{'probe':22s} " + " ".join(f"{m[:7]}/{ph[:2]}/{mm:<5d}" for m, ph, mm in rows))
    for bits in probes:
        label = PROBES[bits]
        bg.set_probe(bits)
        times = [bg.bench_row(m, ph, mm, copy_bw, mm_rate, 10, rotations=4, baseline=False)["time_us"]
                 for m, ph, mm in rows]
        print(f"{bits} {label:20s} " + " ".join(f"{t:16.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
