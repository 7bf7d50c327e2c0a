"""PyTorch (or JAX) tensors in, without a copy: DLPack hands CuPy the same device memory.

    python examples/dlpack_interop.py
Needs PyTorch with CUDA and a CUDA GPU. Without them it prints one line, "skipped: ...", and exits 0 (so CI can run
it on a CPU machine); with them it exits non-zero when a step fails, and its last line is "zero-copy round trip: OK".
"""
import sys
import tempfile

import cupy_moe
from cupy_moe.testing import write_checkpoint

try:
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available() or not cupy_moe.gpu_available():
    print("skipped: this example needs PyTorch with CUDA and a CUDA GPU")
    sys.exit(0)

import cupy as cp


def require(ok, what):
    if not ok:
        raise SystemExit(f"FAILED: {what}")


with tempfile.TemporaryDirectory() as folder:
    write_checkpoint(folder, family="qwen3_moe", hidden=512, intermediate=768, num_experts=16, top_k=4,
                     group_size=128, return_weights=False)
    layer = cupy_moe.load_moe_layer(folder, 0)
    xt = torch.randn(8, 512, device="cuda", dtype=torch.float16)   # a PyTorch activation [M, H]
    x = cp.from_dlpack(xt)                                         # same memory, no copy
    require(x.data.ptr == xt.data_ptr(), "CuPy's view of the PyTorch tensor is a copy")
    y = layer(x)
    yt = torch.from_dlpack(y)                                      # back to PyTorch, no copy either
    require(yt.data_ptr() == y.data.ptr, "PyTorch's view of the output is a copy")
    require(tuple(yt.shape) == (8, 512) and yt.dtype == torch.float16, f"output {tuple(yt.shape)} {yt.dtype}")
    expected = layer(cp.asarray(xt.cpu().numpy()))                 # the same layer on a CuPy copy of the input
    require(bool(cp.array_equal(y, expected)), "the output differs from the layer on a copy of the input")
    print("output", tuple(yt.shape), yt.dtype, "on", yt.device)
    print("zero-copy round trip: OK")
