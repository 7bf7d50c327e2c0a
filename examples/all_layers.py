"""Research-style script: load every MoE layer of a checkpoint and push a batch through them, timing each.

    python examples/all_layers.py [CHECKPOINT_FOLDER] [--tokens M]
Without a folder it writes a small synthetic Qwen2-MoE checkpoint (3 layers) first. On the GPU the timing uses
CUDA events; on the CPU it times the NumPy reference path.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import cupy_moe
from cupy_moe.testing import write_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("folder", nargs="?")
parser.add_argument("--tokens", type=int, default=16)
args = parser.parse_args()
if args.tokens < 1:
    parser.error(f"argument --tokens: expected a whole number >= 1, got {args.tokens}")
if args.folder is not None and not Path(args.folder).is_dir():
    print(f"all_layers.py: error: {args.folder}: expected a checkpoint folder, "
          f"{'got a file' if Path(args.folder).exists() else 'no such folder'}", file=sys.stderr)
    sys.exit(2)

with tempfile.TemporaryDirectory() as tmp:
    folder = args.folder
    if folder is None:
        folder = tmp
        write_checkpoint(folder, family="qwen2_moe", num_layers=3, hidden=256, intermediate=512, num_experts=16,
                         top_k=4, group_size=64, return_weights=False)
    print(cupy_moe.inspect_checkpoint(folder)["family"], "checkpoint at", folder)
    on_gpu = cupy_moe.gpu_available()
    layers = cupy_moe.load_moe_model(folder, device=on_gpu)        # {layer index: MoELayer}; progress on a tty
    hidden_size = next(iter(layers.values())).weights.hidden_size
    x = np.random.default_rng(0).standard_normal((args.tokens, hidden_size)).astype(np.float16)
    if on_gpu:
        import cupy as cp
        x = cp.asarray(x)
    for index, layer in layers.items():
        if on_gpu:
            from cupy_moe.timing import event_time
            ms = event_time(lambda i: layer(x), reps=5) * 1e3  # median of 5 after warm-up (which compiles once)
            y = layer(x)
        else:
            t0 = time.perf_counter()
            y = layer(x)
            ms = (time.perf_counter() - t0) * 1e3
        print(f"layer {index}: {layer.weights.num_experts} experts, top-{layer.weights.top_k}, "
              f"{layer.weights.nbytes / 2**20:.1f} MiB, {ms:.2f} ms for {args.tokens} tokens")
        x = (x + y).astype(np.float16)  # residual stream into the next layer
    print("final hidden state norm:", float((x.astype(np.float32) ** 2).sum() ** 0.5))
