"""The configuration one GEMM phase launches: `choose_config` and its rules.

With P = M * A pairs, `touched` = expected_experts(M, E, A) and r = P / touched rows per touched expert:

1. block_m = 16 for r <= ROWS_16_MAX (24); on sm_90a 48 (the swapped-operand kernel) for r <= ROWS_48_MAX (36);
   64 for r <= ROWS_64_MAX (56), else 128. No 32-row block by default.
2. split_k: the fewest K slices (each at least 2 stages, at most MAX_SPLIT) whose estimate
   waves x (stages per slice + SPLIT_FILL_STAGES) is within 5% of the least, with
   waves = ceil(CTAs x slices / (ctas_per_sm x SM count)). The tc tiles, and swapped tiles of 48 rows or more, split
   only grids of less than one wave; on sm_90a, where 2 slices of a tc tile add their partials inside a cluster
   (`splits_in_cluster`), a tc grid of a wave or more (its blocks counted with the spread of rows per expert) splits
   2 ways where that estimate falls to TC_CLUSTER_GAIN of the unsplit one. Split-K is deterministic: each tile's
   partials are summed in slice order (by its last CTA, or in the cluster); no atomics on outputs.
3. A split 48- or 64-row pick becomes 128 rows unsplit where the 128-row grid fills at least FULL_WAVE of its waves; a
   48-, 64- or 128-row pick with at most SPLIT_TC_ROWS_MAX rows per expert, whose unsplit grid has fewer CTAs than the
   GPU has SMs and that rule 2 would split more than SPLIT_TC_MAX ways (one expert with few column tiles: a shared
   expert) becomes 16 rows.
4. A split 16-row pick becomes DECODE_WK, one CTA per column strip, where its warps' slices are at most
   WARPS_K_EXTRA_STAGES stages longer than the split's; except a 2-way split whose grid fits one wave with at most
   8 rows per expert (the swapped path), which stays 16 x 128.
5. An entry of the GPU's tuned table (tuned.py) for the problem gives block_m and split_k in place of rules 1-3,
   and warps_k in place of rule 4 where it has one (rule 4 applies to entries without). A `block_m` passed in skips
   rules 1 and 3 (and an entry of another block size).
6. The shape runs where its kernel has a variant (`catalogue.fallback`): act-order at a tc block size runs the
   act-order shape, a swapped shape off sm_90a, with act-order or with pair-ordered activations the portable one.
7. With one pair per block (`one_pair`: no aligned list, each pair a 16-row block of its own), the warps-along-K
   shape runs in 64-k stages (DECODE_WK_ONE_PAIR), and rule 2 counts a block per pair.
8. fused_moe gives each pair a block of its own (`one_pair_blocks`) at M = 1, and at M <= ONE_PAIR_MAX_TOKENS where,
   even if every token chose the same experts, the blocks that repeat an expert would read at most
   ONE_PAIR_EXTRA_BYTES of weights again; otherwise it aligns.

Rules 1 and 3 choose the block size without looking at act-order; rule 2 counts the CTAs per SM of the instance
that act-order compiles. Every rule and constant was measured on an H200 (132 SMs), SPLIT_TC_MAX on an H100 (132
SMs); docs/heuristic.md holds the A/Bs behind them.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .catalogue import (CLUSTER_SPLIT, DECODE_WK, DECODE_WK_ONE_PAIR, HOPPER_SHAPES, KERNEL_SHAPES, MAX_SPLIT,
                        SPLIT_WARPS_SHAPES, SUPPORTED_BLOCK_M, GemmConfig, fallback, max_split_k, splits_in_cluster,
                        warps_k_choices)
from .gpu import GpuInfo, gpu_info
from .tuned import tuned_entry

__all__ = ["choose_config", "split_k_estimate", "expected_experts", "down_pair_order", "one_pair_blocks",
           "ROWS_16_MAX", "ROWS_48_MAX", "ROWS_64_MAX", "SPLIT_FILL_STAGES", "FULL_WAVE", "SPLIT_TC_MAX",
           "SPLIT_TC_ROWS_MAX", "WARPS_K_EXTRA_STAGES", "ONE_PAIR_MAX_TOKENS", "ONE_PAIR_EXTRA_BYTES"]

# Rule 1. Two 16-row blocks per expert beat one 32-row block on 9 of 11 rows with 16-24 rows per expert
# (Mixtral-8x22B gate/up M = 64: 421 against 498 us); at 32 rows the 64-row tile beat it too (Qwen2-57B-A14B gate/up
# M = 256: 411.9 against 561.0), so no 32-row block by default.
ROWS_16_MAX = 24
# Rule 1, sm_90a. At 32-34 rows per expert (under 0.1% of the experts past 48 rows) 48-row blocks of the
# swapped-operand kernel took 0.93-0.99 of the 64-row tile's time (Qwen2-57B-A14B gate/up M = 256: 385.4 against
# 413.0 us); at 40 rows (one expert in 8 past 48) 1.03 (Mixtral-8x7B gate/up M = 160: 346.0 against 334.6). H200.
ROWS_48_MAX = 36
# Rule 1. At 32-48 rows per expert the 64-row tile takes 0.79-0.91 of the 128-row time, at 64 rows the 128-row
# tile takes 0.66-0.91 of the 64-row time (Mixtral-8x7B gate/up M = 256: 405.5 against 611.9 us).
ROWS_64_MAX = 56
# Rule 2. With 4 fill stages instead of 2 the picks of 112 decode rows took 0.994 of the time on the geometric mean
# (DeepSeek-V2-Lite down M = 4: 16.4 -> 14.0 us).
SPLIT_FILL_STAGES = 4
# Rule 2. With this estimate the picks of 60 decode rows took 1.016 of the fastest split's time on the geometric mean.
SPLIT_TOLERANCE = 1.05
# Rule 3. Mixtral-8x7B down M = 128 (128 CTAs of 128 rows): 64 rows split 2 ways 187.8 us, 128 rows unsplit 159.7
# (48 rows split 2 ways 174.0 against 160.2, H200); Mixtral-8x22B down M = 128 (192 CTAs, 0.73 of two waves): 64 x
# 4 ways 309.7, 128 unsplit 361.6 (48 x 4 ways 286.6 against 308.6 for 64 x 4, H200).
FULL_WAVE = 0.9
# Rule 3. A 64- or 128-row tile split 3 ways or more sums its fp32 partial tiles (64-128 KB a CTA) in one CTA per
# tile. On grids of fewer CTAs than SMs, 16-row blocks (which dequantize the weights once per 16 rows) were faster on
# all 8 such problems of one expert (H100, M = 64 and 256; K = 5632, N = 2048, M = 64: 14.7 us against 112.1 with 128
# rows 15 ways; K = 2048, N = 11264, M = 256: 60.6 against 104.4 with 128 rows 3 ways, 88 CTAs unsplit). Not on a
# larger grid: Mixtral-8x22B down M = 128 (64 rows 4 ways, 192 CTAs unsplit) took 323.2 us against 350.7. At 1024
# rows the 16 x 128 blocks dequantize each weight 64 times: K = 2048, N = 11264 took 222.5 us against 97.7 (tc, one
# slice), so the rule stops at the 256 rows per expert (16 blocks) where it was measured.
SPLIT_TC_MAX = 2
SPLIT_TC_ROWS_MAX = 256
# Rule 2. On sm_90a a tc grid of a wave or more splits in 2 (in a cluster) where the estimate falls to this fraction
# of the unsplit one: 0.76 on the three rows whose 2 slices took 0.79-0.87 of the unsplit time (a half-empty last
# wave: Mixtral-8x22B down M = 256, 355.9 against 410.6-422.2 us), 0.85-1.02 on those that took 0.92-1.08 (H100).
TC_CLUSTER_GAIN = 0.8
# Rule 4. Splits of 2-4 run as 4 warps along K in 0.82-1.03 of the split time (Mixtral-8x7B down M = 64: 134.4
# against 162.3 us); a split of 5 on long K (32 stages a warp against 26) lost, 48.6 against 45.3. Negative: never.
WARPS_K_EXTRA_STAGES = 1
# Rule 8. Without the align launch (and the GEMMs' wait on the aligned list) the whole layer took 0.84-0.88 of the
# time on the small-expert rows the rule admits (Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B at M = 2-4, DeepSeek-V2-Lite at
# M = 2-3; Qwen3-30B-A3B M = 2 27.9 -> 23.5 us) and 0.82-0.95 when every token chose the same experts. On the rows it
# leaves aligned, 0.91-1.00 with uniform routing but up to 1.93x with the same experts for every token (Qwen3-235B-A22B
# M = 4 46.7 -> 90.0 us; DeepSeek-V2-Lite M = 4 1.145x, where those blocks reread 81 MB). H100, three rounds.
ONE_PAIR_MAX_TOKENS = 4
ONE_PAIR_EXTRA_BYTES = 64 << 20


def expected_experts(m: int, e: int, a: int) -> float:
    """Distinct experts that m tokens with top-a of e experts touch on average under uniform routing (at least 1).
    Rule 1's r and rule 2's CTA count use it: min(E, M*A) overestimated small batches (Mixtral M = 4: 8 against 5.5;
    the split picks with min(E, M*A) took 1.032 of the fastest split's time, with this 1.016)."""
    return max(1.0, round(e * (1.0 - (1.0 - min(1.0, a / e)) ** max(1, m)), 6))


def one_pair_blocks(m: int, a: int, expert_bytes: float) -> bool:
    """Rule 8: whether fused_moe runs M tokens of top-a experts with one pair per 16-row block and no aligned list
    (choose_config's one_pair). expert_bytes: one expert's gate/up and down weights. Always at M = 1 (a token's
    experts are distinct); up to ONE_PAIR_MAX_TOKENS tokens where the blocks that repeat an expert, (M - 1) * a of
    them when every token chooses the same experts, read at most ONE_PAIR_EXTRA_BYTES again."""
    return m == 1 or (m <= ONE_PAIR_MAX_TOKENS and (m - 1) * a * expert_bytes <= ONE_PAIR_EXTRA_BYTES)


def down_pair_order(bits: int, block_m: int) -> bool:
    """Whether fused_moe's down GEMM reads its activations in pair order (fused_moe_gemm's a_pair_order): 4-bit
    weights on 16-row blocks, whose loops then skip re-pairing them: down rows 2-8% faster. The tc kernel of 64- and
    128-row blocks ran 4-5% slower with them, though its loop is 32 of 365 instructions shorter."""
    return bits == 4 and block_m == 16


class _Problem:
    """One phase's rows, touched experts and the grid of each block size on one GPU."""

    def __init__(self, m, e, a, n, gpu: GpuInfo, one_pair=False):
        self.touched = max(1, m * a) if one_pair else expected_experts(m, e, a)  # one_pair: a block per pair
        self.rows = max(1, m * a) / self.touched
        self.m, self.e, self.a, self.n, self.gpu = m, e, a, n, gpu

    def shape(self, block_m: int) -> GemmConfig:
        if self.gpu.hopper and block_m in HOPPER_SHAPES:
            return HOPPER_SHAPES[block_m]
        return KERNEL_SHAPES[block_m]

    def ctas(self, cfg: GemmConfig) -> int:
        """CTAs of the unsplit grid: touched experts x blocks of their average row count x column tiles."""
        blocks = self.touched * -(-int(self.rows + 0.999) // cfg.block_m)
        return math.ceil(blocks * -(-self.n // cfg.block_n))

    def slots(self, cfg: GemmConfig, act_order: bool) -> int:
        return cfg.ctas_per_sm(act_order) * self.gpu.sm_count

    def split(self, cfg: GemmConfig, k: int, act_order: bool) -> int:
        """Rule 2."""
        ctas, slots = self.ctas(cfg), self.slots(cfg, act_order)
        most = max_split_k(k, cfg.ku)
        stages = -(-max(1, k // 32) // cfg.ku)
        cost = lambda grid, s: -(-grid * s // slots) * (-(-stages // s) + SPLIT_FILL_STAGES)  # grid: unsplit CTAs
        if cfg.kind == "tc":
            # a 64- or 128-row tile's fp32 partials cost more than the fill stages: on grids of a wave or more a
            # 2-way split through the workspace took 1.04-1.57 of the unsplit time (Qwen2-57B-A14B down M = 256:
            # 310.6 against 212.8 us). 2 slices in a cluster pay where they fill a last wave (TC_CLUSTER_GAIN); for
            # them the grid is counted with the spread of rows per expert, which puts a second block on many experts
            if not act_order and CLUSTER_SPLIT <= most and splits_in_cluster(cfg, CLUSTER_SPLIT, self.gpu.hopper):
                spread = math.ceil(self.blocks(cfg.block_m) * -(-self.n // cfg.block_n))
                if spread >= slots:
                    return CLUSTER_SPLIT if cost(spread, CLUSTER_SPLIT) <= TC_CLUSTER_GAIN * cost(spread, 1) else 1
            if ctas >= slots:
                return 1
        if cfg.kind == "swapped" and cfg.block_m >= 48 and ctas >= slots:
            # their partials go through the workspace too: 48-row blocks split 2 ways on grids of 2.5-3.4 waves took
            # 1.19-1.46 of the unsplit time (Qwen1.5-MoE-A2.7B gate/up M = 512: 177.2 against 121.4 us, H200); 32-row
            # blocks, which the rules never pick, keep the estimate their tuned entries were timed with
            return 1
        costs = [cost(ctas, s) for s in range(1, most + 1)]
        return next(s for s, c in enumerate(costs, 1) if c <= SPLIT_TOLERANCE * min(costs))

    def blocks(self, block_m: int) -> float:
        """Blocks of block_m rows an aligned list (not one pair per block) holds on average under uniform routing:
        each expert's rows are Binomial(M, A/E) (the down phase: M*A rows, A = 1, nearly the same spread), and an
        expert takes ceil(rows / block_m) blocks; the tail past each multiple of block_m by the normal approximation.
        The average row count alone misses the second block of every expert just past a multiple (Mixtral-8x7B down
        M = 512: 128 +- 10 rows, 1.5 blocks per expert)."""
        p = min(1.0, self.a / self.e)
        mean, sd = self.m * p, math.sqrt(self.m * p * (1.0 - p))
        per_expert = 1.0 - (1.0 - p) ** self.m  # at least one row
        edge = block_m
        while edge < mean + 8.0 * sd + 1.0:
            per_expert += (mean > edge) if sd == 0.0 else 0.5 * math.erfc((edge + 0.5 - mean) / (sd * math.sqrt(2.0)))
            edge += block_m
        return self.e * per_expert

    def warps_along_k(self, cfg: GemmConfig, k: int, act_order: bool) -> GemmConfig:
        """Rule 4: SPLIT_WARPS_SHAPES[block_m] in place of a split `cfg` where its warps' slices are at most
        WARPS_K_EXTRA_STAGES longer, except a 2-way split whose grid fits one wave with at most 8 rows per expert."""
        alt = SPLIT_WARPS_SHAPES.get(cfg.block_m)
        if alt is None or cfg.kind != "reg" or cfg.split_k < 2 or WARPS_K_EXTRA_STAGES < 0:
            return cfg
        if cfg.split_k == 2 and 2 * self.ctas(cfg) <= self.slots(cfg, act_order) and self.rows <= 8:
            # on such rows the plain split took 0.90-1.06 of the warps-along-K time, 0.955 on the geometric mean
            # (Mixtral-8x7B down M = 16: 65.5 against 72.2 us)
            return cfg
        stages = -(-max(1, k // 32) // alt.ku)
        if -(-stages // alt.warps_k) > -(-stages // cfg.split_k) + WARPS_K_EXTRA_STAGES:
            return cfg
        return replace(alt, split_k=1)


def split_k_estimate(shape: GemmConfig, m: int, e: int, a: int, k: int, n: int, *, gpu: GpuInfo,
                     act_order: bool = False, one_pair: bool = False) -> int:
    """Rule 2's split for `shape` on this problem (arguments as choose_config's): for tests and tuning that run
    other shapes than the catalogue's."""
    return _Problem(m, e, a, n, gpu, one_pair).split(shape, k, act_order)


def choose_config(m: int, e: int, a: int, k: int, n: int, bits: int, group_size: int, block_m: int | None = None,
                  *, act_order: bool = False, pair_a: bool = False, gpu: GpuInfo | None = None,
                  split_k: int | None = None, warps_k: int | None = None, tuned: bool = True,
                  one_pair: bool = False) -> GemmConfig:
    """The configuration one GEMM phase launches: pass it to fused_moe_gemm(..., config=) and align with its
    block_m (`moe_align_block_size(topk_ids, config.block_m, E)`).

    m: rows of the activation (tokens M for gate/up; the down phase passes m = M*A rows and a = 1), e: experts E,
    a: top-k A of this phase, k: K, n: N, bits, group_size: G (-1 = one group).
    block_m: the align block size already used (16, 32, 48, 64 or 128); None = rules 1 and 3 or the tuned table.
    act_order: the weights carry g_idx. pair_a: the activations are in pair order (fused_moe_gemm's a_pair_order).
    gpu: the target (`GpuInfo`); None = the current device (a RuntimeError without a GPU).
    split_k: force the K split of the block size's shape (with block_m; rule 2 skipped, rules 4-6 apply).
    warps_k: with split_k, also settle rule 4: 1 keeps the plain split, the warps-along-K shape's warps_k
    (SPLIT_WARPS_SHAPES, 16-row blocks) runs that shape with split_k CTAs per tile; None lets rule 4 decide. How
    `tune` names its candidates. tuned: False ignores the tuned table (the rules alone). one_pair: each pair has a
    16-row block of its own and the launch reads no aligned list (fused_moe_gemm with sorted_token_ids None, as
    fused_moe runs where `one_pair_blocks` says); block_m None or 16 (rule 7).
    """
    if gpu is None:
        gpu = gpu_info()
    elif not isinstance(gpu, GpuInfo):
        raise TypeError(f"gpu: expected a GpuInfo or None, got {type(gpu).__name__}")
    if block_m is not None and block_m not in SUPPORTED_BLOCK_M:
        raise ValueError(f"block_m: expected one of {SUPPORTED_BLOCK_M} or None, got {block_m!r}")
    if one_pair:  # one pair per block: the block size is given
        if block_m not in (None, DECODE_WK_ONE_PAIR.block_m):
            raise ValueError(f"one_pair: expected block_m={DECODE_WK_ONE_PAIR.block_m} or None with it (one pair per "
                             f"16-row block), got block_m={block_m!r}")
        block_m = DECODE_WK_ONE_PAIR.block_m
    if split_k is not None and (block_m is None or isinstance(split_k, bool) or not isinstance(split_k, int)
                                or not 1 <= split_k <= MAX_SPLIT):
        raise ValueError(f"split_k: expected an int in [1, {MAX_SPLIT}] with a block_m, or None, got "
                         f"split_k={split_k!r}, block_m={block_m!r}")
    if warps_k is not None and (split_k is None or warps_k not in warps_k_choices(block_m)):
        raise ValueError(f"warps_k: expected one of {warps_k_choices(block_m)} with a split_k, or None, got "
                         f"warps_k={warps_k!r}, split_k={split_k!r}, block_m={block_m!r}")
    problem = _Problem(m, e, a, n, gpu, one_pair)
    entry = tuned_entry(gpu.name, e, k, n, bits, group_size, m * a) if tuned and split_k is None else None
    if block_m is None:
        block_m = entry[0] if entry is not None else _block_size(problem, k)
    base = problem.shape(block_m)
    if split_k is not None:
        split, wk = split_k, warps_k
    elif entry is not None and entry[0] == block_m:
        split, wk = entry[1], entry[2]
    else:
        split, wk = problem.split(base, k, act_order), None
    if wk is None:  # rule 4
        cfg = problem.warps_along_k(replace(base, split_k=split), k, act_order)
    else:
        cfg = replace(base if wk == 1 else SPLIT_WARPS_SHAPES[block_m], split_k=split)
    if one_pair and cfg == replace(DECODE_WK, split_k=cfg.split_k):  # rule 7
        # H100, M = 1, the whole layer (fused_moe): 0.946-0.973 of the time on Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B and
        # DeepSeek-V2-Lite (five interleaved rounds), faster than 64-k stages on gate/up alone (docs/heuristic.md)
        cfg = replace(DECODE_WK_ONE_PAIR, split_k=cfg.split_k)
    return fallback(cfg, act_order=act_order, hopper=gpu.hopper, pair_a=pair_a)


def _block_size(problem: _Problem, k: int) -> int:
    """Rules 1 and 3."""
    rows = problem.rows
    block_m = (16 if rows <= ROWS_16_MAX else 48 if problem.gpu.hopper and rows <= ROWS_48_MAX
               else 64 if rows <= ROWS_64_MAX else 128)
    if block_m in (48, 64) and problem.split(problem.shape(block_m), k, False) > 1:
        big = problem.shape(128)
        ctas, slots = problem.ctas(big), problem.slots(big, False)
        if ctas >= FULL_WAVE * slots * -(-ctas // slots):
            return 128
    if block_m > 16 and rows <= SPLIT_TC_ROWS_MAX:
        shape = problem.shape(block_m)
        if problem.ctas(shape) < problem.gpu.sm_count and problem.split(shape, k, False) > SPLIT_TC_MAX:
            return 16
    return block_m
