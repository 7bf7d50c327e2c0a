"""Time one fused GPTQ MoE GEMM phase for every benchmark model against floors measured in the same run.

    python benchmarks/bench_gemm.py [--targets roofline] [--checksums] [--models Mixtral-8x7B,...] [--m 1,16,...]
                                    [--json FILE]

Per row (model, phase, M), 4-bit weights, G = 128, real zero points, fp16 activations (--dtype bfloat16: bf16):
- traffic floor: touched * (K*N/2 + (K/G)*N*2 + (K/G)*(N/8)*4) bytes of weights + activations read (rows*K*2)
  + outputs written (P*N*2), over the device-to-device copy bandwidth measured here (bytes read + written);
- FLOP floor: 2*P*K*N over the cupy.matmul fp16 8192^3 rate measured here; roofline = the larger floor, and the
  `roof` column is roofline / time;
- baseline: per touched expert, dequantize to fp16 (one elementwise kernel) + cupy.matmul on its rows.
Each row runs the configuration `choose_config` gives (`--block-m B` asks it for B-row blocks; `--tiles` swaps in
other shapes of the same block sizes, passed as `config=`). Rows take the pair list `fused_moe` gives their model at
that M (`configs.one_pair_blocks`): at M = 1, and at a few tokens of small experts, one pair per block, topk_ids as
the expert ids, no aligned list; otherwise the aligned list of moe_align_block_size (made before timing). Down rows
on 16-row blocks take their activations in pair order (`a_pair_order`), as fused_moe's silu-and-mul writes them
there (configs.down_pair_order; --natural-down: in natural order, for an A/B).
Timing: `cupy_moe.timing.graph_time`, a CUDA graph that holds one call per input set, replayed after warm-up; the
median replay over the number of calls. The sets rotate among several routings (and weight copies when the weights
would fit in L2), so L2 does not flatter small problems. The baseline is timed eagerly (events per call).

Target sets (--targets NAME; exit status 1 when a row misses one):
- roofline: `cupy_moe.timing.roofline_target`: M <= 64 within traffic floor / 0.85 (floor + 4 us where the floor
  is under 10 us); M >= 128 within roofline / 0.70; judged at M in `cupy_moe.timing.ROOFLINE_TARGET_M` (the
  default --m with --targets roofline).
--checksums: per row the SHA-1 of the output bytes of one call on the first input set (every input is seeded), so
that two code versions can be shown to give bitwise the same results.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import cupy as cp

from cupy_moe import configs
from cupy_moe.__main__ import Parser, argument_error, model_list, positive_int, token_counts
from cupy_moe._progress import progress_bar
from cupy_moe.align import moe_align_block_size
from cupy_moe.gemm import fused_moe_gemm
from cupy_moe.models import BENCHMARK_MODELS, get_model
from cupy_moe.timing import (ROOFLINE_TARGET_M, copy_bandwidth, event_time as timed, graph_time, matmul_rate,
                             random_activations, regime_summary, roofline_target, weight_copies)
from cupy_moe.weights import StackedGptqWeight, expert_nbytes

G = 128
BITS = 4
# name -> ((M, traffic floor s, FLOP floor s) -> target seconds or None, the token counts M it is judged at)
TARGETS = {"roofline": (roofline_target, ROOFLINE_TARGET_M)}
DEFAULT_M = (1, 16, 64, 256, 1024, 4096)

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


def phase_shape(model, phase, m):
    """(K, N, top_k, activation rows, packed weight bytes of one expert) of one phase at M tokens."""
    k, n, top_k = get_model(model).phases()[phase]
    rows = m if phase == "gate_up" else m * get_model(model).top_k
    return k, n, top_k, rows, expert_nbytes(k, n, BITS, G)


def one_pair(model, m):
    """Whether fused_moe runs M tokens of this model with one pair per block and no aligned list."""
    shape = get_model(model)
    return configs.one_pair_blocks(m, shape.top_k, shape.expert_nbytes(BITS, G))


def row_config(model, phase, m, gpu, tiles=(), natural_down=False, block_m=None):
    """(configuration, pair-ordered activations, one pair per block) of one benchmark row on `gpu` (a GpuInfo):
    what fused_moe would launch, on `block_m`-row blocks where given (rows with one pair per block keep their
    16-row blocks), with `tiles` (GemmConfigs) replacing the shape of their block size, split by the estimate."""
    shape = get_model(model)
    e = shape.num_experts
    k, n, top_k, rows, _ = phase_shape(model, phase, m)
    single = one_pair(model, m)  # fused_moe's pair list at this M
    if single:
        block_m = None
    cfg = configs.choose_config(rows, e, top_k, k, n, BITS, G, block_m, gpu=gpu, one_pair=single)
    # the layout fused_moe's silu-and-mul gives this block size (the values are random either way)
    pair = phase == "down" and configs.down_pair_order(BITS, cfg.block_m) and not natural_down
    cfg = configs.choose_config(rows, e, top_k, k, n, BITS, G, cfg.block_m, gpu=gpu, pair_a=pair, one_pair=single)
    for tile in tiles:
        if tile.block_m == cfg.block_m:
            split = configs.split_k_estimate(tile, rows, e, top_k, k, n, gpu=gpu, one_pair=single)
            cfg = configs.fallback(replace(tile, split_k=split), act_order=False, hopper=gpu.hopper, pair_a=pair)
    return cfg, pair, single


def prepare_row(model, phase, m, rotations=8, dtype=np.float16, tiles=(), natural_down=False, gpu=None,
                block_m=None):
    """The inputs of one benchmark row: `rotations` routings (and weight copies where they would fit in L2), the
    activations and outputs in `dtype` (np.float16 or ml_dtypes.bfloat16). Returns a namespace with the shapes,
    the configuration (`row_config`), the inputs and `call(i)`, which runs our GEMM on input set i % rotations."""
    shape = get_model(model)
    e, a_top = shape.num_experts, shape.top_k
    k, n, top_k, rows, w_bytes_expert = phase_shape(model, phase, m)
    p = rows * top_k
    seed = m * 7 + len(model)
    rng = np.random.default_rng(seed)
    copies = weight_copies(w_bytes_expert * e)
    weights = [StackedGptqWeight.random(e, k, n, bits=BITS, group_size=G, seed=11 + c) for c in range(copies)]
    cfg, pair, single = row_config(model, phase, m, gpu or configs.gpu_info(), tiles, natural_down, block_m)
    sets = []
    for r in range(rotations):
        ids = np.stack([rng.permutation(e)[:a_top] for _ in range(m)]).astype(np.int32)  # [M, A] routing
        ids_rows = ids.reshape(p, 1) if phase == "down" else ids  # down: one row per pair
        x = random_activations((rows, k), dtype, seed=seed + r)
        if single:
            s, eid, post = None, cp.asarray(ids_rows), None
        else:
            s, eid, post = moe_align_block_size(cp.asarray(ids_rows), cfg.block_m, e)
        out = cp.empty((p, n), dtype)
        sets.append((x, s, eid, post, out, ids_rows, len(np.unique(ids))))
    cp.cuda.Device().synchronize()

    def call(i):
        x, s, eid, post, out, _, _ = sets[i % rotations]
        fused_moe_gemm(x, weights[i % copies], s, eid, post, top_k, out=out, a_pair_order=pair, config=cfg)

    return SimpleNamespace(k=k, n=n, top_k=top_k, rows=rows, p=p, cfg=cfg, weights=weights, copies=copies,
                           sets=sets, w_bytes_expert=w_bytes_expert, call=call)


def traffic_and_flops(r):
    """(bytes, FLOPs) that the floors count for one call of a prepare_row row: the touched experts' packed weights
    (the mean over the routings), the activation rows read and the outputs written; 2 * P * K * N."""
    touched = float(np.mean([st[6] for st in r.sets]))
    return touched * r.w_bytes_expert + r.rows * r.k * 2 + r.p * r.n * 2, 2.0 * r.p * r.k * r.n


def checksum(r):
    """SHA-1 of the output bytes of one call on input set 0."""
    r.call(0)
    return hashlib.sha1(cp.asnumpy(r.sets[0][4]).tobytes()).hexdigest()


def bench_row(model, phase, m, copy_bw, mm_rate, iters, rotations=8, baseline=True, dtype=np.float16, tiles=(),
              natural_down=False, checksums=False, block_m=None):
    r = prepare_row(model, phase, m, rotations, dtype, tiles, natural_down, block_m=block_m)
    k, n = r.k, r.n
    t = graph_time([lambda i=i: r.call(i) for i in range(rotations)], reps=max(5, iters // 2), warmup=2)
    t_base = baseline_time(r, iters) if baseline else float("nan")
    traffic, flops = traffic_and_flops(r)
    floor_t, flop_t = traffic / copy_bw, flops / mm_rate
    row = dict(model=model, phase=phase, m=m, k=k, n=n, block_m=r.cfg.block_m, block_n=r.cfg.block_n,
               kind=r.cfg.kind, warps_k=r.cfg.warps_k, shape=r.cfg.short_name, split_k=r.cfg.split_k,
               config=r.cfg.spec, time_us=t * 1e6, tbps=traffic / t / 1e12, tflops=flops / t / 1e12,
               floor_ratio=floor_t / t, flop_ratio=flop_t / t, roofline_ratio=max(floor_t, flop_t) / t,
               traffic_floor_us=floor_t * 1e6, flop_floor_us=flop_t * 1e6, baseline_us=t_base * 1e6,
               baseline_ratio=t_base / t)
    if checksums:
        row["sha1"] = checksum(r)
    return row


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


def target_us(row, targets):
    """The row's time target in us under the target set `targets`, or None where the set has none for it."""
    target = TARGETS[targets][0](row["m"], row["traffic_floor_us"] * 1e-6, row["flop_floor_us"] * 1e-6)
    return None if target is None else target * 1e6


def write_json(path, gpu, copy_bw, mm_rate, targets, rows):
    """The run's floors and rows as JSON (the input of plot_bench.py)."""
    Path(path).write_text(json.dumps(dict(gpu=gpu.name, sm_count=gpu.sm_count, copy_bw=copy_bw, mm_rate=mm_rate,
                                          targets=targets, rows=rows), indent=1))


def tile_list(text):
    """';'-separated GemmConfig specs -> their GemmConfigs."""
    with argument_error("spec"):
        return [configs.GemmConfig.from_spec(spec) for spec in filter(None, text.split(";"))]


def main(argv=None, prog=None):
    """prog: how usage lines and errors name the benchmark (default: its file name); a bad argument is one line on
    stderr, exit status 2, as in `python -m cupy_moe`."""
    ap = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", choices=sorted(TARGETS), default=None,
                    help="judge each row against this target set; exit status 1 on a miss")
    ap.add_argument("--checksums", action="store_true", help="print and record the SHA-1 of each row's output bytes")
    ap.add_argument("--models", type=model_list, default=list(BENCHMARK_MODELS),
                    help="comma-separated names (any case)")
    ap.add_argument("--m", type=token_counts, default=None, help="token counts, comma-separated (default: "
                    f"{','.join(map(str, DEFAULT_M))}; with --targets, the M values the target set is judged at)")
    ap.add_argument("--phases", default="gate_up,down")
    ap.add_argument("--iters", type=positive_int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiles", type=tile_list, default=[],
                    help="run other shapes of the same block sizes, ';'-separated GemmConfig specs, e.g. "
                         "'reg:1,1,4,1,4,4,1;tc:2,2,4,2,1,4,1' (kind:mt,warps_m,warps_n,ng,ku,stages,warps_k)")
    ap.add_argument("--block-m", type=int, choices=configs.SUPPORTED_BLOCK_M, default=None,
                    help="run every row on blocks of this many rows, with the shape and split the rules give that "
                         "size (--tiles then swaps its shape); rows with one pair per block keep 16")
    ap.add_argument("--no-baseline", action="store_true", help="skip the dequantize + matmul baseline (A/B runs)")
    ap.add_argument("--natural-down", action="store_true",
                    help="down rows read their activations in natural order instead of fused_moe's pair order")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                    help="activations and outputs (bfloat16 needs ml_dtypes and --no-baseline: the baseline is fp16; "
                         "the FLOP floor stays the fp16 matmul rate, which bf16 shares on Hopper)")
    args = ap.parse_args(argv)
    if args.dtype == "bfloat16" and not args.no_baseline:
        ap.error("argument --dtype: expected float16 without --no-baseline (the dequantize + matmul baseline is "
                 "fp16), got bfloat16")
    ms = args.m or (TARGETS[args.targets][1] if args.targets else DEFAULT_M)
    phases = args.phases.split(",")
    if not phases or any(ph not in ("gate_up", "down") for ph in phases):
        ap.error(f"argument --phases: expected gate_up and/or down, comma-separated, got {args.phases!r}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"argument --json: expected a file in an existing folder, got {args.json!r}")
    models, tiles = args.models, args.tiles
    dtype = np.float16
    if args.dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    if args.block_m:
        print(f"# blocks of {args.block_m} rows")
    for tile in tiles:
        print(f"# tiles: {tile.spec} for {tile.block_m}-row blocks")
    if args.natural_down:
        print("# down rows: activations in natural order")
    gpu = configs.gpu_info()
    copy_bw = copy_bandwidth()
    mm_rate = matmul_rate()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {gpu.name} ({gpu.sm_count} SMs), "
          f"copy {copy_bw / 1e12:.2f} TB/s (read+write), cupy.matmul fp16 8192^3 {mm_rate / 1e12:.0f} TFLOP/s")
    print(f"# command: python {' '.join(sys.argv)}")
    rows = []
    hdr = (f"{'model':18s} {'phase':7s} {'M':>5s} {'B':>3s} {'S':>2s} {'time us':>9s} {'TB/s':>6s} {'TFLOP/s':>8s} "
           f"{'floor':>6s} {'flops':>6s} {'roof':>6s} {'base us':>9s} {'vs base':>7s} {'target':>9s}")
    print(hdr + ("  sha1" if args.checksums else ""))
    problems = [(model, phase, m) for model in models for phase in phases for m in ms]
    # a bar under the rows while they are measured (on a terminal only); the rows go to stdout through it
    with progress_bar(total=len(problems), unit="row", desc="measuring", leave=False) as bar:
        for model, phase, m in problems:
            row = bench_row(model, phase, m, copy_bw, mm_rate, args.iters, baseline=not args.no_baseline,
                            dtype=dtype, tiles=tiles, natural_down=args.natural_down, checksums=args.checksums,
                            block_m=args.block_m)
            if args.targets:
                row["target_us"] = target_us(row, args.targets)
                row["pass"] = row["target_us"] is None or row["time_us"] <= row["target_us"]
            rows.append(row)
            target = row.get("target_us")
            mark = "" if not args.targets else "" if row["pass"] else "  MISS"
            bar.write(f"{model:18s} {phase:7s} {m:5d} {row['shape']:>3s} {row['split_k']:2d} "
                      f"{row['time_us']:9.1f} {row['tbps']:6.2f} {row['tflops']:8.1f} {row['floor_ratio']:6.2f} "
                      f"{row['flop_ratio']:6.2f} {row['roofline_ratio']:6.2f} {row['baseline_us']:9.1f} "
                      f"{row['baseline_ratio']:7.2f} {'-' if target is None else f'{target:.1f}':>9s}" + mark
                      + (f"  {row['sha1']}" if args.checksums else ""))
            sys.stdout.flush()
            if args.json:  # after every row, so that a run stopped part of the way keeps what it measured
                write_json(args.json, gpu, copy_bw, mm_rate, args.targets, rows)
            bar.update()
            cp.get_default_memory_pool().free_all_blocks()
    for line in regime_summary(rows):
        print(f"# {line}")
    if args.targets:
        print(f"# {sum(r['pass'] for r in rows)}/{len(rows)} rows meet the {args.targets} targets")
    return 0 if not args.targets or all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
