"""Time one fused GPTQ MoE GEMM phase for every model of SHAPES.md against floors measured in the same run.

    python benchmarks/bench_gemm.py [--bar issue3|issue6] [--models Mixtral-8x7B,...] [--m 1,16,...] [--json FILE]

Per row (model, phase, M), 4-bit weights, G = 128, real zero points, fp16 activations (--dtype bfloat16: bf16):
- traffic floor: touched * (K*N/2 + (K/G)*N*2 + (K/G)*(N/8)*4) bytes of weights + activations read (rows*K*2)
  + outputs written (P*N*2), over the device-to-device copy bandwidth measured here (bytes read + written);
- FLOP floor: 2*P*K*N over the cupy.matmul fp16 8192^3 rate measured here;
- baseline: per touched expert, dequantize to fp16 (one elementwise kernel) + cupy.matmul on its rows.
M = 1 rows take the routing as `fused_moe` passes it at M = 1: one pair per block, topk_ids as the expert ids, no
aligned list. Other rows take the aligned list of moe_align_block_size (made before timing). Down rows on 16-row blocks
take their activations in pair order (`a_pair_order`), as fused_moe's silu-and-mul writes them there
(configs.down_pair_order; --natural-down: in natural order, for an A/B).
Timing: CUDA events around replays of a CUDA graph that holds one call per input set, after warm-up; the median
replay over the number of calls. The sets rotate among several routings (and weight copies when the weights
would fit in L2), so L2 does not flatter small problems. The baseline is timed eagerly (events per call).
Exit status 1 when a row misses the chosen bar (issue3: decode M<=64 >= 40% of the traffic floor, prefill
M>=1024 >= 40% of the matmul rate, every row faster than the baseline; issue6: decode M<=64 within floor / 0.85, or
floor + 4 us where the floor is under 10 us, prefill M>=1024 >= 70% of the matmul rate, rows with 128 <= M <= 512 no
slower than the better of the two regimes' kernels and than the baseline). A prefill row whose target time (its
FLOPs at the bar's share of the matmul rate) is shorter than its traffic floor is marked `target < traffic floor`:
no kernel can meet that target at the copy bandwidth measured in the run. An issue6 run also counts the rows that
meet the issue3 bar, which needs no other data (the json has `pass_issue3` per row).
Regimes (--bar issue6, 128 <= M <= 512): the same row aligned to 16-row blocks (the decode kernel) and to 128-row
blocks (the prefill kernel), each with the split the heuristic gives it, timed like our row; where the heuristic's
block is one of the two, our own time stands for it (one configuration timed twice in one run read 1764.5 and
1585.9 us: DeepSeek-V3 gate/up M = 512, H200, 2026-12-04 19:13). A row passes when its time is at most BETWEEN_SLACK
above the faster regime.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp  # noqa: E402

from cupy_moe import _compile, configs  # noqa: E402
from cupy_moe.align import moe_align_block_size  # noqa: E402
from cupy_moe.gemm import fused_moe_gemm  # noqa: E402
from cupy_moe.weights import StackedGptqWeight  # noqa: E402

MODELS = configs.MODEL_SHAPES  # name: (H, I, E, A)
G = 128
BITS = 4
REGIME_BLOCKS = (16, 128)  # block_m of the decode and of the prefill kernel
BETWEEN_SLACK = 0.03

_DEQUANT = cp.ElementwiseKernel(
    "raw int32 qweight, raw float16 scales, raw int32 qzeros, int32 K, int32 N, int32 G",
    "float16 w",
    """
    const int k = i / N, n = i % N;
    const unsigned int word = (unsigned int)qweight[(k / 8) * N + n];
    const int q = (word >> (4 * (k % 8))) & 15;
    const int g = k / G;
    const unsigned int zw = (unsigned int)qzeros[g * (N / 8) + n / 8];
    const int z = (zw >> (4 * (n % 8))) & 15;
    w = (float16)((float)(q - z) * (float)scales[g * N + n]);
    """, "bench_dequant4")


def timed(fn, iters, warmup=3):
    for i in range(warmup):
        fn(i)
    starts = [cp.cuda.Event() for _ in range(iters)]
    ends = [cp.cuda.Event() for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    ends[-1].synchronize()
    return float(np.median([cp.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)])) * 1e-3  # seconds


def copy_bandwidth():
    src = cp.random.random(256 * 2**20 // 8 * 8).astype(cp.float32)  # 1 GiB
    dst = cp.empty_like(src)
    t = timed(lambda i: dst.__setitem__(Ellipsis, src), 20)
    return 2 * src.nbytes / t


def matmul_rate():
    a = cp.random.standard_normal((8192, 8192)).astype(cp.float16)
    b = cp.random.standard_normal((8192, 8192)).astype(cp.float16)
    t = timed(lambda i: cp.matmul(a, b), 10)
    return 2 * 8192**3 / t


def random_weight(e, k, n, rng_seed):
    rs = cp.random.RandomState(rng_seed)
    groups = k // G
    qweight = rs.randint(-2**31, 2**31 - 1, size=(e, k // 8, n), dtype=cp.int32)
    scales = (rs.uniform(0.5, 1.5, size=(e, groups, n)) * 4.0 / (16 * math.sqrt(k))).astype(cp.float16)
    qzeros = rs.randint(-2**31, 2**31 - 1, size=(e, groups, n // 8), dtype=cp.int32)
    return StackedGptqWeight(qweight, scales, qzeros, None, bits=BITS, group_size=G)


def phase_shape(model, phase, m):
    """(K, N, top_k, activation rows, packed weight bytes of one expert) of one phase at M tokens."""
    h, inter, _, a_top = MODELS[model]
    if phase == "gate_up":
        k, n, top_k, rows = h, 2 * inter, a_top, m
    else:
        k, n, top_k, rows = inter, h, 1, m * a_top
    return k, n, top_k, rows, k * n // 2 + (k // G) * n * 2 + (k // G) * (n // 8) * 4


NATURAL_DOWN = False  # --natural-down


def prepare_row(model, phase, m, rotations=8, dtype=np.float16, block_m=None, weights=None):
    """The inputs of one benchmark row: `rotations` routings (and weight copies where they would fit in L2), the
    activations and outputs in `dtype` (np.float16 or ml_dtypes.bfloat16). Returns a namespace with the shapes,
    the config, the inputs and `call(i)`, which runs our GEMM on input set i % rotations.
    block_m: align to this block size instead of the heuristic's; weights: the weight copies of an earlier call."""
    _, _, e, a_top = MODELS[model]
    k, n, top_k, rows, w_bytes_expert = phase_shape(model, phase, m)
    p = rows * top_k
    rng = np.random.default_rng(m * 7 + len(model))
    copies = max(1, min(4, math.ceil(512 * 2**20 / (w_bytes_expert * e))))
    if weights is None:
        weights = [random_weight(e, k, n, 11 + c) for c in range(copies)]
    cfg = configs.choose_config(rows, e, top_k, k, n, BITS, G, block_m=block_m)
    sets = []
    for r in range(rotations):
        ids = np.stack([rng.permutation(e)[:a_top] for _ in range(m)]).astype(np.int32)  # [M, A] routing
        if phase == "down":
            ids_rows = ids.reshape(p, 1)  # one row per pair
        else:
            ids_rows = ids
        x = cp.asarray(rng.standard_normal((rows, k)).astype(dtype))
        if m == 1 and block_m is None:  # fused_moe's M = 1 path: one pair per block
            s, eid, post = None, cp.asarray(ids_rows), None
        else:
            s, eid, post = moe_align_block_size(cp.asarray(ids_rows), cfg.block_m, e)
        out = cp.empty((p, n), dtype)
        sets.append((x, s, eid, post, out, ids_rows, len(np.unique(ids))))
    cp.cuda.Device().synchronize()

    # the layout fused_moe's silu-and-mul gives this block size (the values are random either way)
    pair = phase == "down" and configs.down_pair_order(BITS, cfg.block_m) and not NATURAL_DOWN

    def call(i):
        x, s, eid, post, out, _, _ = sets[i % rotations]
        fused_moe_gemm(x, weights[i % copies], s, eid, post, top_k, out=out, a_pair_order=pair)

    return SimpleNamespace(k=k, n=n, top_k=top_k, rows=rows, p=p, cfg=cfg, weights=weights, copies=copies,
                           sets=sets, w_bytes_expert=w_bytes_expert, call=call)


def graph_time(call, rotations, iters):
    """Seconds per call of `call(i)`, timed as replays of a CUDA graph holding one call per rotation (as a serving
    engine runs it): the launcher's Python checks stay out of the GPU time, launch gaps inside the graph stay in."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(rotations):
            call(i)  # compiles, and creates the split-K workspace of this stream
        stream.begin_capture()
        for i in range(rotations):
            call(i)
        graph = stream.end_capture()
        return timed(lambda i: graph.launch(stream), max(5, iters // 2), warmup=2) / rotations


def bench_row(model, phase, m, copy_bw, mm_rate, iters, rotations=8, baseline=True, dtype=np.float16,
              regimes=False):
    r = prepare_row(model, phase, m, rotations, dtype)
    k, n, p, sets = r.k, r.n, r.p, r.sets
    t = graph_time(r.call, rotations, iters)
    regime = {}
    if regimes and 128 <= m <= 512:  # the decode and the prefill kernel on the same row (module docstring)
        for bm in REGIME_BLOCKS:
            if bm == r.cfg.block_m:
                regime[bm] = t * 1e6
                continue
            alt = prepare_row(model, phase, m, rotations, dtype, block_m=bm, weights=r.weights)
            regime[bm] = graph_time(alt.call, rotations, iters) * 1e6
    t_base = baseline_time(r, iters) if baseline else float("nan")
    touched = float(np.mean([st[6] for st in sets]))
    traffic = touched * r.w_bytes_expert + r.rows * k * 2 + p * n * 2
    flops = 2.0 * p * k * n
    floor_t = traffic / copy_bw
    return dict(model=model, phase=phase, m=m, k=k, n=n, block_m=r.cfg.block_m, block_n=r.cfg.block_n,
                kind=r.cfg.kind, warps_k=r.cfg.warps_k, shape=r.cfg.short_name,
                split_k=r.cfg.split_k,
                time_us=t * 1e6, tbps=traffic / t / 1e12, tflops=flops / t / 1e12,
                floor_ratio=floor_t / t, flop_ratio=flops / t / mm_rate, baseline_us=t_base * 1e6,
                baseline_ratio=t_base / t, traffic_floor_us=floor_t * 1e6,
                regime_us={str(bm): v for bm, v in regime.items()})


def baseline_time(r, iters):
    """Per touched expert dequantize + matmul on the inputs of prepare_row (the host knows the routing: a baseline
    may sync); median seconds per call."""
    dense = cp.empty((r.k, r.n), cp.float16)
    plans = []
    for _, _, _, _, _, ids_rows, _ in r.sets:
        flat = ids_rows.reshape(-1)
        plans.append([(int(ex), cp.asarray(np.nonzero(flat == ex)[0].astype(np.int64))) for ex in np.unique(flat)])

    def baseline_call(i):
        x, _, _, _, out, _, _ = r.sets[i % len(r.sets)]
        wt = r.weights[i % r.copies]
        for ex, pairs in plans[i % len(r.sets)]:
            _DEQUANT(wt.qweight[ex], wt.scales[ex], wt.qzeros[ex], r.k, r.n, G, dense)
            out[pairs] = cp.matmul(x[pairs // r.top_k], dense)

    return timed(baseline_call, max(3, min(iters, 10)), warmup=2)


def parse_tiles(spec):
    """'16=1,1,4,1,4,4;64=tc:2,2,4,2,1,4' -> [GemmConfig, ...]: block_m=[kind:]mt,warps_m,warps_n,ng,ku,stages[,warps_k]
    with kind reg (moe_gemm, the default), tc (moe_gemm_tc) or ws (moe_gemm_ws, sm_90a); block_m is checked.
    A reg shape with warps_k > 1 replaces configs.SPLIT_WARPS_SHAPES[block_m]."""
    out = []
    for item in filter(None, spec.split(";")):
        key, val = item.split("=")
        kind, _, val = val.rpartition(":")
        kind = kind or "reg"
        if kind not in ("reg", "tc", "ws"):
            raise ValueError(f"--tiles: {item!r}: kind {kind!r} is not one of ['reg', 'tc', 'ws']")
        ints = [int(v) for v in val.split(",")]
        cfg = configs.GemmConfig(*ints[:6], kind=kind, warps_k=ints[6] if len(ints) > 6 else 1)
        if cfg.block_m != int(key):
            raise ValueError(f"--tiles: {item!r} has block_m {cfg.block_m}, not {key}")
        out.append(cfg)
    return out


def tile_spec(cfg):
    kind = "" if cfg.kind == "reg" else f"{cfg.kind}:"
    wk = f",{cfg.warps_k}" if cfg.warps_k > 1 else ""
    return f"{cfg.block_m}={kind}{cfg.mt},{cfg.warps_m},{cfg.warps_n},{cfg.ng},{cfg.ku},{cfg.stages}{wk}"


def use_tile(cfg):
    """Make `cfg` the kernel shape of its block_m (what choose_config and the launcher use)."""
    if cfg.kind == "ws":  # sm_90a only: the portable shape of the block size stays
        configs.HOPPER_SHAPES[cfg.block_m] = cfg
        return
    if cfg.warps_k > 1:
        configs.SPLIT_WARPS_SHAPES[cfg.block_m] = cfg
        return
    configs.HOPPER_SHAPES.pop(cfg.block_m, None)
    configs.KERNEL_SHAPES[cfg.block_m] = cfg
    name = {16: "DECODE", 32: "DECODE_32", 64: "PREFILL", 128: "PREFILL_128"}[cfg.block_m]
    setattr(configs, name, cfg)


def set_probe(bits):
    """Rebuild the kernels with CUPY_MOE_PROBE=bits (0: the real kernels); see kernels/moe_gemm.cu."""
    os.environ["CUPY_MOE_PROBE"] = str(bits) if bits else ""
    _compile._module.cache_clear()
    _compile._kernel.cache_clear()


PREFILL_FLOP_BAR = {"issue3": 0.40, "issue6": 0.70}  # share of the matmul rate a prefill row (M >= 1024) must reach


def verdict(row, bar):
    ok = not row["baseline_ratio"] <= 1.0  # NaN (--no-baseline): that part of the bar is not judged
    if row["m"] >= 1024:
        ok &= row["flop_ratio"] >= PREFILL_FLOP_BAR[bar]
    if bar == "issue3":
        if row["m"] <= 64:
            ok &= row["floor_ratio"] >= 0.40
    else:  # issue6
        if row["m"] <= 64:
            fl = row["traffic_floor_us"]
            ok &= row["time_us"] <= (fl / 0.85 if fl >= 10 else fl + 4)
        if row["regime_us"]:
            ok &= row["time_us"] <= (1 + BETWEEN_SLACK) * min(row["regime_us"].values())
    return ok


def target_under_floor(row, bar):
    """Whether a prefill row's time target (its FLOPs at PREFILL_FLOP_BAR of the matmul rate) is shorter than its
    traffic floor: moving the row's bytes at the copy bandwidth measured in the same run takes longer than the bar
    allows, whatever the kernel computes."""
    if row["m"] < 1024 or not row["flop_ratio"] > 0:
        return False
    return row["time_us"] * row["flop_ratio"] / PREFILL_FLOP_BAR[bar] < row["traffic_floor_us"]


def summary(rows, bar):
    """The last line of a run: rows that meet `bar`; an issue6 run also counts the issue3 bar, and the prefill rows
    whose target is shorter than their traffic floor."""
    line = f"# {sum(r['pass'] for r in rows)}/{len(rows)} rows meet the {bar} bar"
    if bar != "issue3":
        line += f"; {sum(r['pass_issue3'] for r in rows)}/{len(rows)} meet the issue3 bar"
    under = sum(r["target_under_floor"] for r in rows)
    return line + (f"; {under} prefill rows have a target shorter than their traffic floor" if under else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bar", choices=["issue3", "issue6"], default="issue3")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--m", default="1,16,64,256,1024,4096")
    ap.add_argument("--phases", default="gate_up,down")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiles", default=None,
                    help="tuning: override kernel shapes, e.g. '16=1,1,4,1,4,4;64=tc:2,2,4,2,1,4' "
                         "(block_m=[reg:|tc:]mt,warps_m,warps_n,ng,ku,stages[,warps_k]; see benchmarks/sweep_tiles.py)")
    ap.add_argument("--rows-16-max", type=int, default=None, help="tuning: override configs.ROWS_16_MAX")
    ap.add_argument("--rows-64-max", type=int, default=None, help="tuning: override configs.ROWS_64_MAX")
    ap.add_argument("--warps-k-extra-stages", type=int, default=None,
                    help="tuning: override configs.WARPS_K_EXTRA_STAGES (-1: never the warps-along-K shape)")
    ap.add_argument("--split-fill-stages", type=int, default=None,
                    help="tuning: override configs.SPLIT_FILL_STAGES (the split estimate's per-CTA stages)")
    ap.add_argument("--resident", default=None,
                    help="tuning: override configs.RESIDENT_PER_SM (CTAs per SM of the shapes without a launch bound) "
                         "for the split-K estimate, e.g. '32=2'")
    ap.add_argument("--no-baseline", action="store_true", help="skip the dequantize + matmul baseline (A/B runs)")
    ap.add_argument("--natural-down", action="store_true",
                    help="tuning: down rows read their activations in natural order instead of fused_moe's pair order")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                    help="activations and outputs (bfloat16 needs ml_dtypes and --no-baseline: the baseline is fp16; "
                         "the FLOP floor stays the fp16 matmul rate, which bf16 shares on Hopper)")
    args = ap.parse_args(argv)
    global NATURAL_DOWN
    NATURAL_DOWN = args.natural_down
    if args.dtype == "bfloat16" and not args.no_baseline:
        ap.error("--dtype bfloat16: expected --no-baseline as well (the dequantize + matmul baseline is fp16)")
    dtype = np.float16
    if args.dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    if args.tiles:
        for cfg in parse_tiles(args.tiles):
            use_tile(cfg)
            print(f"# tile override {cfg}")
    if args.resident:
        for item in args.resident.split(","):
            key, val = (int(v) for v in item.split("="))
            configs.RESIDENT_PER_SM[key] = val
        print(f"# RESIDENT_PER_SM = {configs.RESIDENT_PER_SM}")
    if args.natural_down:
        print("# down rows: activations in natural order")
    if args.rows_16_max is not None:
        configs.ROWS_16_MAX = args.rows_16_max
        print(f"# ROWS_16_MAX = {args.rows_16_max}")
    if args.split_fill_stages is not None:
        configs.SPLIT_FILL_STAGES = args.split_fill_stages
        print(f"# SPLIT_FILL_STAGES = {args.split_fill_stages}")
    if args.warps_k_extra_stages is not None:
        configs.WARPS_K_EXTRA_STAGES = args.warps_k_extra_stages
        print(f"# WARPS_K_EXTRA_STAGES = {args.warps_k_extra_stages}")
    if args.rows_64_max is not None:
        configs.ROWS_64_MAX = args.rows_64_max
        print(f"# ROWS_64_MAX = {args.rows_64_max}")
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    copy_bw = copy_bandwidth()
    mm_rate = matmul_rate()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {gpu}, "
          f"copy {copy_bw / 1e12:.2f} TB/s (read+write), cupy.matmul fp16 8192^3 {mm_rate / 1e12:.0f} TFLOP/s")
    print(f"# command: python {' '.join(sys.argv)}")
    rows = []
    hdr = (f"{'model':18s} {'phase':7s} {'M':>5s} {'B':>3s} {'S':>2s} {'time us':>9s} {'TB/s':>6s} {'TFLOP/s':>8s} "
           f"{'floor':>6s} {'flops':>6s} {'base us':>9s} {'vs base':>7s}  bar")
    print(hdr)
    for model in args.models.split(","):
        for phase in args.phases.split(","):
            for m in (int(v) for v in args.m.split(",")):
                row = bench_row(model, phase, m, copy_bw, mm_rate, args.iters, baseline=not args.no_baseline,
                                dtype=dtype, regimes=args.bar == "issue6")
                row["pass"] = bool(verdict(row, args.bar))
                row["pass_issue3"] = bool(verdict(row, "issue3"))  # judged on the same data in either run
                row["target_under_floor"] = target_under_floor(row, args.bar)
                rows.append(row)
                print(f"{model:18s} {phase:7s} {m:5d} {row['shape']:>3s} {row['split_k']:2d} {row['time_us']:9.1f} "
                      f"{row['tbps']:6.2f} {row['tflops']:8.1f} {row['floor_ratio']:6.2f} {row['flop_ratio']:6.2f} "
                      f"{row['baseline_us']:9.1f} {row['baseline_ratio']:7.2f}  {'pass' if row['pass'] else 'FAIL'}"
                      + "".join(f"  B{bm} {v:.1f}" for bm, v in row["regime_us"].items())
                      + ("  target < traffic floor" if row["target_under_floor"] else ""), flush=True)
                cp.get_default_memory_pool().free_all_blocks()
    print(summary(rows, args.bar))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, copy_bw=copy_bw, mm_rate=mm_rate, bar=args.bar,
                                                   rows=rows), indent=1))
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
