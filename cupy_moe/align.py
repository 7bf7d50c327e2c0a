"""moe_align_block_size: group (token, expert) pairs by expert, padded per expert to a multiple of B.

NumPy input runs `cupy_moe.reference.moe_align_block_size`; CuPy input runs `kernels/moe_align.cu` with the same
outputs bit for bit and no host synchronization (`num_tokens_post_padded` stays on the device).
"""
from __future__ import annotations

import numpy as np

from . import _compile
from ._xp import check_input, is_device_array, require_gpu

__all__ = ["moe_align_block_size", "align_capacity", "MAX_EXPERTS", "MAX_PAIRS"]

MAX_EXPERTS = 1024        # one shared-memory counter per expert and warp
MAX_PAIRS = 1 << 26       # pair ids and positions stay far inside int32 (C <= P + E*(B-1))
MAX_BLOCK_SIZE = 1024
_FUSED_MAX_PAIRS = 8192   # up to here one CTA does everything in one launch (decode)
_FUSED_SMEM_INTS = 11 * 1024  # <= 44 KiB: warp-private counters of the fused kernel stay under the 48 KiB default
_FUSED_MIN_WARPS = 8      # the fused kernel's per-expert work is spread over at least this many warps
_CHUNKS_MAX = 1024        # the scan kernel walks the chunks serially: keep them few
_WARPS_PER_CTA = 8

_FILE = "moe_align.cu"
# every instance of that file the launcher asks for (the compile test and tools/sass_digest.py compile them all)
KERNEL_NAMES = ([f"moe_align_{kind}<{t}>" for kind in ("fused", "count", "scatter") for t in ("int", "long long")]
                + ["moe_align_scan"])


def align_capacity(num_pairs: int, block_size: int, num_experts: int) -> int:
    """C = (P + min(E, P) * (B - 1)) // B * B: the most rows any routing of P pairs over E experts needs."""
    return (num_pairs + min(num_experts, num_pairs) * (block_size - 1)) // block_size * block_size


def _check_int(name, v, lo, hi):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v}")
    return v


def moe_align_block_size(topk_ids, block_size, num_experts):
    """Sort (token, expert) pairs by expert and pad each expert's run to a multiple of B.

    topk_ids: int32 or int64 [M, A], expert of each (token, slot), values in [0, E). NumPy -> reference; CuPy -> GPU.
    block_size: B (the GEMM's block_m, see `cupy_moe.configs.choose_config`). num_experts: E <= 1024.
    Pair p = token * A + slot, P = M * A <= 2**26. Returns (on the device for CuPy input)
        sorted_token_ids: int32 [C], pairs grouped by expert ascending, ascending p inside an expert,
                          the sentinel P in every padding slot; C = (P + min(E, P) * (B - 1)) // B * B;
        expert_ids: int32 [C/B], expert of each block of B rows, -1 for blocks past the padded total;
        num_tokens_post_padded: int32 [1], the padded total T (a multiple of B, T <= C).

    Worked example: M=3, A=2, E=4, B=4, topk_ids = [[1, 3], [1, 0], [3, 1]]: P = 6 (sentinel 6), pairs 0..5 go to
    experts [1, 3, 1, 0, 3, 1], C = (6 + 4*3) // 4 * 4 = 16:
        sorted_token_ids = [3, 6, 6, 6,  0, 2, 5, 6,  1, 4, 6, 6,  6, 6, 6, 6]
        expert_ids = [0, 1, 3, -1], num_tokens_post_padded = [12]
    B <= 1024 and the limits above hold on both paths. On the GPU, ids outside [0, E) are skipped (checking them
    would need a host sync); the reference raises.
    """
    check_input("topk_ids", topk_ids, ("int32", "int64"), "[M, A]")
    # the kernels' limits, on both paths (a NumPy script moves over unchanged)
    b = _check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
    e = _check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    p = topk_ids.size
    if p > MAX_PAIRS:
        raise ValueError(f"topk_ids: expected M*A <= {MAX_PAIRS} pairs (2**26), got {p} = {topk_ids.shape}")
    if not is_device_array(topk_ids):
        from . import reference
        return reference.moe_align_block_size(topk_ids, b, e)
    cp = require_gpu("moe_align_block_size on CuPy arrays")
    ids = cp.ascontiguousarray(topk_ids)
    capacity = align_capacity(p, b, e)
    # allocate
    sorted_ids = cp.empty(capacity, cp.int32)
    expert_ids = cp.empty(capacity // b, cp.int32)
    post_padded = cp.empty(1, cp.int32)
    if p == 0:
        post_padded.fill(0)
        return sorted_ids, expert_ids, post_padded
    # launch
    idt = "int" if ids.dtype == np.int32 else "long long"
    i32 = np.int32
    if p <= _FUSED_MAX_PAIRS:
        walkers = max(1, min(32, (_FUSED_SMEM_INTS - 2 * (e + 1) - 32) // e, -(-p // 32)))
        smem = 4 * (walkers * e + 2 * (e + 1) + 32)
        _compile.launch(_compile.get_kernel(_FILE, f"moe_align_fused<{idt}>"), (1,),
                        (32 * max(walkers, _FUSED_MIN_WARPS),),
                        (ids, i32(p), i32(e), i32(b), i32(capacity), sorted_ids, expert_ids, post_padded,
                         i32(walkers)), smem)
        return sorted_ids, expert_ids, post_padded
    num_chunks = min(_CHUNKS_MAX, -(-p // 1024))
    chunk = -(-p // num_chunks)
    num_chunks = -(-p // chunk)
    counts = cp.empty((num_chunks, e), cp.int32)  # [chunks, E] scratch, pooled by CuPy
    grid = (-(-num_chunks // _WARPS_PER_CTA),)
    threads = (32 * _WARPS_PER_CTA,)
    smem_w = 4 * _WARPS_PER_CTA * e
    _compile.launch(_compile.get_kernel(_FILE, f"moe_align_count<{idt}>"), grid, threads,
                    (ids, i32(p), i32(e), i32(chunk), i32(num_chunks), counts), smem_w)
    _compile.launch(_compile.get_kernel(_FILE, "moe_align_scan"), (1,), (1024,),
                    (counts, i32(p), i32(e), i32(num_chunks), i32(b), i32(capacity), sorted_ids, expert_ids,
                     post_padded), 4 * (2 * (e + 1) + 32))
    _compile.launch(_compile.get_kernel(_FILE, f"moe_align_scatter<{idt}>"), grid, threads,
                    (ids, i32(p), i32(e), i32(chunk), i32(num_chunks), counts, sorted_ids), smem_w)
    return sorted_ids, expert_ids, post_padded
