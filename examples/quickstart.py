"""Quickstart: a synthetic GPTQ MoE checkpoint -> one layer -> its output, checked against the reference.

Runs on the GPU when CuPy finds one, else through the NumPy reference path (same API, same results).
    python examples/quickstart.py
"""
import tempfile

import numpy as np

import cupy_moe
from cupy_moe.testing import dense_layer_output, write_checkpoint

H, I, E, A = 512, 1024, 8, 2  # hidden, expert intermediate, experts, top-k

with tempfile.TemporaryDirectory() as folder:
    # A genuine GPTQ v1 checkpoint (Mixtral naming, 4-bit, group size 128, act-order) written by our quantizer.
    write_checkpoint(folder, family="mixtral", hidden=H, intermediate=I, num_experts=E, top_k=A,
                     group_size=128, desc_act=True, return_weights=False)
    on_gpu = cupy_moe.gpu_available()
    layer = cupy_moe.load_moe_layer(folder, 0, device=on_gpu)
    host_layer = layer if not on_gpu else cupy_moe.load_moe_layer(folder, 0, device=False)

    x = np.random.default_rng(0).standard_normal((4, H)).astype(np.float16)   # hidden states [M, H]
    if on_gpu:
        import cupy as cp
        y = cp.asnumpy(layer(cp.asarray(x)))                                    # [M, H] float16
    else:
        y = layer(x)

    ref = dense_layer_output(host_layer, x)                                    # float64 loops, dequantized
    err = np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
    print(f"{'GPU' if on_gpu else 'NumPy'} path: output {y.shape} {y.dtype}, relative L2 error vs float64 {err:.1e}")
    if not err < 1e-3:  # an explicit check, so `python -O` checks too
        raise SystemExit(f"FAILED: relative L2 error {err:.1e} is above 1e-3")
