"""What limits the GEMM kernels: the same launch timed with parts of its main loop compiled out or changed.

    python tools/ablation.py [--models Mixtral-8x7B,...] [--phases gate_up,down] [--m 1024,4096] [--rounds R]
                             [--variants NAME,...] [--json FILE]

Per row (model, phase, M), built as benchmarks/bench_gemm.py builds it (4-bit weights, G = 128, real zero points,
fp16, the pair list and activation order fused_moe gives that M, routings and weight copies rotated against L2),
the kernel of the configuration `choose_config` gives is compiled once as it ships and once per variant of that
kernel below, with the named statements removed or replaced before NVRTC sees the source, and every build is timed on
the same inputs (a CUDA graph of one call per input set, median replay, the builds interleaved over --rounds
rounds). The variants compute garbage; only their times mean something.

The tc kernel (`moe_gemm_tc`, 64- and 128-row blocks; its wgmma path, so sm_90a only):
- no dequant: the raw words are copied but never dequantized (wgmma reads whatever the B tiles hold);
- no dequant or weight copies: as above, and the raw qweight rows are not copied either;
- skeleton: no dequantization and no copies at all: barriers, wgmma and the epilogue;
- no wgmma: copies and dequantization, no tensor work;
- copies only: no wgmma and no dequantization;
- no proxy fence: as shipped but without the fence.proxy.async each thread runs before the barrier that hands a stage
  to wgmma (what the fence itself costs; without it wgmma may read a tile before it is visible to it);
- no activation copies: as shipped but the activation rows are not copied (what their reads from L2 and HBM cost).
Its rows also give the bytes its CTAs copy from L2 into shared memory per call: every row of a block once per column
tile (K * 2 bytes each) and the expert's packed weights once per block, with the group's scales and zero words again
at every 32-k step; "copies only" moves exactly those bytes (and stores the outputs), so its time gives the rate at
which the CTAs' copies stream.

The swapped-operand kernel (`moe_gemm_swapped`, 32- and 48-row blocks on sm_90a), the same variants but the proxy
fence: "no dequant" leaves the register A fragments unwritten, "no wgmma" keeps the dequantized fragments alive
without tensor work.

The decode kernel (`moe_gemm`, 16-row blocks):
- copies only: each warp's ring of weight, scale and zero copies and its waits, no dequantization and no mma;
- compute only: no weight copies; the dequantization and mma run on whatever the ring holds;
- skeleton: neither: launch, prologue, the warps-along-K sum and the epilogue.

Each time is printed with a floor over it, as bench_gemm.py counts them: for tc rows the FLOP floor (FLOPs over the
fp16 matmul rate measured here, so 1.0 = that rate), for decode rows the traffic floor (bytes over the copy bandwidth
measured here), for swapped rows the roofline (the larger of the two); and as a fraction of the shipped build's time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from cupy_moe import _compile, configs
from cupy_moe.models import BENCHMARK_MODELS, get_model
from cupy_moe.timing import copy_bandwidth, graph_time, matmul_rate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gemm  # noqa: E402  (the rows as the benchmark builds them)

# statements of each kernel's main loop that a variant removes (each must occur in the source; each is replaced by
# an empty statement, so that a removed loop body leaves a loop, or, given as (statement, replacement), by that)
_TC_DEQUANT = ("if (it + 1 < nsteps) dequant(rd1, (it + 1) & 1);", "if (nsteps > 0) dequant(0, 0);")
_TC_WEIGHT_COPIES = ("gptq::cp_async16(st + L::kA + (tid + i * THREADS) * 16, q_src[i], true);",)
_TC_OTHER_COPIES = ("gptq::cp_async16(st + a_dst + i * (THREADS / 4) * 64, in ? a_src[i] : a, in && a_ok[i]);",
                    "if (x_do) gptq::cp_async16(st + x_dst, in ? x_src : reinterpret_cast<const unsigned char*>"
                    "(qweight), in);")
_TC_WGMMA = ("gptq::wgmma_m64k16<kBf16, WTN>(acc[0], gptq::wg_desc_sw64_at(a_desc0 + (ka >> 4)),\n"
             "                                       gptq::wg_desc_sw64_at(b_desc0 + (kb >> 4)));",)
_TC_FENCE = ("if constexpr (kWg) gptq::fence_proxy_async_smem();  // this thread's A copies and B stores -> wgmma "
             "reads",)
_SW_DEQUANT = ("dequant(rd, s + 1, nxt);", "dequant(rd1, 0, nxt);", "if (nsteps > 0) dequant(0, 0, fr0);")
_SW_WEIGHT_COPIES = ("gptq::cp_async16(st + q_dst[i], in ? q_src[i] : qweight, in && q_ok[i]);",)
_SW_OTHER_COPIES = (_TC_OTHER_COPIES[0],
                    "if (s_do) gptq::cp_async16(st + L::kA + L::kQ + s_chunk * 16, in ? s_src : scales, in && s_ok);",
                    "if (zc_do) gptq::cp_async16(st + L::kA + L::kQ + L::kS + z_thread * 16, in ? z_src : qweight, "
                    "in && zc_ok);")
# without the tensor work the fragments must still reach the output, or ptxas drops their dequantization
_SW_WGMMA = (("gptq::wgmma_m64k16_rs<kBf16, T>(acc[mw], fr[mw][h], desc);",
              "acc[mw][0][h] += __uint_as_float(fr[mw][h][0] ^ fr[mw][h][1] ^ fr[mw][h][2] ^ fr[mw][h][3]);"),)
_DECODE_COMPUTE = ("compute(cur, stage, c0);", "compute_n8(xs, stage, c0);")
_DECODE_COPIES = ("issue_weights(s, c_begin + s * KU);",
                  "issue_weights((stage + NST - 1) % NST, c0 + (NST - 1) * KU);")
# {kind: (kernels/ file, {variant: statements removed or replaced})}
VARIANTS = {
    "tc": (configs.KERNEL_FILES["tc"], {
        "as shipped": (), "no dequant": _TC_DEQUANT, "no dequant or weight copies": _TC_DEQUANT + _TC_WEIGHT_COPIES,
        "skeleton": _TC_DEQUANT + _TC_WEIGHT_COPIES + _TC_OTHER_COPIES, "no wgmma": _TC_WGMMA,
        "copies only": _TC_WGMMA + _TC_DEQUANT, "no proxy fence": _TC_FENCE,
        "no activation copies": _TC_OTHER_COPIES[:1]}),
    "swapped": (configs.KERNEL_FILES["swapped"], {
        "as shipped": (), "no dequant": _SW_DEQUANT, "no dequant or weight copies": _SW_DEQUANT + _SW_WEIGHT_COPIES,
        "skeleton": _SW_DEQUANT + _SW_WEIGHT_COPIES + _SW_OTHER_COPIES, "no wgmma": _SW_WGMMA,
        "copies only": _SW_WGMMA + _SW_DEQUANT, "no activation copies": _SW_OTHER_COPIES[:1]}),
    "reg": (configs.KERNEL_FILES["reg"], {
        "as shipped": (), "copies only": _DECODE_COMPUTE, "compute only": _DECODE_COPIES,
        "skeleton": _DECODE_COMPUTE + _DECODE_COPIES}),
}

_shipped_source = _compile._source


def use_variant(source_file: str, removed: tuple) -> None:
    """Make the next compile of kernels/`source_file` drop `removed` (and forget the kernels compiled so far)."""
    def source(filename: str) -> str:
        text = _shipped_source(filename)
        if filename == source_file:
            for entry in removed:
                statement, replacement = entry if isinstance(entry, tuple) else (entry, ";")
                if statement not in text:
                    sys.exit(f"{source_file} no longer contains {statement!r}: update this tool's statement lists")
                text = text.replace(statement, replacement)
        return text
    _compile._source = source
    _compile._module.cache_clear()
    _compile._kernel.cache_clear()


def row(model: str, phase: str, m: int, copy_bw: float, mm_rate: float, rounds: int, gpu,
        only: set | None = None) -> dict | None:
    """Time one row's builds; only: the names of the variants to time besides the shipped build (None: all)."""
    r = bench_gemm.prepare_row(model, phase, m, gpu=gpu)
    cfg = r.cfg
    if cfg.kind not in VARIANTS:
        print(f"{model} {phase} M = {m}: {cfg.spec}, a kernel without variants here: skipped", flush=True)
        return None
    source_file, variants = VARIANTS[cfg.kind]
    variants = {name: v for name, v in variants.items() if only is None or name in only or name == "as shipped"}
    calls = [lambda i=i: r.call(i) for i in range(len(r.sets))]
    times = {name: [] for name in variants}
    for rnd in range(rounds):
        for name in (variants if rnd % 2 == 0 else reversed(variants)):
            use_variant(source_file, variants[name])
            times[name].append(graph_time(calls, reps=8, warmup=2))
    use_variant(source_file, ())
    result = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    traffic, flops = bench_gemm.traffic_and_flops(r)
    floor_s = {"tc": flops / mm_rate, "reg": traffic / copy_bw}.get(cfg.kind, max(flops / mm_rate, traffic / copy_bw))
    floor_us = floor_s * 1e6
    head = f"{model} {phase} M = {m} ({cfg.spec}"
    copied = None
    if cfg.kind != "reg":
        blocks = float(np.mean([int(s[3][0]) // cfg.block_m for s in r.sets]))
        tiles_n = -(-r.n // cfg.block_n)
        w_block = (r.k // 32) * r.n * (32 * bench_gemm.BITS / 8 + 2 + bench_gemm.BITS / 8)  # per 32-k step
        copied = r.p * r.k * 2 * tiles_n + blocks * w_block
        head += f", {blocks:.0f} blocks x {tiles_n} column tiles; copies {copied / 1e9:.2f} GB per call"
        if "copies only" in result:
            head += f", {copied / result['copies only'] / 1e6:.2f} TB/s in 'copies only'"
    print(head + "):", flush=True)
    for name, t in result.items():
        print(f"    {name:30s} {t:10.2f} us  {floor_us / t:5.2f}  {t / result['as shipped']:5.3f}", flush=True)
    return dict(model=model, phase=phase, m=m, config=cfg.spec, floor_us=floor_us, copied_bytes=copied,
                times_us=result)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(BENCHMARK_MODELS))
    ap.add_argument("--phases", default="gate_up,down")
    ap.add_argument("--m", default="1024,4096", help="token counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="timings of each build per row (alternating order)")
    ap.add_argument("--variants", help="comma-separated variant names to time besides the shipped build "
                                       "(default: every variant of the row's kernel)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    try:
        models = [get_model(name).name for name in args.models.split(",")]
        ms = [int(v) for v in args.m.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    phases = args.phases.split(",")
    if any(p not in ("gate_up", "down") for p in phases):
        ap.error(f"--phases: expected gate_up and/or down, comma-separated, got {args.phases!r}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive int, got {args.rounds}")
    known = {name for _, variants in VARIANTS.values() for name in variants}
    only = None if args.variants is None else set(args.variants.split(","))
    if only is not None and not only <= known:
        ap.error(f"--variants: expected names among {sorted(known)}, got {sorted(only - known)}")
    import cupy as cp
    gpu = configs.gpu_info()
    if not gpu.hopper:
        sys.exit(f"{gpu.name}: the tc variants remove statements of the wgmma path, and the swapped kernel runs on "
                 "sm_90a only")
    copy_bw, mm_rate = copy_bandwidth(), matmul_rate()
    print(f"# {gpu.name}, copy {copy_bw / 1e12:.2f} TB/s, cupy.matmul fp16 8192^3 {mm_rate / 1e12:.0f} TFLOP/s; "
          "per build: time, floor / time (tc rows: the FLOP floor; decode rows: the traffic floor; swapped rows: "
          "the larger), time / the shipped build's")
    out = []
    for model in models:
        for phase in phases:
            for m in ms:
                r = row(model, phase, m, copy_bw, mm_rate, args.rounds, gpu, only)
                cp.get_default_memory_pool().free_all_blocks()
                if r is not None:
                    out.append(r)
    if args.json:
        args.json.write_text(json.dumps(dict(gpu=gpu.name, copy_bw=copy_bw, mm_rate=mm_rate, rows=out), indent=1))


if __name__ == "__main__":
    main()
