"""PyTorch (or JAX) tensors in, without a copy: DLPack hands CuPy the same device memory.

    python examples/dlpack_interop.py
Needs PyTorch with CUDA and a GPU; says so and exits 0 otherwise (so CI can run it on a CPU machine).
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
    print("skipped: this example needs PyTorch with CUDA and a GPU")
    sys.exit(0)

import cupy as cp

with tempfile.TemporaryDirectory() as folder:
    write_checkpoint(folder, family="qwen3_moe", hidden=512, intermediate=768, num_experts=16, top_k=4,
                     group_size=128, return_weights=False)
    layer = cupy_moe.load_moe_layer(folder, 0)
    xt = torch.randn(8, 512, device="cuda", dtype=torch.float16)   # a PyTorch activation [M, H]
    x = cp.from_dlpack(xt)                                         # same memory, no copy
    assert x.data.ptr == xt.data_ptr()
    yt = torch.from_dlpack(layer(x))                               # back to PyTorch, no copy either
    print("output", tuple(yt.shape), yt.dtype, "on", yt.device)
