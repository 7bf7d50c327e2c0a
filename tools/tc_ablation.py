"""What limits the prefill kernel (`moe_gemm_tc`): the same launch timed with parts of its main loop compiled out.

    python tools/tc_ablation.py [--models Mixtral-8x7B,...] [--phases gate_up,down] [--m 1024,4096] [--json FILE]

Per row (model, phase, M; 4-bit weights, G = 128, real zero points, fp16, uniform routing, the configuration
`choose_config` gives) the tc kernel is compiled once as it ships and once per variant below, with the named
statements removed from kernels/moe_gemm_prefill.cu before NVRTC sees it, and every build is timed on the same
inputs (CUDA graph of 4 calls over 4 routings, median replay, the builds interleaved over --rounds rounds). The
variants compute garbage; only their times mean something:

- no dequant: the raw words are copied but never dequantized (wgmma reads whatever the B tiles hold);
- no dequant, no weight copies: as above, and the raw qweight rows are not copied either;
- skeleton: no dequantization and no copies at all: barriers, wgmma and the epilogue;
- no wgmma: copies and dequantization, no tensor work;
- copies only: no wgmma and no dequantization;
- no proxy fence: as shipped but without the fence.proxy.async each thread runs before the barrier that hands a stage
  to wgmma (what the fence itself costs; without it wgmma may read a tile before it is visible to it).

Each time is printed with the row's FLOP floor (FLOPs over the fp16 matmul rate measured here) over it. The row's
header gives the bytes its CTAs copy from L2 into shared memory per call: every row of a block once per column tile
(K * 2 bytes each) and the expert's packed weights once per block, with the group's scales and zero words again
at every 32-k step; "copies only" moves exactly those bytes (and stores the outputs), so its time gives the rate at
which the CTAs' copies stream. Rows whose configuration is not the tc kernel (16-row blocks) are skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from cupy_moe import _compile, configs
from cupy_moe.align import moe_align_block_size
from cupy_moe.gemm import fused_moe_gemm
from cupy_moe.models import BENCHMARK_MODELS, get_model
from cupy_moe.timing import graph_time, matmul_rate
from cupy_moe.weights import StackedGptqWeight

BITS, G, SETS = 4, 128, 4
SOURCE = "moe_gemm_prefill.cu"
# statements of the tc kernel's main loop that a variant removes (each must occur in the source)
DEQUANT = ("if (it + 1 < nsteps) dequant(rd1, (it + 1) & 1);", "if (nsteps > 0) dequant(0, 0);")
WEIGHT_COPIES = ("gptq::cp_async16(st + L::kA + (tid + i * THREADS) * 16, q_src[i], true);",)
OTHER_COPIES = ("gptq::cp_async16(st + a_dst + i * (THREADS / 4) * 64, in ? a_src[i] : a, in && a_ok[i]);",
                "if (x_do) gptq::cp_async16(st + x_dst, in ? x_src : reinterpret_cast<const unsigned char*>(qweight), "
                "in);")
WGMMA = ("gptq::wgmma_m64k16<kBf16, WTN>(acc[0], gptq::wg_desc_sw64_at(a_desc0 + (ka >> 4)),\n"
         "                                       gptq::wg_desc_sw64_at(b_desc0 + (kb >> 4)));",)
FENCE = ("if constexpr (kWg) gptq::fence_proxy_async_smem();  // this thread's A copies and B stores -> wgmma reads",)
VARIANTS = {"as shipped": (), "no dequant": DEQUANT, "no dequant, no weight copies": DEQUANT + WEIGHT_COPIES,
            "skeleton": DEQUANT + WEIGHT_COPIES + OTHER_COPIES, "no wgmma": WGMMA, "copies only": WGMMA + DEQUANT,
            "no proxy fence": FENCE}

_shipped_source = _compile._source


def use_variant(removed: tuple[str, ...]) -> None:
    """Make the next compile of the tc kernel drop `removed` (and forget the kernels compiled so far)."""
    def source(filename: str) -> str:
        text = _shipped_source(filename)
        if filename == SOURCE:
            for statement in removed:
                if statement not in text:
                    sys.exit(f"{SOURCE} no longer contains {statement!r}: update this tool's statement lists")
                text = text.replace(statement, "")
        return text
    _compile._source = source
    _compile._module.cache_clear()
    _compile._kernel.cache_clear()


def row(model: str, phase: str, m: int, rate: float, rounds: int, gpu) -> dict | None:
    import cupy as cp
    shape = get_model(model)
    e, top_k_model = shape.num_experts, shape.top_k
    k, n, top_k = shape.phases()[phase]
    rows = m if phase == "gate_up" else m * top_k_model
    pairs = rows * top_k
    cfg = configs.choose_config(rows, e, top_k, k, n, BITS, G, gpu=gpu)
    if cfg.kind != "tc":
        print(f"{model} {phase} M = {m}: {cfg.spec}, not the tc kernel: skipped", flush=True)
        return None
    rng = np.random.default_rng(m + len(model))
    w = StackedGptqWeight.random(e, k, n, bits=BITS, group_size=G, seed=3)
    sets, blocks = [], []
    for _ in range(SETS):
        ids = np.stack([rng.permutation(e)[:top_k_model] for _ in range(m)]).astype(np.int32)
        ids = ids.reshape(pairs, 1) if phase == "down" else ids
        x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float16))
        s, eid, post = moe_align_block_size(cp.asarray(ids), cfg.block_m, e)
        blocks.append(int(post[0]) // cfg.block_m)
        sets.append((x, s, eid, post, cp.empty((pairs, n), cp.float16)))

    def call(i):
        x, s, eid, post, out = sets[i]
        fused_moe_gemm(x, w, s, eid, post, top_k, out=out, config=cfg)

    times = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in (VARIANTS if r % 2 == 0 else reversed(VARIANTS)):
            use_variant(VARIANTS[name])
            times[name].append(graph_time([lambda i=i: call(i) for i in range(SETS)], reps=8, warmup=2))
    use_variant(())
    result = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    flop_us = 2.0 * pairs * k * n / rate * 1e6
    tiles_n = -(-n // cfg.block_n)
    w_block = (k // 32) * n * (32 * BITS / 8 + 2 + BITS / 8)  # per 32-k step: the words, the scales, the zeros
    copied = pairs * k * 2 * tiles_n + float(np.mean(blocks)) * w_block
    print(f"{model} {phase} M = {m} ({cfg.spec}, {np.mean(blocks):.0f} blocks x {tiles_n} column tiles; "
          f"copies {copied / 1e9:.2f} GB per call, {copied / result['copies only'] / 1e6:.2f} TB/s in 'copies only'):",
          flush=True)
    for name, t in result.items():
        print(f"    {name:30s} {t:10.1f} us  {flop_us / t:5.2f}", flush=True)
    return dict(model=model, phase=phase, m=m, config=cfg.spec, flop_floor_us=flop_us, copied_bytes=copied,
                times_us=result)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(BENCHMARK_MODELS))
    ap.add_argument("--phases", default="gate_up,down")
    ap.add_argument("--m", default="1024,4096", help="token counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="timings of each build per row (alternating order)")
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
    import cupy as cp
    gpu = configs.gpu_info()
    if not gpu.hopper:
        sys.exit(f"{gpu.name}: the variants remove statements of the wgmma path, which runs on sm_90a only")
    rate = matmul_rate()
    print(f"# {gpu.name}, cupy.matmul fp16 8192^3 {rate / 1e12:.0f} TFLOP/s; per build: time, FLOP floor / time")
    out = []
    for model in models:
        for phase in phases:
            for m in ms:
                r = row(model, phase, m, rate, args.rounds, gpu)
                cp.get_default_memory_pool().free_all_blocks()
                if r is not None:
                    out.append(r)
    if args.json:
        args.json.write_text(json.dumps(dict(gpu=gpu.name, mm_rate=rate, rows=out), indent=1))


if __name__ == "__main__":
    main()
