"""Run one MoE layer of a checkpoint folder (GPTQ, AWQ or compressed-tensors) and check it on a few tokens.

    python examples/run_checkpoint.py FOLDER [--layer L] [--tokens M]

FOLDER is a downloaded checkpoint, e.g. `hf download REPO --local-dir FOLDER` (docs/checkpoints.md lists what
loads). On a machine with a CUDA GPU the layer runs on the GPU and is compared with the NumPy reference path;
without one it runs the NumPy path and is compared with plain float64 loops over the dequantized weights.
Without FOLDER it writes a small synthetic checkpoint with cupy_moe.testing and runs that.
Exit status: 0 when the output is within the bar (or the check is skipped, with a line saying why), 1 when
not, 2 when the folder cannot be loaded.
"""
import argparse
import sys
import tempfile
import time

import numpy as np

import cupy_moe
from cupy_moe.checkpoint import inspect_checkpoint
from cupy_moe.testing import dense_layer_output, write_checkpoint

BAR = 1e-3  # relative L2 error of a float16 layer against its reference (tests/tolerances.py explains it)
LOOP_CHECK_LIMIT = 2 << 30  # bytes of float64 weights the loop check may dequantize


def rel_l2(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def run(folder, layer_index, tokens, seed) -> int:
    try:
        info = inspect_checkpoint(folder)
    except (FileNotFoundError, ValueError) as exc:
        print(f"cannot load: {exc}", file=sys.stderr)
        return 2
    for problem in info["problems"]:
        print(f"problem: {problem}", file=sys.stderr)
    if not info["moe_layers"]:
        print(f"cannot load: {folder}: no MoE layer found", file=sys.stderr)
        return 2
    layer_index = info["moe_layers"][0] if layer_index is None else layer_index
    q, r = info["quantization"], info["routing"]
    print(f"{info['path']}: {info['family']} ({info['naming'] or 'default'} naming), {q['method']} "
          f"{q['bits']}-bit group {q['group_size']}{'' if q['sym'] else ' asym'}, E={info['num_experts']} "
          f"A={r['top_k']['value']} H={info['hidden_size']} I={info['intermediate_size']}")
    print("routing: " + ", ".join(f"{k}={v['value']} ({v['source']})" for k, v in r.items()
                                  if k != "hidden_act" and v["value"] is not None))

    on_gpu = cupy_moe.gpu_available() and q["bits"] in (4, 8)
    t0 = time.perf_counter()
    try:
        host = cupy_moe.load_moe_layer(folder, layer_index, device=False)
        layer = cupy_moe.load_moe_layer(folder, layer_index, device=True) if on_gpu else host
    except (FileNotFoundError, ValueError) as exc:
        print(f"cannot load layer {layer_index}: {exc}", file=sys.stderr)
        return 2
    w = host.weights
    print(f"layer {layer_index}: {w.num_experts} experts, {w.nbytes / 2**20:.1f} MiB as loaded, "
          f"{time.perf_counter() - t0:.2f} s to load")

    x = np.random.default_rng(seed).standard_normal((tokens, w.hidden_size)).astype(np.float16)
    if on_gpu:
        import cupy as cp
        y = cp.asnumpy(layer(cp.asarray(x)))
        ref, against = host(x), "the NumPy reference path"
    else:
        y = host(x)
        used = len(np.unique(host.route(x)[1])) + (w.shared is not None)
        need = used * 3 * w.hidden_size * w.intermediate_size * 8
        if need > LOOP_CHECK_LIMIT:
            print(f"NumPy path: y {y.shape} {y.dtype}; the float64 loop check would dequantize "
                  f"{need / 2**30:.1f} GiB, skipped (run on a GPU to compare the two paths)")
            return 0
        ref, against = dense_layer_output(host, x), "float64 loops over the dequantized weights"
    err = rel_l2(y, ref)
    ok = np.isfinite(err) and err <= BAR
    print(f"{'GPU' if on_gpu else 'NumPy'} path: y {y.shape} {y.dtype}, relative L2 error vs {against} "
          f"{err:.2e} (bar {BAR:g}): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", help="checkpoint folder (default: a synthetic one)")
    p.add_argument("--layer", type=int, default=None, help="decoder layer (default: the first MoE layer)")
    p.add_argument("--tokens", type=positive_int, default=4, help="tokens M of the random input (default 4)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.folder is not None:
        return run(args.folder, args.layer, args.tokens, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        print("no FOLDER given: running on a synthetic Qwen2-MoE checkpoint written by cupy_moe.testing")
        write_checkpoint(folder, family="qwen2_moe", hidden=256, intermediate=384, num_experts=8, top_k=2,
                         group_size=64, return_weights=False)
        return run(folder, args.layer, args.tokens, args.seed)


if __name__ == "__main__":
    sys.exit(main())
