"""Time candidate tile shapes on a few representative rows (the data behind configs.py's choices).

    python benchmarks/sweep_tiles.py [--write] [--prefill-only | --decode-only]
Each candidate is first checked against the NumPy reference (tests/test_gpu_gemm.run_case), then timed; one line
per (candidate, row): time in us and the fraction of the traffic floor / matmul rate. The last line,
`bench_args: ...`, holds the winners as arguments for benchmarks/bench_gemm.py.
--write makes the winners configs.py's defaults; --prefill-only / --decode-only skip the other regime's candidates
(its defaults stay).
On sm_90a the tc candidates run the wgmma variant (CUPY_MOE_HOPPER=0: the mma.sync one).
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gemm as bg  # noqa: E402
from cupy_moe import configs  # noqa: E402
from cupy_moe.configs import GemmConfig  # noqa: E402

# decode (moe_gemm): pairs of (block_m 16, block_m 32) shapes (mt, warps_m, warps_n, ng, ku, stages). Per stage a
# CTA reads 32*ku/8 qweight rows x 32*warps_n*ng columns (16 rows x 512 B at ku 4); stages - 1 in flight (static
# shared memory: 48 KiB, so 8-bit rings hold half the stages).
DEC = lambda mt, ku, st: GemmConfig(mt, 1, 4, 1, ku, st)
DECODE = [(DEC(1, 4, 2), DEC(2, 2, 4)), (DEC(1, 4, 3), DEC(2, 2, 6)), (DEC(1, 4, 4), DEC(2, 2, 8)),
          (DEC(1, 2, 6), DEC(2, 2, 6))]
_TC_WARPS = {(64, 128): (2, 2, 4, 1), (128, 128): (2, 4, 2, 2), (64, 256): (2, 2, 4, 2), (128, 256): (4, 2, 4, 2)}
TC = lambda bm, bn, st=4, ku=1: GemmConfig(*_TC_WARPS[bm, bn], ku=ku, stages=st, kind="tc")  # ku: 32-k steps/stage
# prefill (moe_gemm_tc): (block_m 64 shape, block_m 128 shape, ROWS_64_MAX = the most rows per touched expert that
# still run block_m 64)
PREFILL = [(TC(64, 256, 6), TC(128, 256, 4, 2), 160), (TC(64, 256, 6), TC(128, 256, 4, 2), 320),
           (TC(64, 256, 6), TC(128, 256, 4, 2), 96)]  # the last two: rows-per-expert switch points
DECODE_ROWS = [("Mixtral-8x7B", "gate_up", 1), ("Mixtral-8x7B", "gate_up", 64), ("Qwen3-30B-A3B", "down", 16),
               ("DeepSeek-V3", "down", 16), ("Qwen3-30B-A3B", "down", 1), ("DeepSeek-V3", "gate_up", 1),
               ("Mixtral-8x7B", "down", 64), ("DeepSeek-V2-Lite", "down", 256)]  # the last two: block 32
PREFILL_ROWS = [("Mixtral-8x7B", "gate_up", 4096), ("Mixtral-8x7B", "down", 1024), ("Qwen3-30B-A3B", "gate_up", 4096),
                ("DeepSeek-V3", "down", 1024), ("Qwen3-30B-A3B", "down", 1024),
                ("Qwen2-57B-A14B", "gate_up", 1024)]  # rows per touched expert: 1024, 256, 256, 32, 64, 128


def check(cfgs):
    """Each candidate against the NumPy reference first (tests/test_gpu_gemm.run_case asserts the accuracy bar);
    False (and the reason printed) when one fails: the sweep skips it."""
    import numpy as np
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_gpu_gemm as t
    rng = np.random.default_rng(3)
    try:
        for cfg in cfgs:
            for bits, dt, n, gs, sym, act in ((4, "float16", 288, 128, False, False),
                                              (8, "bfloat16", 96, 32, True, False),
                                              (4, "bfloat16", 1056, -1, False, False),
                                              (4, "float16", 96, 64, False, True)):
                t.run_case(rng, e=4, m=300 if cfg.block_m > 16 else 5, a=2, k=1408, n=n, bits=bits, group_size=gs,
                           sym=sym, act_order=act, dtype_name=dt, routed=True, kind="uniform", block_m=cfg.block_m)
    except Exception as exc:  # a wrong or failing candidate must not become a default
        print(f"sweep check FAILED for {[bg.tile_spec(c) for c in cfgs]}: {type(exc).__name__}: {exc}", flush=True)
        return False
    return True


def main():
    copy_bw, mm_rate = bg.copy_bandwidth(), bg.matmul_rate()

    def time_rows(rows, label):
        logt = 0.0
        for model, phase, m in rows:
            r = bg.bench_row(model, phase, m, copy_bw, mm_rate, 10, rotations=4, baseline=False)
            logt += math.log(r["time_us"])
            print(f"sweep {label} {model:14s} {phase:7s} {m:5d} B={r['block_m']:3d} S={r['split_k']:2d} "
                  f"{r['time_us']:9.1f} us floor {r['floor_ratio']:.2f} flops {r['flop_ratio']:.2f}", flush=True)
        return logt

    # the current defaults (use_tile changes them as it goes) stand wherever no candidate passes its check
    default_rows64 = configs.ROWS_64_MAX
    best_dec = (math.inf, configs.DECODE, configs.DECODE_32)
    best_pre = (math.inf, configs.PREFILL, configs.PREFILL_128, default_rows64)
    for c16, c32 in () if "--prefill-only" in sys.argv else DECODE:
        for c in (c16, c32):
            bg.use_tile(c)
        if not check([c16, c32]):
            continue
        logt = time_rows(DECODE_ROWS, f"{bg.tile_spec(c16)};{bg.tile_spec(c32)}")
        if logt < best_dec[0]:
            best_dec = (logt, c16, c32)
    for c64, c128, rows64 in () if "--decode-only" in sys.argv else PREFILL:
        for c in (c64, c128):
            bg.use_tile(c)
        configs.ROWS_64_MAX = rows64
        if not check([c64, c128]):
            continue
        logt = time_rows(PREFILL_ROWS, f"{bg.tile_spec(c64)};{bg.tile_spec(c128)} rows64<={rows64}")
        if logt < best_pre[0]:
            best_pre = (logt, c64, c128, rows64)
    configs.ROWS_64_MAX = default_rows64
    _, c16, c32 = best_dec
    _, c64, c128, rows64 = best_pre
    print(f"bench_args: --tiles {bg.tile_spec(c16)};{bg.tile_spec(c32)};{bg.tile_spec(c64)};{bg.tile_spec(c128)} "
          f"--rows-64-max {rows64}", flush=True)
    if "--write" in sys.argv:
        write_defaults(c16, c32, c64, c128, rows64)


def write_defaults(c16, c32, c64, c128, rows64):
    """Make the winners configs.py's defaults (DECODE, DECODE_32, PREFILL, PREFILL_128, ROWS_64_MAX)."""
    import re
    path = Path(configs.__file__)
    src = path.read_text()
    for name, cfg in (("DECODE", c16), ("DECODE_32", c32), ("PREFILL", c64), ("PREFILL_128", c128)):
        kind = ', kind="tc"' if cfg.kind == "tc" else ""
        new = (f"{name} = GemmConfig(mt={cfg.mt}, warps_m={cfg.warps_m}, warps_n={cfg.warps_n}, ng={cfg.ng}, "
               f"ku={cfg.ku}, stages={cfg.stages}{kind})")
        src, n = re.subn(rf"^{name} = GemmConfig\([^)]*\)", new, src, flags=re.M)
        assert n == 1, name
    src, n = re.subn(r"^ROWS_16_MAX, ROWS_64_MAX = (\d+), \d+", rf"ROWS_16_MAX, ROWS_64_MAX = \g<1>, {rows64}", src,
                     flags=re.M)
    assert n == 1
    path.write_text(src)
    print(f"wrote the winners into {path}", flush=True)


if __name__ == "__main__":
    main()
