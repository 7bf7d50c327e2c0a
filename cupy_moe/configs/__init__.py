"""The GEMM configuration of a problem, as data: what exists (catalogue), the target GPU (gpu), the measured
tables (tuned) and the rules that choose (heuristic).

    plan = choose_config(m, e, a, k, n, bits, group_size)   # a GemmConfig: exactly what one launch runs
    sorted_ids, expert_ids, post = moe_align_block_size(topk_ids, plan.block_m, e)
    fused_moe_gemm(a, weight, sorted_ids, expert_ids, post, top_k, config=plan)
"""
from .catalogue import (ACT_ORDER_SHAPES, CLUSTER_SPLIT, COLUMN_BAND, DECODE, DECODE_32, DECODE_48, DECODE_WK,
                        DECODE_WK_ONE_PAIR, HOPPER_SHAPES, KERNEL_FILES, KERNEL_SHAPES, MAX_SPLIT, PREFILL,
                        PREFILL_128, SPLIT_WARPS_SHAPES, SUPPORTED_BLOCK_M, SWAPPED_32, SWAPPED_48, TEMPLATES,
                        GemmConfig, all_name_expressions, fallback, max_split_k, splits_in_cluster, warps_k_choices)
from .gpu import GpuInfo, build_arch, gpu_info
from .heuristic import choose_config, down_pair_order, expected_experts, one_pair_blocks, split_k_estimate
from .tuned import load_table, save_tuned, shipped_dir, table_file_name, tuned_table, tuning_key, user_dir

__all__ = ["GemmConfig", "KERNEL_FILES", "TEMPLATES", "KERNEL_SHAPES", "ACT_ORDER_SHAPES", "HOPPER_SHAPES",
           "SPLIT_WARPS_SHAPES", "SUPPORTED_BLOCK_M", "DECODE", "DECODE_32", "DECODE_48", "DECODE_WK",
           "DECODE_WK_ONE_PAIR", "PREFILL", "PREFILL_128", "SWAPPED_32", "SWAPPED_48", "MAX_SPLIT", "CLUSTER_SPLIT",
           "COLUMN_BAND", "fallback", "splits_in_cluster", "max_split_k", "all_name_expressions", "GpuInfo",
           "gpu_info", "build_arch", "choose_config", "down_pair_order", "expected_experts", "one_pair_blocks",
           "split_k_estimate", "warps_k_choices", "tuning_key", "table_file_name", "shipped_dir", "user_dir",
           "load_table", "tuned_table", "save_tuned"]
