"""Random but valid stacked GPTQ weights on the host, for the GPU tests of the GEMM and the layer."""
import numpy as np

from cupy_moe import reference
from cupy_moe.weights import StackedGptqWeight


def make_weight(rng, e, k, n, bits, group_size, sym, act_order):
    """Random but valid stacked GPTQ tensors (host). Any int32 is a valid word of codes."""
    glen = k if group_size == -1 else group_size
    groups = -(-k // glen)
    qweight = rng.integers(-2**31, 2**31, size=(e, k * bits // 32, n), dtype=np.int64).astype(np.int32)
    # scale so that outputs are O(1): |q - z| ~ 2^bits / 2.5, sum over K of N(0,1) activations
    scales = (rng.uniform(0.5, 1.5, size=(e, groups, n)) * 4.0 / (2**bits * np.sqrt(k))).astype(np.float16)
    qzeros = None if sym else rng.integers(-2**31, 2**31, size=(e, groups, n * bits // 32),
                                           dtype=np.int64).astype(np.int32)
    g_idx = None
    if act_order:
        g_idx = np.stack([reference.act_order_g_idx(k, glen, rng) for _ in range(e)]).astype(np.int32)
    return StackedGptqWeight(qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size)
