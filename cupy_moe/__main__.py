"""Command line: `python -m cupy_moe demo | inspect PATH | bench | tune`."""
from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Layer shapes for the demo (SHAPES.md): hidden H, intermediate I, experts E, top-k A, group size G.
MODELS = {
    "tiny": dict(family="qwen2_moe", hidden=256, intermediate=384, num_experts=8, top_k=2, group_size=64),
    "mixtral-8x7b": dict(family="mixtral", hidden=4096, intermediate=14336, num_experts=8, top_k=2, group_size=128),
    "qwen1.5-moe-a2.7b": dict(family="qwen2_moe", hidden=2048, intermediate=1408, num_experts=60, top_k=4,
                              group_size=128, shared_intermediate=5632),
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden=2048, intermediate=768, num_experts=128, top_k=8, group_size=128),
    "deepseek-v2-lite": dict(family="deepseek_v2", hidden=2048, intermediate=1408, num_experts=64, top_k=6,
                             group_size=128),
}


def _rel_l2(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _demo_cpu(args, folder):
    from . import MoELayer
    from .testing import dense_layer_output, write_checkpoint
    spec = MODELS["tiny"] if args.model is None else MODELS[args.model]
    t0 = time.perf_counter()
    write_checkpoint(folder, num_layers=1, return_weights=False, seed=args.seed, **spec)
    layer = MoELayer.from_checkpoint(folder, 0, device=False)
    x = np.random.default_rng(args.seed).standard_normal((args.tokens, spec["hidden"])).astype(np.float16)
    y = layer(x)
    err = _rel_l2(y, dense_layer_output(layer, x))
    print(f"model {args.model or 'tiny'} ({spec['family']}): H={spec['hidden']} I={spec['intermediate']} "
          f"E={spec['num_experts']} A={spec['top_k']} G={spec['group_size']}, {args.tokens} tokens, NumPy path")
    print(f"check: relative L2 error vs dense float64 on dequantized weights = {err:.2e} (bar 1e-3)")
    print(f"took {time.perf_counter() - t0:.1f} s. No CUDA GPU here: the GPU path needs one "
          "(install with the cuda12 or cuda13 extra on a machine with an NVIDIA GPU).")
    return 0 if err <= 1e-3 else 1


def _copy_bandwidth(cp) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = cp.ones(1 << 28, cp.uint8)
    dst = cp.empty_like(src)
    times = _time_events(cp, lambda: cp.copyto(dst, src), reps=20)
    return 2 * src.nbytes / times


def _time_events(cp, fn, reps=50, warmup=5, stream=None) -> float:
    """Median seconds of fn() measured with CUDA events on `stream` (default: the current one) after warm-up."""
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(reps):
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(samples))


def _demo_gpu(args, folder):
    import cupy as cp
    from . import MoELayer
    from .testing import write_checkpoint
    name = args.model or "mixtral-8x7b"
    spec = MODELS[name]
    t0 = time.perf_counter()
    write_checkpoint(folder, num_layers=1, return_weights=False, seed=args.seed, **spec)
    t_write = time.perf_counter() - t0
    layer = MoELayer.from_checkpoint(folder, 0, device=True)
    w = layer.weights
    print(f"model {name} ({spec['family']}): H={w.hidden_size} I={w.intermediate_size} E={w.num_experts} "
          f"A={w.top_k} G={spec['group_size']}, packed layer {w.nbytes / 2**20:.0f} MiB "
          f"(checkpoint written in {t_write:.1f} s)")

    rng = np.random.default_rng(args.seed)
    x_host = rng.standard_normal((args.tokens, w.hidden_size)).astype(np.float16)
    x = cp.asarray(x_host)
    y = layer(x)

    # Check a few tokens against the NumPy reference (it dequantizes every touched expert in float64).
    check = min(args.tokens, 2)
    host_layer = MoELayer.from_checkpoint(folder, 0, device=False)
    ref = host_layer(x_host[:check])
    err = _rel_l2(cp.asnumpy(y[:check]), ref)
    print(f"check: {check} tokens vs the NumPy reference, relative L2 error = {err:.2e} (bar 1e-3)")

    captured = layer.capture(x)
    seconds = _time_events(cp, captured.replay, reps=args.reps, stream=captured.stream)
    _, ids = layer.route(x)
    touched = int(cp.unique(ids).size)
    expert_bytes = (w.w13.nbytes + w.w2.nbytes) / w.num_experts
    shared_bytes = 0 if w.shared is None else sum(
        getattr(p, "nbytes", 0) for p in (w.shared.gate_up, w.shared.down))
    floor_bytes = touched * expert_bytes + shared_bytes + 2 * x.nbytes
    bw = _copy_bandwidth(cp)
    floor = floor_bytes / bw
    print(f"time per layer, {args.tokens} tokens, CUDA graph replay, median of {args.reps}: {seconds * 1e6:.1f} us; "
          f"memory floor {floor * 1e6:.1f} us ({touched} experts touched, {floor_bytes / 2**20:.0f} MiB at "
          f"{bw / 1e12:.2f} TB/s copy bandwidth): {floor / seconds:.0%} of the floor")
    return 0 if err <= 1e-3 else 1


def demo(args) -> int:
    from ._xp import gpu_available
    with tempfile.TemporaryDirectory(prefix="cupy_moe_demo_") as tmp:
        folder = Path(args.dir) if args.dir else Path(tmp)
        print(f"writing a synthetic GPTQ MoE checkpoint to {folder}")
        if gpu_available() and not args.cpu:
            return _demo_gpu(args, folder)
        return _demo_cpu(args, folder)


def inspect(args) -> int:
    from .checkpoint import inspect_checkpoint
    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    q = info["quantization"]
    print(f"{info['path']}: {info['family']} ({info.get('model_type')}), {info['num_layers']} layers, "
          f"{len(info['moe_layers'])} MoE layers, E={info['num_experts']} A={info['top_k']} "
          f"H={info['hidden_size']} I={info['intermediate_size']}")
    print(f"quantization: {q['method']} bits={q['bits']} group_size={q['group_size']} sym={q['sym']} "
          f"desc_act={q['desc_act']} format={q['checkpoint_format']} (from {q['source']})")
    print(f"files: {len(info['files'])}, {info['total_bytes'] / 2**20:.1f} MiB")
    for row in info["layers"]:
        print(f"  layer {row['layer']}: {row['experts_found']} experts ({row['experts']}), "
              f"{row['expert_bytes'] / 2**20:.2f} MiB packed, shared experts: {row['shared_experts']}")
    for layer, why in info.get("dense_layers", {}).items():
        print(f"  layer {layer}: dense ({why})")
    for problem in info.get("problems", []):
        print(f"  problem: {problem}")
    return 1 if info.get("problems") else 0


def bench(args) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gemm.py"
    if not script.is_file():
        print("python -m cupy_moe bench runs benchmarks/bench_gemm.py from a checkout of cupy_moe; "
              f"{script} is not there", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def tune(args) -> int:
    from .tune import tune as run_tune
    models = args.models.split(",") if args.models else None
    run_tune(models, tuple(int(v) for v in args.m.split(",")), reps=args.reps, save=not args.dry_run)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="write a synthetic GPTQ MoE checkpoint, run one layer, check it, time it")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="layer shapes (default: mixtral-8x7b on a GPU, tiny on the CPU)")
    p.add_argument("--tokens", type=int, default=8, help="tokens M in the batch (default 8)")
    p.add_argument("--reps", type=int, default=50, help="timed graph replays (default 50)")
    p.add_argument("--dir", help="keep the checkpoint in this folder instead of a temporary one")
    p.add_argument("--cpu", action="store_true", help="run the NumPy path even when a GPU is present")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    p = sub.add_parser("inspect", help="describe a checkpoint from its configs and headers (no tensor data)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the full description as JSON")
    p.set_defaults(func=inspect)
    p = sub.add_parser("bench", help="run benchmarks/bench_gemm.py (arguments after -- go to it)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=bench)
    p = sub.add_parser("tune", help="time GEMM configurations on this GPU and keep the fastest per problem in its "
                                    "tuned table")
    p.add_argument("--models", help="comma-separated names of cupy_moe.models, any case (default: the benchmark models)")
    p.add_argument("--m", default="1,4,16,64,256,1024,4096", help="token counts M (default 1,4,16,64,256,1024,4096)")
    p.add_argument("--reps", type=int, default=10, help="calls per timing round (default 10)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, but do not write the table")
    p.set_defaults(func=tune)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
