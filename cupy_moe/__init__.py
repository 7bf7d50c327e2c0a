"""cupy_moe: Mixture-of-Experts layers from GPTQ checkpoints on the GPU, in CuPy.

NumPy inputs run the plain reference (`cupy_moe.reference`); CuPy inputs run the fused CUDA kernels.
Shape letters: M tokens, K in-features, N out-features, E experts, A top-k, G group size, H hidden,
I expert intermediate size, P = M * A (token, expert) pairs.
"""
from . import reference
from .align import moe_align_block_size
from .checkpoint import inspect_checkpoint
from .gemm import SplitKWorkspace, fused_moe_gemm
from .layer import (MoELayer, MoEPlan, fused_moe, load_moe_layer, load_moe_model, plan_moe, route_experts,
                    select_experts)
from .weights import StackedGptqWeight
from ._xp import gpu_available

__version__ = "0.1.0"

__all__ = [
    "StackedGptqWeight",
    "moe_align_block_size",
    "fused_moe_gemm",
    "SplitKWorkspace",
    "fused_moe",
    "plan_moe",
    "MoEPlan",
    "select_experts",
    "route_experts",
    "MoELayer",
    "load_moe_layer",
    "load_moe_model",
    "inspect_checkpoint",
    "gpu_available",
    "reference",
]
