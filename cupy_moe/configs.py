"""Tile choice for the fused GPTQ MoE GEMM, in one place.

Two kernel shapes earn their place (measured on an H200 by benchmarks/sweep_tiles.py, see docs/performance.md):

- decode (`block_m` 16): one m16 tile per CTA, 4 warps side by side over 128 columns, 4 K chunks (128 k) per
  pipeline stage, a 2-stage cp.async weight ring; split-K fills the 132 SMs when only a few experts are touched.
  Deeper rings (4 or 6 stages) and 2-chunk stages measured the same within 3%: this path is bound by
  instructions per weight byte (dequantization), not by bytes in flight.
- prefill (`block_m` 64): 2x2 warps of 32 rows x 64 columns; each dequantized weight fragment feeds 2 m16 tiles
  and each activation fragment 8 n8 tiles. It beat 4x1 warps of 64 rows (which dequantizes each fragment once
  but holds 205 registers) by 5-15% in the sweep.

Heuristic: rows per touched expert r = P / min(E, P) with P = M * A. r <= 24 -> decode, else prefill (an expert
with more rows than that wastes little of a 64-row tile and reuses each dequantized weight 4x more).
split_k: the fewest slices that give at least ~4 CTAs per SM, each slice keeping at least 2 stages of K, at
most 16 (deterministic: partials reduced in fixed order by the last CTA of each tile, no atomics on outputs).
`block_m` is the align block size the layer must pass to `moe_align_block_size`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GemmConfig", "choose_config", "KERNEL_SHAPES", "SUPPORTED_BLOCK_M", "NUM_SMS"]

NUM_SMS = 132        # H100/H200; only used for the split-K estimate
_TARGET_CTAS = 4 * NUM_SMS
_MAX_SPLIT = 16


@dataclass(frozen=True)
class GemmConfig:
    """Template parameters of one `moe_gemm` instance plus the run-time split-K factor.

    block_m = warps_m * mt * 16 rows of one expert per CTA (= the align block size B);
    block_n = warps_n * ng * 32 columns per CTA; ku = 32-wide K chunks per pipeline stage; stages = depth of the
    cp.async weight ring (stages - 1 stages in flight while one computes).
    """
    mt: int
    warps_m: int
    warps_n: int
    ng: int
    ku: int
    stages: int = 4
    split_k: int = 1

    @property
    def block_m(self) -> int:
        return self.warps_m * self.mt * 16

    @property
    def block_n(self) -> int:
        return self.warps_n * self.ng * 32

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    def name_expression(self, bf16: bool, bits: int, act_order: bool) -> str:
        b = lambda flag: "true" if flag else "false"
        return (f"moe_gemm<{b(bf16)}, {bits}, {self.mt}, {self.warps_m}, {self.warps_n}, {self.ng}, {self.ku}, "
                f"{self.stages}, {b(act_order)}>")


DECODE = GemmConfig(mt=1, warps_m=1, warps_n=4, ng=1, ku=4, stages=2)
PREFILL = GemmConfig(mt=2, warps_m=2, warps_n=2, ng=2, ku=1, stages=4)
KERNEL_SHAPES = {DECODE.block_m: DECODE, PREFILL.block_m: PREFILL}
SUPPORTED_BLOCK_M = tuple(sorted(KERNEL_SHAPES))


def choose_config(m: int, e: int, a: int, k: int, n: int, bits: int, group_size: int,
                  block_m: int | None = None) -> GemmConfig:
    """The tile configuration for one GEMM phase.

    m: tokens M (rows of the activation), e: experts E, a: top-k A of this phase (the down phase passes
    m = M*A rows and a = 1), k: K, n: N, bits, group_size: G (-1 = one group).
    block_m: force the tile height (the align block size already used); None = heuristic.
    Returns a GemmConfig; its `block_m` is the block size to align with.
    """
    pairs = max(1, m * a)
    touched = min(e, pairs)
    rows = pairs / touched
    if block_m is None:
        base = DECODE if rows <= 24 else PREFILL
    elif block_m in KERNEL_SHAPES:
        base = KERNEL_SHAPES[block_m]
    else:
        raise ValueError(f"block_m: expected one of {SUPPORTED_BLOCK_M}, got {block_m}")
    blocks = touched * -(-int(rows + 0.999) // base.block_m)  # live m-blocks, about
    n_tiles = -(-n // base.block_n)
    ctas = blocks * n_tiles
    chunks = max(1, k // 32)
    max_split = max(1, min(_MAX_SPLIT, chunks // (2 * base.ku)))
    split = 1
    while split < max_split and ctas * split < _TARGET_CTAS:
        split += 1
    return replace(base, split_k=split)
