"""Run a few benchmark rows once each inside a profiler window, for Nsight Compute's hardware counters.

    ncu --clock-control none --profile-from-start off --set full -o prof python3 benchmarks/profile_rows.py [ROWS]

ROWS: model:phase:M items separated by commas (default: decode and prefill rows that bound the issue-3 table).
Each row is set up and warmed (compiled, split-K workspace made) outside the window; only its profiled call is
inside, so the report holds one `moe_gemm*` kernel per row, in the printed order. `benchmarks/gpu_check.sh` runs it
as the `ncu` stage and prints the report's details and its per-instruction stall samples.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gemm as bg  # noqa: E402
import cupy as cp  # noqa: E402

DEFAULT = ("Mixtral-8x7B:gate_up:1,Mixtral-8x7B:gate_up:16,Mixtral-8x7B:gate_up:64,DeepSeek-V3:down:16,"
           "Qwen3-30B-A3B:down:1,Mixtral-8x7B:gate_up:4096")


def main(argv):
    spec = argv[1] if len(argv) > 1 else DEFAULT
    for item in spec.split(","):
        model, phase, m = item.split(":")
        row = bg.prepare_row(model, phase, int(m), rotations=2)
        for i in range(3):
            row.call(i)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        row.call(1)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        print(f"profiled {model} {phase} M={m}: {row.cfg}", flush=True)
        del row
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv)
