"""Tile choice for the fused GPTQ MoE GEMM, in one place.

Three kernels (kernels/moe_gemm.cu), measured on an H200 by benchmarks/bench_gemm.py / sweep_tiles.py (see
docs/performance.md):

- `moe_gemm` ("reg", decode, `block_m` 16): one m16 tile per CTA, 4 warps side by side over 128 columns, 4 K chunks
  (128 k) per pipeline stage, a warp-private cp.async weight ring (`stages - 1` stages in flight; scales and zeros in
  registers one stage ahead, activations loaded at the top of their own stage); each lane dequantizes its own B
  fragments in registers. When a stage lies in one group and every stage is whole (G and K multiples of 128: group
  mode 1) scale/zero are unpacked once per stage, the weights are dequantized to q - z exactly and the scale is
  applied to the stage's fp32 sums (one FFMA per accumulator per stage instead of one HMUL2 per weight pair); else
  once per 32-k chunk (mode 0); act-order (g_idx) is mode 2. Split-K fills the SMs when few experts are touched.
  Without act-order the instance is compiled for 4 CTAs per SM (at most 128 registers, GemmConfig.min_ctas); the
  others fit 3. H200, 2026-12-03 20:00 UTC (benchmarks/ab_kernels.sh, 48 decode rows): the group-mode-1 loop at
  375 SASS instructions per stage instead of 630 took 0.77-0.94 of the time on all 44 16-row rows. (Measured
  2026-12-03: carrying activations, scales and zeros in the ring too, with one CTA barrier per stage, was 2.3% slower
  on the geometric mean of the six sweep rows at its best depth, 3 stages; 16% slower at Mixtral-8x7B M = 64.)
  2026-12-04 17:55 UTC (same-run A/B, 40 decode rows): ring offsets from one base per stage, one slice test per stage
  and clamped columns instead of per-chunk tests cut the loop to 326 instructions per stage (from 387); 0.85-0.95 of
  the time on most rows (DeepSeek-V3 down M = 16 272 -> 236 us, Mixtral-8x7B gate/up M = 1 49.5 -> 45.3).
  A 16-row block with at most 8 rows (M = 1, few tokens per expert) swaps the mma operands: weights as the m16 side,
  rows as the n8 side, half the mmas (271 instructions per stage instead of 324); 2026-12-04 18:12 UTC, same-run
  A/B: Mixtral-8x7B gate/up M = 1 45.0 -> 35.5 us, DeepSeek-V3 gate/up M = 64 1064 -> 859.
- `moe_gemm` with warps along K (`warps_k` 4, 16 x 32, DECODE_WK): the CTA's 4 warps take 4 K slices of the same
  32 columns and sum them in shared memory in a fixed order. It replaces the 16 x 128 shape where the split estimate
  cuts K 2 or more ways and 4 warp slices are at most one stage longer (WARPS_K_EXTRA_STAGES below): about the same
  warps per column strip, without split-K's partials in global memory.
- A 16 x 256 variant of it (two 32-column groups per warp) was the shape for 16-row problems with at least 1024
  CTAs until 4 CTAs per SM fitted: on the H200 (2026-12-03 18:24-18:26 UTC) the 128-column shape at 4 CTAs per SM
  then took 0.95-1.00 of its time on the 13 such rows measured (DeepSeek-V3 gate/up M = 64 1511 against 1588 us,
  Qwen3-235B-A22B gate/up M = 64 384 against 405 us), so it was removed (docs/performance-history.md, 18:16-18:55).
- `moe_gemm_tc` ("tc", prefill, no act-order): 8 warps, 64 x 256 or 128 x 256 tiles; a cp.async ring of stages of
  `ku` 32-k steps; the CTA dequantizes each weight once into one of two shared-memory B buffers while the tensor
  cores work on the previous stage from the other (wgmma on sm_90a, issued asynchronously and kept in flight across
  the next barrier; ldmatrix + mma.sync elsewhere). The tiles are 256 wide: the gathered activation rows are re-read
  from L2 once per column tile, and 256 columns halve that traffic. Measured on the H200 (benchmarks/sweep_tiles.py,
  2026-12-03 09:50 UTC): 128 x 256 with 4 stages of 64 k beat 6 stages of 32 k by 9-11% (Mixtral-8x7B gate/up
  M = 4096 5839 against 6532 us; Qwen3-30B-A3B gate/up M = 4096 801 against 885 us); the 64 x 256 tile keeps 6
  stages of 32 k (two CTAs per SM). Rechecked after the copy code was made lean (16:20 UTC, 16 prefill rows):
  64-k stages for the 64-row tile (one CTA per SM) 16-26% slower, 5 stages for the 128-row tile 0-2.4% slower,
  8 stages for the 64-row tile within 2%. Act-order weights at these block sizes run `moe_gemm` with the
  ACT_ORDER shapes below instead.

- `moe_gemm_ws` ("ws", sm_90a, no act-order; WS_32 runs the 32-row blocks there): the operands swapped, out^T =
  W^T a^T. Each thread dequantizes its columns' weights straight into the register A fragment of m64nTk16 wgmma ops
  (T = the block's rows), the activation rows are the shared-memory B operand; 8 warps, 32 x 256 tiles, 6 stages
  of 32 k, two CTAs per SM (WS_RESIDENT_PER_SM). H200, 2026-12-03 17:15-17:18 UTC (bench_gemm.py --tiles, one
  call each): on the twelve 32-row rows (Mixtral M = 64, four many-expert models at M = 256) 0.80-0.91 of the
  `moe_gemm` 32 x 128 time on nine (Qwen3-235B-A22B gate/up M = 256 504 against 634 us, Mixtral-8x7B down M = 64
  177 against 197 us), slower on three that the split heuristic then cut 3 ways (Qwen1.5-MoE-A2.7B down M = 256
  103 against 90 us); the split estimate now counts two resident CTAs for it, which picks fewer slices there, and
  the full benchmark at 17:28 had all twelve at 0.71-0.94 of their 16:14 times.
  At 16 rows it lost to `moe_gemm` on all 12 rows tried (Qwen1.5-MoE-A2.7B down M = 64 71 against 54 us); at 64
  and 128 rows to the tc kernel, the better of two shapes each by 3-27% (DeepSeek-V3 gate/up M = 1024 3236
  against 2885 us).

Heuristic: rows per touched expert r = P / touched (below) with P = M * A: r <= 24 -> 16 (H200, 2026-12-03 20:03 UTC,
after the decode kernel lost 40% of its instructions: two 16-row blocks per expert beat one 32-row ws block on 9 of 11
rows with 16-24 rows per expert, Mixtral-8x22B gate/up M = 64 421 against 498 us, Qwen3-235B-A22B down M = 256 220
against 262 us; the exception, DeepSeek-V2-Lite gate/up M = 256 at 24 rows, 140 against 133 us, turned after the
decode loop lost another 16% of its instructions: 2026-12-04 18:01 UTC, `python -m cupy_moe tune --dry-run`, 117.5
against 134.0 us, down 64.2 against 70.7). The 32-row block (`moe_gemm_ws` on sm_90a, else `moe_gemm` with two m16
tiles) is no longer picked by the heuristic: in the same tune run it lost at 24 rows (above) and at 32 rows to the
64-row tile (Qwen2-57B-A14B gate/up M = 256 561.0 against 411.9 us; DeepSeek-V3 gate/up M = 1024 3428.5 against
2630.4); it stays for `block_m=32` and the tuner. A 32-row `moe_gemm` block that runs only its first m16 tile when
rows 16..31 are padding (branch half32) took 0.96-1.26 of the 16-row time, 1.12 on the geometric mean, on the 28 rows
with 8-24 rows per expert where it was tried (H200, 2026-12-04 21:36, docs/performance.md): at 188 registers half as
many warps fit per SM. r <= 56 -> 64, else 128 (H200, 2026-12-03: at 128 rows one 128-row tile beats two 64-row tiles,
Qwen2-57B-A14B gate/up M = 1024 1317 against 1378 us in the 11:30 sweep, DeepSeek-V3 gate/up M = 4096 7901 against
8496 us in the benchmark; at 256 rows by 10-11%. 23:50 UTC, M = 1024, --rows-64-max 40 against 96: with 68 and 96 rows
per expert the 128-row tile took 0.84/0.93 (Qwen1.5-MoE-A2.7B gate/up/down, 182 against 217 us) and 0.53/0.82
(DeepSeek-V2-Lite, 224 against 424 us) of the time: binomial routing puts many experts past 64 rows, and a second,
mostly empty 64-row block dequantizes the expert's weights again; 128 x 128 tiles lost to 128 x 256 on all ten of
these rows. Since the tc kernel loads a stage's raw words in one batch (2026-12-04 15:49-15:52, --rows-64-max 24
against 80): at 32 and 48 rows per expert the 64-row tile takes 0.79-0.91 of the 128-row time (Qwen3-30B-A3B gate/up
M = 768 150.7 against 186.1 us), at 64 rows the 128-row tile takes 0.85-0.91 (Qwen3-30B-A3B gate/up M = 1024 190.7
against 225.0 us) and 0.66 (Mixtral-8x7B gate/up M = 256, 405.5 against 611.9 us); 56 is between, where about 1 expert
in 8 would need a second 64-row block).
Touched experts: the expected number of distinct experts under uniform routing, E * (1 - (1 - A/E)^M) (the down
phase passes M*A rows with A = 1); `min(E, M*A)` overestimated small batches (Mixtral M = 4: 8 against 5.5).
split_k (deterministic: partials reduced in fixed order by the last CTA of each tile, no atomics on outputs): at most
16 slices of at least 2 stages each; the fewest within 5% of the least estimate waves x (stages per slice + F), with
waves = ceil(CTAs / resident slots), slots = CTAs per SM x NUM_SMS, and F = SPLIT_FILL_STAGES = 4 stages for a CTA's
pipeline fill, epilogue and partial round trip. Short slices cost (a fresh CTA starts with an empty pipeline) and so
does a nearly empty last wave. F was 2 until 2026-12-04 20:17 UTC (H200, bench_gemm.py --m 1,2,4,8,16,32,64
--split-fill-stages 4 against 2, 112 decode rows, each timed twice, interleaved): with 4 the picks took 0.85-1.08 of
the time, 0.994 on the geometric mean; 10 rows gained more than 3% (DeepSeek-V2-Lite down M = 4 16.4 -> 14.0 us,
Mixtral-8x7B gate/up M = 64 233.5 -> 203.4, unsplit 16 x 128 instead of 16 x 32 with warps along K), one lost
(Qwen3-235B-A22B gate/up M = 2 34.5 -> 37.2).
The tc tiles (64 and 128 rows) split only grids of less than one wave: their fp32 partial tiles (64-128 KB per
CTA, written, then read by the last CTA) cost far more than F stages. H200, 2026-12-04 15:59-16:03 (python -m
cupy_moe tune, all splits timed): on grids of one wave or more, split 2 took 1.04-1.57 of the unsplit time
(Qwen2-57B-A14B down M = 256 310.6 against 212.8 us, Qwen1.5-MoE-A2.7B gate/up M = 512 201.8 against 128.3,
Mixtral-8x22B down M = 512 709.3 against 618.4); under one wave the splits still win (Mixtral-8x22B down M = 128,
4 ways, 308.7 against 443.0 us unsplit at 128 rows).
Examples (16-row decode at 4 bits, 528 slots): 448 CTAs x 32 stages stay whole (estimate 36; 2 ways 40);
64 CTAs x 112 stages split 8 ways. H200, 2026-12-03 18:46 UTC (benchmarks/sweep_splits.py: 60 rows of M = 1-64,
every split 1-8 timed): the rule's pick took 1.016 of the fastest split's time on the geometric mean (worst 1.234,
Mixtral-8x22B down M = 4: 2 ways 170 against 8 ways 139 us); on the same kind of sweep at 18:25 the previous rule
(3 CTAs per SM, touched = min(E, M*A)) took 1.032 (worst 1.55).
A 2-way split of 16-row blocks with at most 8 rows per expert (the swapped-operand path) whose split grid fits one
wave stays 16 x 128 instead of becoming warps along K: H200 2026-12-04 20:17 (bench_gemm.py, 112 decode rows, each
timed twice), on the 12 such rows the plain split took 0.90-1.07 of the warps-along-K time, 0.95 on the geometric
mean (Mixtral-8x7B down M = 16 72.5 -> 65.8 us, Qwen3-30B-A3B down M = 2 9.6 -> 8.7; Mixtral-8x22B down M = 4
92.9 -> 99.0). Checked at 20:31-20:33 against the rule before, same call, twice each: the 12 rows 0.90-1.06, 0.955 on
the geometric mean, the other 100 rows 0.99-1.01. Elsewhere the winner flipped from row to row (docs/performance.md,
the 19:58 session).
A 64-row pick that the estimate splits (a grid under half a wave: few experts, few column tiles) becomes 128 rows
unsplit where that grid fills at least FULL_WAVE of its waves: one 64-k stage of a 128-row CTA alone on its SM takes
about what a 32-k stage of one of two 64-row CTAs takes (H200 2026-12-04, 0.71 against 0.84 us), and the 128-row tile
has no fp32 partials. H200, 2026-12-04 19:19 (abk/splits.py): Mixtral-8x7B down M = 128 (128 CTAs of 128 rows) 64 x S2
187.8 us, 128 x S1 159.7; Mixtral-8x22B down M = 128 (192 CTAs: 0.73 of two waves) 64 x S4 309.7, 128 x S1 361.6.
`block_m` is the align block size of that phase: `moe_align_block_size` takes it (fused_moe aligns a second time
when its two phases pick different sizes).
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["GemmConfig", "choose_config", "expected_experts", "KERNEL_SHAPES", "ACT_ORDER_SHAPES", "SUPPORTED_BLOCK_M",
           "NUM_SMS", "kernel_instance", "all_name_expressions", "MODEL_SHAPES", "tuned_cache_path", "tuning_key",
           "tuned_table", "save_tuned", "hopper_enabled"]

# The MoE shapes of SHAPES.md: name -> (H, I, E, A). Benchmarks and `python -m cupy_moe tune` use these.
MODEL_SHAPES = {
    "Mixtral-8x7B": (4096, 14336, 8, 2),
    "Mixtral-8x22B": (6144, 16384, 8, 2),
    "Qwen1.5-MoE-A2.7B": (2048, 1408, 60, 4),
    "Qwen2-57B-A14B": (3584, 2560, 64, 8),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "Qwen3-235B-A22B": (4096, 1536, 128, 8),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "DeepSeek-V3": (7168, 2048, 256, 8),
}

NUM_SMS = 132        # H100/H200; only used for the split-K estimate
# CTAs resident per SM for each block_m without a launch bound (shared memory / registers of the default shapes,
# ptxas -v): decode 16 x 128 (about 150 registers) and 32 x 128 (about 165): 3; tc 64 x 256 (89 KiB): 2; tc 128 x 256
# (about 190 registers): 1. GemmConfig.min_ctas raises the decode shapes' to their launch bounds.
RESIDENT_PER_SM = {16: 3, 32: 3, 64: 2, 128: 1}
# moe_gemm launch bounds (CTAs per SM) by warp layout (mt, warps_m, warps_n, ng, warps_k): 16 x 128 and 16 x 32 x 4
# at most 128 registers, 32 x 128 at most 168, no spills (nvcc 13.0; tests/test_compile.py checks NVRTC)
LAUNCH_BOUNDS = {(1, 1, 4, 1, 1): 4, (2, 1, 4, 1, 1): 3, (1, 1, 1, 1, 4): 4}
WS_RESIDENT_PER_SM = 2  # moe_gemm_ws 32 x 256: about 125 registers x 256 threads
_MAX_SPLIT = 16
SPLIT_FILL_STAGES = 4  # the split estimate's stages per CTA for its pipeline fill and epilogue (docstring)
FULL_WAVE = 0.9  # a split 64-row pick becomes 128 rows unsplit where that grid fills this much of its waves


@dataclass(frozen=True)
class GemmConfig:
    """Template parameters of one `moe_gemm` instance plus the run-time split-K factor.

    block_m = warps_m * mt * 16 rows of one expert per CTA (= the align block size B);
    block_n = warps_n * ng * 32 columns per CTA (kind "ws": 128 * ng); ku = 32-wide K chunks per pipeline stage;
    stages = depth of the cp.async ring (stages - 1 stages in flight while one computes).
    """
    mt: int
    warps_m: int
    warps_n: int
    ng: int
    ku: int
    stages: int = 4
    split_k: int = 1
    kind: str = "reg"  # "reg": moe_gemm (B dequantized in registers), "tc": moe_gemm_tc (B in shared memory),
    # "ws": moe_gemm_ws (sm_90a: weights as the wgmma M side in registers; warps_m 1, warps_n 8, ng m64 tiles per
    # warpgroup, so block_n = 128 * ng)
    warps_k: int = 1  # moe_gemm: warps side by side along K, each on its own slice, summed in shared memory

    @property
    def block_m(self) -> int:
        return self.warps_m * self.mt * 16

    @property
    def block_n(self) -> int:
        return 128 * self.ng if self.kind == "ws" else self.warps_n * self.ng * 32

    @property
    def short_name(self) -> str:
        """Block rows with a kind mark, as benchmarks and `tune` print it: '16', '16k' (warps along K), '32s' (the
        swapped-operand kernel)."""
        return f"{self.block_m}{'s' if self.kind == 'ws' else 'k' if self.warps_k > 1 else ''}"

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * self.warps_k * 32

    def group_mode(self, act_order: bool, group_len: int | None, k: int | None = None) -> int:
        """moe_gemm's GM: 2 act-order; 1 one group per stage and every stage whole (group_len and K multiples of
        32*ku; k None: any K that is); else 0."""
        if act_order:
            return 2
        stage = 32 * self.ku
        return 1 if group_len is not None and group_len % stage == 0 and (k is None or k % stage == 0) else 0

    def min_ctas(self, act_order: bool) -> int:
        """moe_gemm's launch bound: CTAs per SM the compiler must fit in registers (1: none), LAUNCH_BOUNDS of the
        warp layout (any bits and group mode); at most 3 with act-order (the 16 x 128 shape bounded to 4 measured
        slower there), 1 for the other layouts, which would spill."""
        if self.kind != "reg":
            return 1
        bound = LAUNCH_BOUNDS.get((self.mt, self.warps_m, self.warps_n, self.ng, self.warps_k), 1)
        return min(bound, 3) if act_order else bound

    def ctas_per_sm(self, act_order: bool) -> int:
        """CTAs resident per SM, for the split-K estimate."""
        if self.kind == "ws":
            return WS_RESIDENT_PER_SM
        return max(self.min_ctas(act_order), RESIDENT_PER_SM.get(self.block_m, 1))

    def name_expression(self, bf16: bool, bits: int, act_order: bool, group_len: int | None = None,
                        hopper: bool = False, k: int | None = None, pair_a: bool = False) -> str:
        """The kernel instance; hopper: the tc kernel's wgmma variant (sm_90a; moe_gemm has none); pair_a: the
        activations in pair order (4-bit; moe_gemm and the tc kernel, see kPairA in moe_gemm.cu)."""
        b = lambda flag: "true" if flag else "false"
        if pair_a and (bits != 4 or self.kind == "ws"):
            raise ValueError(f"pair_a: expected 4-bit weights and kind 'reg' or 'tc', got {bits}-bit, kind "
                             f"{self.kind!r} (kernel_instance falls back from 'ws')")
        if self.kind == "ws":
            if act_order or not hopper:
                raise ValueError("kind 'ws': expected hopper=True and act_order=False (kernel_instance falls back), "
                                 f"got hopper={hopper}, act_order={act_order}")
            return f"moe_gemm_ws<{b(bf16)}, {bits}, {self.block_m}, {self.ng}, {self.stages}, {self.ku}>"
        if self.kind == "tc":
            if act_order:
                raise ValueError("act_order: expected False for the tc kernel (use kernel_instance), got True")
            return (f"moe_gemm_tc<{b(bf16)}, {bits}, {self.block_m}, {self.block_n}, {self.stages}, {self.ku}, "
                    f"{b(hopper)}, {b(pair_a)}>")
        gm = self.group_mode(act_order, group_len, k)
        return (f"moe_gemm<{b(bf16)}, {bits}, {self.mt}, {self.warps_m}, {self.warps_n}, {self.warps_k}, {self.ng}, "
                f"{self.ku}, {self.stages}, {gm}, {self.min_ctas(act_order)}, {b(pair_a)}>")

    def smem_bytes(self, bits: int, hopper: bool = False) -> int:
        """Dynamic shared memory of one launch (must match TcSmem in moe_gemm.cu); 0 for moe_gemm (static).

        tc: per 32-k step (ku of them per stage) the activation rows, raw qweight rows, scales and zero words, plus
        two B buffers of ku tiles; the wgmma variant (hopper) rounds steps to 512 bytes and adds 1 KiB to align the
        base."""
        bn = self.block_n
        if self.kind == "ws":  # WsSmem in moe_gemm.cu
            step = -(-(self.block_m * 64 + bits * (bn * 4 + 32) + bn * 2 + bn * bits // 8) // 512) * 512
            return self.stages * self.ku * step + 1024
        if self.kind != "tc":
            return 0
        step = self.block_m * 64 + bits * bn * 4 + bn * 2 + bn * bits // 8
        if hopper:
            step = -(-step // 512) * 512
        return self.stages * self.ku * step + 2 * self.ku * bn * 64 + (1024 if hopper else 0)


DECODE = GemmConfig(mt=1, warps_m=1, warps_n=4, ng=1, ku=4, stages=2)
DECODE_32 = GemmConfig(mt=2, warps_m=1, warps_n=4, ng=1, ku=2, stages=4)  # two m16 tiles share each dequantized weight
PREFILL = GemmConfig(mt=2, warps_m=2, warps_n=4, ng=2, ku=1, stages=6, kind="tc")     # 64 x 256
PREFILL_128 = GemmConfig(mt=4, warps_m=2, warps_n=4, ng=2, ku=2, stages=4, kind="tc")  # 128 x 256, 64-k stages
KERNEL_SHAPES = {c.block_m: c for c in (DECODE, DECODE_32, PREFILL, PREFILL_128)}
# act-order weights at the tc block sizes: moe_gemm shapes of the same block_m
ACT_ORDER_SHAPES = {16: DECODE, 64: GemmConfig(mt=2, warps_m=2, warps_n=2, ng=2, ku=1, stages=4),
                    128: GemmConfig(mt=4, warps_m=2, warps_n=4, ng=1, ku=1, stages=4)}
SUPPORTED_BLOCK_M = tuple(sorted(KERNEL_SHAPES))
# The 16-row decode shape with its K slices as the warps of one CTA (16 x 32, 4 warps along K, summed in shared
# memory), in place of split-K where the estimate cuts K 2 or more ways and a warp's slice is at most
# WARPS_K_EXTRA_STAGES stages longer than a split slice (always for splits of 2-4): one CTA per column strip instead
# of split CTAs whose partials go through global memory (fence, ticket, the last CTA's reads). H200, 2026-12-04,
# same-run A/B of decode rows (benchmarks/bench_gemm.py --warps-k-extra-stages): splits of 3-4 took 0.82-1.02 of the
# time (10:27 and 10:32 UTC, geometric mean 0.93, 20 rows; Qwen1.5-MoE-A2.7B down M = 1 6.3 against 7.6 us), splits
# of 2 0.83-1.03 (10:32, 0.96, 35 rows; Mixtral-8x7B down M = 64 134.4 against 162.3 us). Longer splits: a split of
# 6 on short K (Qwen1.5-MoE-A2.7B gate/up M = 1, 16 stages: 4 per warp against 3) 9.4 against 10.8 us (10:32, as a
# tuned entry); a split of 5 on long K (Mixtral-8x22B down M = 1, 128 stages: 32 per warp against 26) 48.6 against
# 45.3 us, hence the rule. Kept as round(split / 4) CTAs of 4 warps, splits of 6 and 8 lost or tied (10:27: 12.8
# against 10.8 us in 1.3 waves; 28.9 against 28.6 us). Deeper rings for this shape lost (10:30, 20 rows: 4 stages of
# 128 k 1.08, 6 or 3 stages of 64 k 1.23 / 1.17), and so did 8 warps along K (1.12; 6-11% faster only on three
# long-K Mixtral down rows).
DECODE_WK = GemmConfig(mt=1, warps_m=1, warps_n=1, ng=1, ku=4, stages=2, warps_k=4)
SPLIT_WARPS_SHAPES = {16: DECODE_WK}
WARPS_K_EXTRA_STAGES = 1  # negative: never
# sm_90a: block sizes that run the swapped-operand kernel instead (weights as the wgmma M side, see the docstring)
WS_32 = GemmConfig(mt=2, warps_m=1, warps_n=8, ng=2, ku=1, stages=6, kind="ws")  # 32 x 256, 6 stages of 32 k
HOPPER_SHAPES = {32: WS_32}
_PORTABLE_SHAPES = dict(KERNEL_SHAPES)  # what a ws shape falls back to off sm_90a or with act-order
# heuristic block_m: rows per touched expert <= 24 -> 16, <= 56 -> 64, else 128 (module docstring; no 32-row block)
ROWS_16_MAX, ROWS_64_MAX = 24, 56


def hopper_enabled(arch: str) -> bool:
    """Whether the Hopper kernels run (the tc kernel's wgmma variant and HOPPER_SHAPES): on `sm_90a` unless the
    environment sets CUPY_MOE_HOPPER=0 (the portable kernels then run, e.g. to compare)."""
    return arch == "sm_90a" and os.environ.get("CUPY_MOE_HOPPER", "1") != "0"


def down_pair_order(bits: int, block_m: int) -> bool:
    """Whether fused_moe's down GEMM reads its activations in pair order (fused_moe_gemm's a_pair_order): 4-bit
    weights on 16-row blocks. moe_gemm's 16-row loops then skip re-pairing them: down rows 2-8% faster (H200,
    2026-12-04). The tc kernel of 64- and 128-row blocks ran 4-5% slower with them, though its loop is 32 of 365
    instructions shorter, so those blocks keep the natural order."""
    return bits == 4 and block_m == 16


def kernel_instance(cfg: GemmConfig, bf16: bool, bits: int, act_order: bool, group_len: int, hopper: bool = False,
                    k: int | None = None, pair_a: bool = False):
    """(config actually launched, name expression, dynamic shared-memory bytes) for one call.

    The split-K factor of `cfg` is kept; act-order at a tc block size switches to ACT_ORDER_SHAPES[block_m].
    hopper: the Hopper variants (see hopper_enabled). pair_a: activations in pair order (4-bit only), which the ws
    kernel does not read, so a ws shape falls back to the portable one.
    """
    if cfg.kind == "ws" and (act_order or not hopper or pair_a):
        cfg = replace(_PORTABLE_SHAPES[cfg.block_m], split_k=cfg.split_k)
    if cfg.kind == "tc" and act_order:
        cfg = replace(ACT_ORDER_SHAPES[cfg.block_m], split_k=cfg.split_k)
    return (cfg, cfg.name_expression(bf16, bits, act_order, group_len, hopper, k, pair_a),
            cfg.smem_bytes(bits, hopper))


def all_name_expressions(arch: str = "sm_80") -> list[str]:
    """Every kernel instance the launcher can request on `arch` (the NVRTC compile test compiles all of them);
    on sm_90a both the Hopper and the sm_80-style variants."""
    names = []
    for hopper in ((False, True) if arch == "sm_90a" else (False,)):
        for bf16 in (False, True):
            for bits in (4, 8):
                for cfg in (*KERNEL_SHAPES.values(), *HOPPER_SHAPES.values(), *SPLIT_WARPS_SHAPES.values()):
                    for act, glen in ((False, 32), (False, 32 * cfg.ku), (True, None)):
                        for pair_a in ((False, True) if bits == 4 else (False,)):
                            names.append(kernel_instance(cfg, bf16, bits, act, glen, hopper, pair_a=pair_a)[1])
    return list(dict.fromkeys(names))


def choose_config(m: int, e: int, a: int, k: int, n: int, bits: int, group_size: int,
                  block_m: int | None = None, hopper: bool | None = None, act_order: bool = False) -> GemmConfig:
    """The tile configuration for one GEMM phase.

    m: tokens M (rows of the activation), e: experts E, a: top-k A of this phase (the down phase passes
    m = M*A rows and a = 1), k: K, n: N, bits, group_size: G (-1 = one group).
    block_m: force the tile height (the align block size already used); None = heuristic.
    hopper: whether the sm_90a kernels run (HOPPER_SHAPES); None = ask the current device (False without a GPU).
    act_order: the weights carry g_idx (only the split-K estimate's CTAs per SM depend on it).
    Returns a GemmConfig; its `block_m` is the block size to align with.
    A configuration measured by `python -m cupy_moe tune` for this GPU and problem wins over the heuristic.
    """
    pairs = max(1, m * a)
    touched = expected_experts(m, e, a)
    rows = pairs / touched
    if hopper is None:
        hopper = _device_hopper()

    def shape(bm):
        if hopper and bm in HOPPER_SHAPES:
            return HOPPER_SHAPES[bm]
        return KERNEL_SHAPES[bm]

    def grid(bm):  # (shape, CTAs of the unsplit grid, resident slots)
        cfg = shape(bm)
        ctas = math.ceil(_blocks(touched, rows, cfg.block_m) * -(-n // cfg.block_n))
        return cfg, ctas, cfg.ctas_per_sm(act_order) * NUM_SMS

    def split_shape(cfg, ctas, slots):  # cfg with its split, or the warps-along-K shape in its place (_split_warps)
        return _split_warps(cfg, k, one_wave_swapped=2 * ctas <= slots and rows <= 8)

    tuned = _tuned_entry(e, k, n, bits, group_size, m * a)
    if tuned is not None and (block_m is None or block_m == tuned["block_m"]):
        base, ctas, slots = grid(tuned["block_m"])
        return split_shape(replace(base, split_k=tuned["split_k"]), ctas, slots)
    heuristic = block_m is None
    if heuristic:
        block_m = 16 if rows <= ROWS_16_MAX else 64 if rows <= ROWS_64_MAX else 128
    elif block_m not in KERNEL_SHAPES:
        raise ValueError(f"block_m: expected one of {SUPPORTED_BLOCK_M}, got {block_m}")
    base, ctas, slots = grid(block_m)
    max_split = max_split_k(k, base.ku)
    stages = -(-max(1, k // 32) // base.ku)
    if base.kind == "tc" and ctas >= slots:
        max_split = 1  # a 64- or 128-row tile's fp32 partial costs more than the estimate's F stages (docstring)
    cost = [-(-ctas * s // slots) * (-(-stages // s) + SPLIT_FILL_STAGES) for s in range(1, max_split + 1)]
    split = next(s for s, c in enumerate(cost, 1) if c <= 1.05 * min(cost))
    if heuristic and block_m == 64 and split > 1 and not act_order:
        big, big_ctas, big_slots = grid(128)
        if big_ctas >= FULL_WAVE * big_slots * -(-big_ctas // big_slots):
            return replace(big, split_k=1)  # a full unsplit wave of 128-row tiles (docstring)
    return split_shape(replace(base, split_k=split), ctas, slots)


def _split_warps(cfg: GemmConfig, k: int, one_wave_swapped: bool = False) -> GemmConfig:
    """SPLIT_WARPS_SHAPES[block_m] (one CTA per column strip) in place of a split shape whose K slices its warps'
    slices exceed by at most WARPS_K_EXTRA_STAGES stages (see there); not for a 2-way split whose split grid fits one
    wave with at most 8 rows per expert (one_wave_swapped: the swapped-operand path; module docstring)."""
    alt = SPLIT_WARPS_SHAPES.get(cfg.block_m)
    if alt is None or cfg.kind != "reg" or cfg.split_k < 2 or WARPS_K_EXTRA_STAGES < 0:
        return cfg
    if cfg.split_k == 2 and one_wave_swapped:
        return cfg
    stages = -(-max(1, k // 32) // alt.ku)
    if -(-stages // alt.warps_k) > -(-stages // cfg.split_k) + WARPS_K_EXTRA_STAGES:
        return cfg
    return replace(alt, split_k=1)


def _device_hopper() -> bool:
    from . import _compile, _xp
    return _xp.gpu_available() and hopper_enabled(_compile.device_arch())


def expected_experts(m: int, e: int, a: int) -> float:
    """Distinct experts that m tokens with top-a of e experts touch on average under uniform routing (at least 1)."""
    return max(1.0, round(e * (1.0 - (1.0 - min(1.0, a / e)) ** max(1, m)), 6))


def max_split_k(k: int, ku: int) -> int:
    """The most K slices of a shape with `ku` 32-k chunks per stage: each keeps at least 2 stages, at most
    _MAX_SPLIT."""
    return max(1, min(_MAX_SPLIT, (k // 32) // (2 * ku)))


def _blocks(touched: float, rows: float, block_m: int) -> float:
    """Live m-blocks of the aligned pair list, about: touched experts x blocks of their average row count."""
    return touched * -(-int(rows + 0.999) // block_m)


# ---------------------------------------------------------------- tuned configurations
# `python -m cupy_moe tune` times the candidates on the GPU at hand and stores the winners in one JSON file,
# {gpu name: {tuning_key: {"block_m", "split_k", "time_us"}}}, read once per process. Problems it has no entry
# for use the heuristic above; when the file holds entries for this GPU but not for a problem, a warning says so
# once per problem.

def tuned_cache_path() -> Path:
    """$CUPY_MOE_CACHE_DIR, else $XDG_CACHE_HOME/cupy_moe, else ~/.cache/cupy_moe; file tuned_configs.json."""
    root = os.environ.get("CUPY_MOE_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cupy_moe"
    return Path(root) / "tuned_configs.json"


def tuning_key(e: int, k: int, n: int, bits: int, group_size: int, pairs: int) -> str:
    """One entry per (E, K, N, bits, G, bucket of P = M*A pairs); buckets are powers of two."""
    bucket = 1 << max(0, int(pairs) - 1).bit_length()
    return f"E{e}_K{k}_N{n}_b{bits}_G{group_size}_P{bucket}"


@functools.lru_cache(maxsize=None)
def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"cupy_moe: ignoring the tuned-config cache {path}: {exc}", stacklevel=3)
        return {}
    return data if isinstance(data, dict) else {}


def _device_name() -> str | None:
    from . import _xp
    if not _xp.gpu_available():
        return None
    return _gpu_name(_xp.cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _gpu_name(device_id: int) -> str:
    from . import _xp
    name = _xp.cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def tuned_table(gpu: str | None = None) -> dict:
    """The in-memory tuned entries of one GPU (default: the current device; {} without a GPU); mutable."""
    gpu = gpu or _device_name()
    if gpu is None:
        return {}
    return _load_cache(tuned_cache_path()).setdefault(gpu, {})


_WARNED: set = set()


def _tuned_entry(e, k, n, bits, group_size, pairs):
    table = tuned_table()
    if not table or pairs <= 0:
        return None
    key = tuning_key(e, k, n, bits, group_size, pairs)
    entry = table.get(key)
    if entry is None:
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"cupy_moe: no tuned GEMM config for {key} in {tuned_cache_path()}; using the heuristic "
                          "(python -m cupy_moe tune measures one)", stacklevel=4)
        return None
    try:
        block_m, split_k = int(entry["block_m"]), int(entry["split_k"])
    except (KeyError, TypeError, ValueError):
        return None
    if block_m not in KERNEL_SHAPES or not 1 <= split_k <= _MAX_SPLIT:
        return None
    return {"block_m": block_m, "split_k": split_k}


def save_tuned(gpu: str, entries: dict) -> Path:
    """Merge {tuning_key: {"block_m", "split_k", "time_us"}} for `gpu` into the cache file; returns its path."""
    path = tuned_cache_path()
    data = dict(_load_cache(path))
    data.setdefault(gpu, {}).update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    _load_cache.cache_clear()
    return path
