// What the three fused GPTQ MoE GEMM kernels share: their contract with the launcher (cupy_moe/gemm.py) and the
// role headers they are built from. Each kernel family has its own file:
//   moe_gemm_decode.cu    moe_gemm          decode and act-order: B dequantized in registers, mma.sync
//   moe_gemm_prefill.cu   moe_gemm_tc       prefill: B dequantized once into shared memory, mma.sync or wgmma
//   moe_gemm_swapped.cu   moe_gemm_swapped  sm_90a: operands swapped, weights as wgmma's register A operand
//
// Every kernel computes out[p, :] = a[p // top_k, :] @ W[expert(p)] (* topk_weights[p]) for every pair p of the
// aligned pair list, straight from the stacked raw GPTQ layout (no repacking), one launch per phase, and takes the
// same arguments in the same order:
//
// Shapes: a [M, K] fp16/bf16; qweight [E, K*bits/32, N] int32 (packed along K); scales [E, ceil(K/G), N] fp16;
// qzeros [E, ceil(K/G), N*bits/32] int32 real zeros or null (symmetric: zero = 2^(bits-1)); g_idx [E, K] or null;
// sorted [C] pair ids (sentinel P), expert_ids [C/B_M], post_padded [1]; out [P, N] in a's dtype; partials
// [S, C, N] fp32 and tickets [C/B_M, N/B_N] zeros when split_k > 1 (split_k.cuh; untouched where the launch makes
// the split_k slices of a tile one thread-block cluster, which moe_gemm's 16-row blocks and moe_gemm_tc's wgmma
// variant then reduce in).
// Blocks whose expert id is outside [0, E) are skipped (num_experts = E), so a bad id never reads past the weights.
//
// Tiling: CTA = BLOCK_M (= the align block size) rows of one expert x BLOCK_N columns x one K slice (split-K).
// Grid = (C/BLOCK_M blocks, N/BLOCK_N, split_k): blockIdx.x is fastest so the CTAs that share a weight tile run
// together and the tile is read from HBM once (L2 hits after); moe_gemm_tc and moe_gemm_swapped, whose activation
// rows every column tile reads again, map the launch order to tiles in bands of column tiles instead (banded_tile).
#pragma once

#include "gptq_dequant.cuh"
#include "pdl.cuh"
#include "smem_pipeline.cuh"
#include "split_k.cuh"

namespace gptq {

// Launch order (blockIdx.x fastest) -> tile (row block, column tile): consecutive CTAs take n_band column tiles of
// one row block, then the next row block's, so that the CTAs resident at one time share their activation rows and
// weight tiles in L2 (with row blocks fastest, every column tile reads all the activation rows again). n_band 1: row
// blocks fastest. A bijection of (blockIdx.x, blockIdx.y), so split-K's tickets, indexed by blockIdx, still count
// one tile's slices.
__device__ __forceinline__ int2 banded_tile(int n_band) {
  int blk = blockIdx.x, n_tile = blockIdx.y;
  if (n_band > 1) {
    const int rows = gridDim.x, launch = blockIdx.x + rows * blockIdx.y, band = launch / (n_band * rows);
    const int width = min(n_band, static_cast<int>(gridDim.y) - band * n_band);
    const int within = launch - band * n_band * rows;
    blk = within / width;
    n_tile = band * n_band + within % width;
  }
  return make_int2(blk, n_tile);
}

}  // namespace gptq

using gptq::u32;
