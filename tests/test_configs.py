"""Tile choice: the catalogue, the heuristic, the GPU description and the tuned tables. CPU only."""
import copy
import dataclasses
import itertools
import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cupy_moe import configs, reference
from cupy_moe.align import moe_align_block_size
from cupy_moe.configs import catalogue, heuristic, tuned
from cupy_moe.gemm import fused_moe_gemm
from cupy_moe.models import MODELS
from cupy_moe.weights import StackedGptqWeight

H200 = configs.GpuInfo("Test H200", "sm_90a", 132)    # the GPU the rules were measured on
PORTABLE = configs.GpuInfo("Test sm_90", "sm_90", 132)  # the same SMs without the Hopper kernels
DATA = Path(__file__).resolve().parent / "data"


def choose(*args, **kw):
    """choose_config on the H200 description unless told otherwise."""
    kw.setdefault("gpu", H200 if kw.pop("hopper", True) else PORTABLE)
    return configs.choose_config(*args, **kw)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A GPU whose tables live in a fresh user cache folder (and ship none)."""
    monkeypatch.setenv("CUPY_MOE_CACHE_DIR", str(tmp_path))
    return configs.GpuInfo("Fake GPU", "sm_90a", 132)


def test_heuristic_block_sizes_follow_rows_per_expert():
    assert choose(1, 8, 2, 4096, 28672, 4, 128).block_m == 16
    assert choose(64, 8, 2, 4096, 28672, 4, 128).block_m == 16       # 16 rows per expert
    assert choose(96, 8, 2, 4096, 28672, 4, 128).block_m == 16       # 24 rows per expert
    assert choose(100, 8, 2, 4096, 28672, 4, 128).block_m == 48      # 25 rows per expert (sm_90a)
    assert choose(144, 8, 2, 4096, 28672, 4, 128).block_m == 48      # 36 rows per expert (sm_90a)
    assert choose(148, 8, 2, 4096, 28672, 4, 128).block_m == 64      # 37 rows per expert
    assert choose(100, 8, 2, 4096, 28672, 4, 128, hopper=False).block_m == 64  # no 48-row block off sm_90a
    assert choose(224, 8, 2, 4096, 28672, 4, 128).block_m == 64      # 56 rows per expert
    assert choose(232, 8, 2, 4096, 28672, 4, 128).block_m == 128     # 58 rows per expert
    assert choose(4096, 8, 2, 4096, 28672, 4, 128).block_m == 128    # 1024 rows per expert
    cfg = choose(1, 8, 2, 4096, 4096, 4, 128)
    assert 1 < cfg.split_k <= 16  # few tiles: split-K fills the SMs


def test_tc_tiles_split_only_grids_under_one_wave():
    # Qwen2-57B-A14B down M = 256: 2048 rows on 64 experts, 64-row tiles, 896 CTAs (3.4 waves): not split
    cfg = choose(2048, 64, 1, 2560, 3584, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 64, 1)
    # Mixtral-8x22B down M = 128: 8 experts x 24 column tiles = 192 CTAs, under one wave (2 per SM): split
    cfg = choose(256, 8, 1, 16384, 6144, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m) == ("tc", 64) and cfg.split_k > 1


def test_tc_grids_of_a_wave_or_more_split_in_a_cluster_where_that_fills_the_last_wave():
    # Mixtral-8x22B down M = 256: 64 rows on each of 8 experts, 8 x 24 = 192 CTAs of 128 rows (1.45 waves): 2 slices
    # in a cluster, 3 waves of half the stages
    cfg = choose(512, 8, 1, 16384, 6144, 4, 128)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 128, 2)
    assert configs.splits_in_cluster(cfg, cfg.split_k, hopper=True)
    # Mixtral-8x7B down M = 512: 128 +- 10 rows per expert put a second block on about half the experts: 190 CTAs,
    # not the 128 of the average row count
    assert choose(1024, 8, 1, 14336, 4096, 4, 128).split_k == 2
    # Mixtral-8x7B down M = 256: 128 CTAs, one wave; Mixtral-8x22B down M = 1024: 478 CTAs, 3.6 waves: whole
    assert choose(512, 8, 1, 14336, 4096, 4, 128).split_k == 1
    assert choose(2048, 8, 1, 16384, 6144, 4, 128).split_k == 1
    # without clusters for the tc tile (the portable build) or with act-order (moe_gemm shapes): whole, as before
    assert choose(512, 8, 1, 16384, 6144, 4, 128, hopper=False).split_k == 1
    assert choose(512, 8, 1, 16384, 6144, 4, 128, act_order=True).split_k == 1
    assert not configs.splits_in_cluster(configs.PREFILL_128, 2, hopper=False)
    assert not configs.splits_in_cluster(configs.PREFILL_128, 3, hopper=True)


@pytest.mark.parametrize("m,e,a,block_m", [(512, 8, 2, 128), (256, 8, 2, 128), (1024, 128, 8, 64), (3, 8, 2, 16),
                                           (64, 1, 1, 128), (4096, 60, 4, 128)])
def test_block_count_follows_the_spread_of_rows_per_expert(m, e, a, block_m):
    """The tc split counts blocks with the binomial spread of each expert's rows: the mean of
    sum(ceil(rows / block_m)) over random uniform routings."""
    rng = np.random.default_rng(m + e)
    counts = [np.bincount(np.stack([rng.permutation(e)[:a] for _ in range(m)]).ravel(), minlength=e)
              for _ in range(200)]
    simulated = np.mean([np.ceil(c / block_m).sum() for c in counts])
    estimate = heuristic._Problem(m, e, a, 256, H200).blocks(block_m)
    assert estimate == pytest.approx(simulated, rel=0.03)


def test_a_split_64_row_pick_becomes_a_full_wave_of_128_row_tiles():
    # Mixtral-8x7B down M = 128: 32 rows on each of 8 experts. 64-row tiles: 128 CTAs, split; 128-row tiles: 128
    # CTAs, 0.97 of one wave -> 128 rows unsplit
    cfg = choose(256, 8, 1, 14336, 4096, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 128, 1)
    # forced 64 rows (an align already made) keeps them, split
    cfg = choose(256, 8, 1, 14336, 4096, 4, 128, block_m=64, hopper=False)
    assert (cfg.block_m, cfg.split_k > 1) == (64, True)
    # Mixtral-8x22B down M = 128: 192 CTAs of 128 rows fill 0.73 of two waves -> 64 rows, split (test above)
    assert choose(256, 8, 1, 16384, 6144, 4, 128, hopper=False).block_m == 64
    # the gate/up phase of the same layer: 896 CTAs of 64 rows, unsplit, stays 64
    assert choose(128, 8, 2, 4096, 28672, 4, 128, hopper=False).block_m == 64


def test_small_tc_grids_that_would_split_far_take_16_row_blocks():
    # a shared expert (one expert) at M = 64: 8 CTAs of 128 rows, split 15 ways -> 16-row blocks
    assert choose(64, 1, 1, 5632, 2048, 4, 128).block_m == 16
    # M = 256, K = 2048, N = 11264: 88 CTAs of 128 rows (fewer than the 132 SMs), 3 ways -> 16-row blocks
    assert choose(256, 1, 1, 2048, 11264, 4, 128).block_m == 16
    # M = 1024: split 2 ways at most -> the tc tile stays
    cfg = choose(1024, 1, 1, 5632, 2048, 4, 128)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 128, 2)
    # Mixtral-8x22B down M = 128: 192 CTAs of 64 rows, more than the SMs -> stays 64 rows, split 4 ways; on sm_90a
    # 48-row blocks of the swapped kernel, split 4 ways as well
    cfg = choose(256, 8, 1, 16384, 6144, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 64, 4)
    cfg = choose(256, 8, 1, 16384, 6144, 4, 128)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("swapped", 48, 4)


def test_split_estimate_counts_expected_experts_and_ctas_per_sm(fake_gpu):
    # expected distinct experts under uniform routing: Mixtral M = 4, top-2 of 8 -> 8 * (1 - 0.75^4) = 5.47, not 8
    assert configs.expected_experts(4, 8, 2) == pytest.approx(8 * (1 - 0.75**4))
    assert configs.expected_experts(1, 256, 8) == pytest.approx(8)
    assert configs.expected_experts(4096, 8, 2) == 8
    # 4 CTAs per SM for the 16-row instances compiled for it (all but act-order)
    assert configs.DECODE.ctas_per_sm(act_order=False) == 4
    assert configs.DECODE.name_expression(False, 4, False, 32).endswith(", 0, 4, false>")   # group mode 0: same bound
    assert configs.DECODE.name_expression(False, 8, False, 128).endswith(", 1, 4, false>")  # 8-bit: the same bound
    assert configs.DECODE.ctas_per_sm(act_order=True) == 3
    assert configs.DECODE_32.ctas_per_sm(act_order=False) == 3
    # group mode 1 needs whole stages: G and K multiples of 32 * ku
    assert configs.DECODE.group_mode(False, 128, 4096) == 1
    assert configs.DECODE.group_mode(False, 128, 4160) == 0
    assert configs.DECODE.group_mode(False, 64, 4096) == 0
    # a tuned (block_m, split_k) is used as stored; a 16-row split that 4 warps along K cover runs as those
    configs.save_tuned("Fake GPU", {configs.tuning_key(8, 4096, 28672, 4, 128, 2): {"block_m": 16, "split_k": 7}})
    tuned = choose(1, 8, 2, 4096, 28672, 4, 128, gpu=fake_gpu)
    assert (tuned.block_m, tuned.block_n, tuned.split_k, tuned.warps_k) == (16, 128, 7, 1)
    configs.save_tuned("Fake GPU", {configs.tuning_key(8, 4096, 28672, 4, 128, 2): {"block_m": 16, "split_k": 4}})
    tuned = choose(1, 8, 2, 4096, 28672, 4, 128, gpu=fake_gpu)
    assert (tuned.block_m, tuned.block_n, tuned.split_k, tuned.warps_k) == (16, 32, 1, 4)


def test_hopper_runs_the_swapped_kernel_for_32_row_blocks():
    # Mixtral-8x7B gate/up M = 88 at 32-row blocks (asked for; the heuristic picks 16): on sm_90a the swapped
    # kernel, 256 columns
    ws = choose(88, 8, 2, 4096, 28672, 4, 128, block_m=32, hopper=True)
    assert (ws.kind, ws.block_m, ws.block_n, ws.short_name) == ("swapped", 32, 256, "32s")
    assert choose(88, 8, 2, 4096, 28672, 4, 128, block_m=32, hopper=False).kind == "reg"
    assert choose(1, 8, 2, 4096, 28672, 4, 128, hopper=True).kind == "reg"  # 16-row blocks stay
    # DeepSeek-V2-Lite down M = 256: 64 blocks x 8 tiles of 256 columns, 22 stages of 64 k; 2 CTAs per SM (264
    # slots), with SPLIT_FILL_STAGES = 4: one slice (2 waves of 22 + 4) beats 2 (4 x 15) and 3 (6 x 12)
    assert choose(1536, 64, 1, 1408, 2048, 4, 128, hopper=True).split_k == 1
    # act-order or another GPU: the portable shape of the block size, split kept; the plan says so itself
    cfg = configs.fallback(ws, act_order=True, hopper=True)
    assert cfg.kind == "reg" and cfg.block_m == 32 and cfg.split_k == ws.split_k
    assert cfg.name_expression(False, 4, True, 128).startswith("moe_gemm<")
    assert choose(88, 8, 2, 4096, 28672, 4, 128, block_m=32, act_order=True) == replace(
        choose(88, 8, 2, 4096, 28672, 4, 128, block_m=32, act_order=True, hopper=False), split_k=cfg.split_k)
    assert choose(88, 8, 2, 4096, 28672, 4, 128, block_m=32, act_order=True).kind == "reg"
    assert choose(88, 8, 2, 4096, 28672, 4, 128, block_m=32, pair_a=True).kind == "reg"
    name, smem = ws.name_expression(False, 4, False, 128, hopper=True), ws.smem_bytes(4, hopper=True)
    assert name == f"{configs.TEMPLATES['swapped']}<false, 4, 32, 2, 6, 2>" and smem == 6 * 2 * 7168 + 1024
    assert name in configs.all_name_expressions("sm_90a") and name not in configs.all_name_expressions("sm_80")


def test_split_k_weighs_waves_against_short_slices(monkeypatch):
    monkeypatch.setattr(heuristic, "WARPS_K_EXTRA_STAGES", -1)  # the estimate itself (warps along K: the next test)
    # Mixtral-8x7B M = 1 (2 experts) on 528 decode slots (4 CTAs per SM): gate/up 448 CTAs of 32 stages fit one
    # wave (estimate 36; 2 slices 2 waves of 16 stages, 40); down about 1.9 experts x 32 tiles = 60 CTAs of 112
    # stages: 8 slices (one wave); with act-order (3 CTAs per SM, 396 slots) 8 slices would take two waves, so 6
    assert choose(1, 8, 2, 4096, 28672, 4, 128).split_k == 1
    # gate/up M = 64: 1792 CTAs of 32 stages, whole 4 waves x 36 = 144, 2 slices 7 waves x 20 = 140: within 5%, so
    # whole (with 2 fill stages, 136 against 126, it split, and 16 x 32 with warps along K ran 1.15x the time)
    assert choose(64, 8, 2, 4096, 28672, 4, 128).split_k == 1
    assert choose(2, 8, 1, 14336, 4096, 4, 128).split_k == 8
    assert choose(2, 8, 1, 14336, 4096, 4, 128, act_order=True).split_k == 6
    # the 128 x 256 prefill tile (one CTA per SM): 256 CTAs of 448 steps are two full waves, no split
    assert choose(1024, 8, 2, 14336, 4096, 4, 128).split_k == 1
    # slices keep at least 2 stages: K = 768 (6 stages of 128 k) splits at most 3 ways
    assert choose(1, 128, 8, 768, 2048, 4, 128).split_k <= 3


def test_large_splits_of_16_row_blocks_become_warps_along_k():
    # Mixtral-8x7B down M = 64 (16 rows per expert): 2 ways; one 16 x 32 CTA of 4 warp slices instead
    cfg = choose(128, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_m, cfg.block_n, cfg.warps_k, cfg.split_k) == (16, 32, 4, 1)
    # Mixtral-8x7B down M = 16 (4 rows per expert, the swapped path): 2 ways, 2 x 253 CTAs fit one wave of 528 slots:
    # the split 16 x 128 stays
    cfg = choose(32, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_n, cfg.warps_k, cfg.split_k) == (128, 1, 2)
    # Mixtral-8x7B down M = 4: 3 ways; 16 x 32 with warps along K
    cfg = choose(8, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_m, cfg.block_n, cfg.warps_k, cfg.split_k, cfg.threads) == (16, 32, 4, 1, 128)
    # Qwen3-30B-A3B down M = 1 (3 slices of 2 stages): the same
    cfg = choose(8, 128, 1, 768, 2048, 4, 128)
    assert (cfg.warps_k, cfg.split_k, cfg.short_name) == (4, 1, "16k")
    assert cfg.name_expression(False, 4, False, 128) == "moe_gemm<false, 4, 1, 1, 1, 4, 1, 4, 2, 1, 4, false>"
    assert cfg.name_expression(False, 4, False, 128) in configs.all_name_expressions("sm_80")
    # Mixtral-8x7B down M = 1 (8 slices of 14 stages; 4 warp slices would be 28) keeps the 16 x 128 shape
    cfg = choose(2, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_n, cfg.warps_k, cfg.split_k) == (128, 1, 8)
    # Qwen1.5-MoE-A2.7B gate/up M = 1: 6 slices of 3 stages become 4 warp slices of 4
    cfg = choose(1, 60, 4, 2048, 2816, 4, 128)
    assert (cfg.block_n, cfg.warps_k, cfg.split_k) == (32, 4, 1)
    # Mixtral-8x7B gate/up M = 1 (no split) and 64-row blocks keep their shapes
    assert choose(1, 8, 2, 4096, 28672, 4, 128).warps_k == 1
    assert choose(256, 8, 2, 4096, 28672, 4, 128).warps_k == 1


def test_tuning_key_buckets_pairs_by_powers_of_two():
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 1) == "E8_K4096_N28672_b4_G128_P1"
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 5).endswith("_P8")
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 8).endswith("_P8")
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 9).endswith("_P16")


def test_tuned_entry_wins_and_survives_a_reload(fake_gpu, tmp_path):
    key = configs.tuning_key(8, 4096, 28672, 4, 128, 2)
    path = configs.save_tuned("Fake GPU", {key: {"block_m": 64, "split_k": 3, "time_us": 10.0}})
    assert path == tmp_path / "Fake_GPU.json"
    assert json.loads(path.read_text()) == {"gpu": "Fake GPU",
                                            "entries": {key: {"block_m": 64, "split_k": 3, "time_us": 10.0}}}
    cfg = choose(1, 8, 2, 4096, 28672, 4, 128, gpu=fake_gpu)
    assert (cfg.block_m, cfg.split_k) == (64, 3)
    # an align block size forced by the caller that differs from the tuned one keeps the heuristic
    assert choose(1, 8, 2, 4096, 28672, 4, 128, block_m=16, gpu=fake_gpu).block_m == 16
    # tuned=False: the rules alone; another GPU: its own table (none)
    assert choose(1, 8, 2, 4096, 28672, 4, 128, gpu=fake_gpu, tuned=False) == choose(1, 8, 2, 4096, 28672, 4, 128)
    assert choose(1, 8, 2, 4096, 28672, 4, 128).block_m == 16
    # a second save merges into the file
    other = configs.tuning_key(8, 4096, 4096, 4, 128, 2)
    configs.save_tuned("Fake GPU", {other: {"block_m": 16, "split_k": 2, "time_us": 5.0}})
    assert set(json.loads(path.read_text())["entries"]) == {key, other}
    assert (choose(1, 8, 2, 4096, 28672, 4, 128, gpu=fake_gpu).block_m,
            choose(1, 8, 2, 4096, 4096, 4, 128, gpu=fake_gpu).split_k) == (64, 2)


def test_warps_k_settles_rule_4_for_forced_splits_and_tuned_entries(fake_gpu):
    """Mixtral-8x7B down at M = 32 (64 rows): rule 4 turns a 16-row split of 3 into the warps-along-K shape;
    warps_k=1 keeps the plain split, warps_k=4 asks for the other shape; a tuned entry's warps_k does the same,
    an entry without one leaves rule 4 to decide."""
    args = (64, 8, 1, 14336, 4096, 4, 128)
    assert configs.warps_k_choices(16) == (1, 4) and configs.warps_k_choices(64) == (1,)
    ruled = choose(*args, 16, gpu=fake_gpu, split_k=3)
    assert (ruled.warps_k, ruled.split_k) == (4, 1)  # rule 4
    plain = choose(*args, 16, gpu=fake_gpu, split_k=3, warps_k=1)
    assert plain == replace(configs.DECODE, split_k=3)
    assert choose(*args, 16, gpu=fake_gpu, split_k=2, warps_k=4) == replace(configs.DECODE_WK, split_k=2)
    key = configs.tuning_key(8, 14336, 4096, 4, 128, 64)
    configs.save_tuned("Fake GPU", {key: {"block_m": 16, "split_k": 3, "warps_k": 1, "time_us": 1.0}})
    assert choose(*args, gpu=fake_gpu) == plain
    configs.save_tuned("Fake GPU", {key: {"block_m": 16, "split_k": 1, "warps_k": 4, "time_us": 1.0}})
    assert choose(*args, gpu=fake_gpu) == replace(configs.DECODE_WK, split_k=1)
    configs.save_tuned("Fake GPU", {key: {"block_m": 16, "split_k": 3, "time_us": 1.0}})  # no warps_k: rule 4
    assert choose(*args, gpu=fake_gpu) == ruled
    with pytest.raises(ValueError, match=r"warps_k: expected one of \(1,\) with a split_k, or None, got warps_k=4, "
                                         r"split_k=1, block_m=64"):
        choose(*args, 64, gpu=fake_gpu, split_k=1, warps_k=4)
    with pytest.raises(ValueError, match=r"warps_k: expected one of \(1, 4\) with a split_k, or None, got warps_k=1, "
                                         r"split_k=None"):
        choose(*args, 16, gpu=fake_gpu, warps_k=1)
    with pytest.raises(ValueError, match=r"entries: expected .* if given, a warps_k of 1 or the warps-along-K "
                                         r"shape's \(4 for block_m 16\)"):
        configs.save_tuned("Fake GPU", {key: {"block_m": 64, "split_k": 1, "warps_k": 4}})


def test_one_pair_per_block_runs_warps_along_k_in_64k_stages(fake_gpu):
    """Rule 7: with one pair per block (M = 1, no aligned list) the warps-along-K shape, from rule 4 or from a
    tuned entry, runs in 64-k stages; a plain split keeps its shape; one_pair means 16-row blocks."""
    args = (64, 8, 1, 14336, 4096, 4, 128)
    one = replace(configs.DECODE_WK_ONE_PAIR, split_k=1)
    assert (one.ku, one.warps_k, one.stages) == (2, 4, configs.DECODE_WK.stages)
    assert choose(*args, 16, gpu=fake_gpu, split_k=3, one_pair=True) == one  # rule 4, then 7
    assert choose(*args, 16, gpu=fake_gpu, split_k=3, warps_k=1, one_pair=True) == replace(configs.DECODE, split_k=3)
    configs.save_tuned("Fake GPU", {configs.tuning_key(8, 14336, 4096, 4, 128, 64):
                                    {"block_m": 16, "split_k": 1, "warps_k": 4, "time_us": 1.0}})
    assert choose(*args, 16, gpu=fake_gpu, one_pair=True) == one
    assert choose(*args, None, gpu=fake_gpu, one_pair=True) == one  # the block size one pair per block implies
    assert choose(*args, 16, gpu=fake_gpu) == replace(configs.DECODE_WK, split_k=1)
    for block_m in (32, 64):
        with pytest.raises(ValueError, match=rf"one_pair: expected block_m=16 or None with it \(one pair per 16-row "
                                             rf"block\), got block_m={block_m}"):
            choose(*args, block_m, gpu=fake_gpu, one_pair=True)


def test_one_pair_blocks_at_one_token_and_at_a_few_tokens_of_small_experts():
    """Rule 8: M = 1 always; up to ONE_PAIR_MAX_TOKENS tokens where the blocks that repeat an expert, if every token
    chose the same experts, would read at most ONE_PAIR_EXTRA_BYTES again; never more tokens."""
    from cupy_moe.configs.heuristic import ONE_PAIR_EXTRA_BYTES, ONE_PAIR_MAX_TOKENS
    from cupy_moe.models import BENCHMARK_MODELS, get_model

    def one_pair(model, m):
        shape = get_model(model)
        return configs.one_pair_blocks(m, shape.top_k, shape.expert_nbytes(4, 128))
    assert ONE_PAIR_MAX_TOKENS == 4
    assert configs.one_pair_blocks(1, 8, 1e12)  # a token's experts are distinct: nothing is read twice
    ones = {model: [m for m in range(1, 9) if one_pair(model, m)] for model in BENCHMARK_MODELS}
    assert ones == {**{model: [1] for model in BENCHMARK_MODELS},
                    "Qwen3-30B-A3B": [1, 2, 3, 4],      # 2.45 MB experts, top-8: 59 MB reread at M = 4
                    "Qwen1.5-MoE-A2.7B": [1, 2, 3, 4],  # 4.49 MB, top-4: 54 MB at M = 4
                    "DeepSeek-V2-Lite": [1, 2, 3]}      # 4.49 MB, top-6: 81 MB at M = 4
    assert not configs.one_pair_blocks(5, 1, 1.0)  # the token bound, however few bytes
    assert configs.one_pair_blocks(4, 8, ONE_PAIR_EXTRA_BYTES / 24)
    assert not configs.one_pair_blocks(4, 8, ONE_PAIR_EXTRA_BYTES / 24 * 1.01)


def test_one_pair_split_estimate_counts_a_block_per_pair():
    """Rule 7: with one pair per block the split estimate counts P blocks of one row, not the touched experts: 4
    tokens of top-8 are estimated as one token of top-32."""
    gpu = configs.GpuInfo("Test H100", "sm_90a", 132)
    shape = configs.DECODE
    for k, n in ((2048, 1536), (768, 2048), (7168, 4096)):
        one = configs.split_k_estimate(shape, 4, 128, 8, k, n, gpu=gpu, one_pair=True)
        assert one == configs.split_k_estimate(shape, 1, 128, 32, k, n, gpu=gpu)
    # the aligned list counts the 29.1 experts 4 tokens touch on average: 350 CTAs against 384 at N = 1536
    assert configs.split_k_estimate(shape, 4, 128, 8, 4096, 1536, gpu=gpu, one_pair=True) == 1
    assert configs.split_k_estimate(shape, 4, 128, 8, 4096, 1536, gpu=gpu) == 3


def test_missing_problem_uses_the_heuristic_silently(fake_gpu):
    heuristic_pick = choose(1, 8, 2, 4096, 4096, 4, 128, gpu=fake_gpu)  # no table yet
    configs.save_tuned("Fake GPU", {"E1_K32_N32_b4_G32_P1": {"block_m": 16, "split_k": 1}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table without this problem: no warning
        assert choose(1, 8, 2, 4096, 4096, 4, 128, gpu=fake_gpu) == heuristic_pick


def test_shipped_and_user_tables_merge_user_first(tmp_path):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    a, b = configs.tuning_key(8, 4096, 4096, 4, 128, 2), configs.tuning_key(8, 4096, 4096, 4, 128, 4)
    configs.save_tuned("GPU X", {a: {"block_m": 16, "split_k": 2, "time_us": 1.0},
                                 b: {"block_m": 64, "split_k": 1, "time_us": 2.0}}, directory=shipped)
    configs.save_tuned("GPU X", {b: {"block_m": 128, "split_k": 1, "time_us": 1.5}}, directory=user)
    merged = configs.load_table("GPU X", (shipped, user))
    assert (merged[a]["block_m"], merged[b]["block_m"]) == (16, 128)
    assert configs.load_table("GPU X", (shipped,))[b]["block_m"] == 64
    assert configs.load_table("GPU Y", (shipped, user)) == {}
    assert configs.table_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert configs.table_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    with pytest.raises(ValueError, match="gpu: expected a device name"):
        configs.table_file_name(" -- ")


def test_shipped_tables_are_valid_tables_of_their_gpu():
    for path in sorted(configs.shipped_dir().glob("*.json")):
        data = json.loads(path.read_text())
        assert path.name == configs.table_file_name(data["gpu"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(tuned.read_table(path, data["gpu"])) == len(data["entries"])


def test_invalid_or_corrupt_tables_are_ignored(fake_gpu, tmp_path):
    key = configs.tuning_key(8, 4096, 4096, 4, 128, 2)
    with pytest.raises(ValueError, match=r"entries: expected a block_m of \(16, 32, 48, 64, 128\)"):
        configs.save_tuned("Fake GPU", {key: {"block_m": 96, "split_k": 3}})
    path = tmp_path / "Fake_GPU.json"
    path.write_text(json.dumps({"gpu": "Fake GPU", "entries": {key: {"block_m": 96, "split_k": 3}}}))
    with pytest.warns(UserWarning, match="ignoring 1 entries"):
        assert choose(1, 8, 2, 4096, 4096, 4, 128, gpu=fake_gpu).block_m == 16
    for text, why in (("{not json", "ignoring the tuned table"), ('{"Fake GPU": {}}', "expected {\"gpu\"")):
        path.write_text(text)
        with pytest.warns(UserWarning, match=why):
            assert tuned.read_table(path, "Fake GPU") == {}


def test_gpu_description_drives_the_choice():
    # the split estimate counts this GPU's SMs: Mixtral-8x7B down M = 1 splits 8 ways on 132 SMs, 16 on 264
    assert choose(2, 8, 1, 14336, 4096, 4, 128).split_k == 8
    assert choose(2, 8, 1, 14336, 4096, 4, 128, gpu=replace(H200, sm_count=264)).split_k == 16
    assert choose(2, 8, 1, 14336, 4096, 4, 128, gpu=replace(H200, sm_count=33)).split_k < 8
    assert configs.split_k_estimate(configs.DECODE, 2, 8, 1, 14336, 4096, gpu=H200) == 8
    with pytest.raises(ValueError, match="sm_count: expected a positive int, got 0"):
        configs.GpuInfo("x", "sm_90a", 0)
    with pytest.raises(ValueError, match="arch: expected an NVRTC target"):
        configs.GpuInfo("x", "90", 132)
    assert H200.hopper and not PORTABLE.hopper and not configs.GpuInfo("x", "sm_80", 108).hopper
    with pytest.raises(TypeError, match="gpu: expected a GpuInfo or None, got str"):
        configs.choose_config(1, 8, 2, 4096, 4096, 4, 128, gpu="NVIDIA H200")


def test_without_a_gpu_the_target_must_be_given():
    from cupy_moe import gpu_available
    if gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs"):
        configs.choose_config(1, 8, 2, 4096, 4096, 4, 128)


def test_choice_arguments_are_checked():
    with pytest.raises(ValueError, match=r"block_m: expected one of \(16, 32, 48, 64, 128\) or None, got 96"):
        choose(1, 8, 2, 4096, 4096, 4, 128, block_m=96)
    with pytest.raises(ValueError, match="split_k: expected an int in"):
        choose(1, 8, 2, 4096, 4096, 4, 128, split_k=2)  # a split needs its block size
    with pytest.raises(ValueError, match="split_k: expected an int in"):
        choose(1, 8, 2, 4096, 4096, 4, 128, block_m=16, split_k=17)
    with pytest.raises(ValueError, match="kind: expected one of"):
        configs.GemmConfig(1, 1, 4, 1, 4, 2, kind="fast")
    with pytest.raises(ValueError, match="split_k: expected a positive int, got 0"):
        replace(configs.DECODE, split_k=0)
    # the tc and swapped kernels run 256 threads: a shape of other warps would leave rows or columns unwritten
    with pytest.raises(ValueError, match=r"kind 'tc': expected warps_m \* warps_n = 8 and warps_k = 1 \(its kernel "
                                         r"runs 256 threads\), got warps_m=1, warps_n=4, warps_k=1"):
        configs.GemmConfig(4, 1, 4, 2, 1, 6, kind="tc")
    with pytest.raises(ValueError, match="kind 'swapped': expected warps_m \\* warps_n = 8 and warps_k = 1"):
        configs.GemmConfig(2, 1, 4, 2, 1, 6, kind="swapped", warps_k=2)


def test_config_specs_round_trip():
    for cfg in (configs.DECODE, replace(configs.DECODE, ku=2, stages=3, split_k=5), configs.PREFILL,
                configs.PREFILL_128, configs.DECODE_WK, configs.DECODE_WK_ONE_PAIR, configs.SWAPPED_32,
                configs.DECODE_48, configs.SWAPPED_48):
        assert configs.GemmConfig.from_spec(cfg.spec) == cfg
    assert configs.DECODE.spec == "reg:1,1,4,1,4,2,1/1"
    assert configs.GemmConfig.from_spec("tc:2,2,4,2,1,6,1") == configs.PREFILL
    with pytest.raises(ValueError, match="kind: expected one of"):
        configs.GemmConfig.from_spec("fast:1,1,4,1,4,2,1")
    with pytest.raises(ValueError, match=r"spec: expected 'kind:mt,warps_m,warps_n,ng,ku,stages,warps_k\[/split_k\]'"):
        configs.GemmConfig.from_spec("reg:1,1,4,1,4,2")


def _launched_configs():
    lines = [line.split() for line in (DATA / "launched_configs.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    shapes = {code: configs.GemmConfig.from_spec(text) for _, code, text in (l for l in lines if l[0] == "shape")}
    return shapes, [line for line in lines if line[0] != "shape"]


def test_launched_configurations_match_the_recorded_ones():
    """The launched configuration of every (model, phase, M, device, act-order, pair order, block size) is the
    recorded one (tests/data/launched_configs.txt): kernels' results are bitwise the same as long as this holds."""
    shapes, rows = _launched_configs()
    assert len(rows) > 200
    flags = [(h, act, pair, bm) for h in (0, 1) for act in (0, 1) for pair in (0, 1)
             for bm in (None, 16, 32, 48, 64, 128)]
    for name, phase, m, *codes in rows:
        model = MODELS[name]
        k, n, top_k = model.phases()[phase]
        assert len(codes) == len(flags)
        for (h, act, pair, bm), code in zip(flags, codes):
            want = replace(shapes[code[0]], split_k=int(code[1:]))
            got = choose(int(m), model.num_experts, top_k, k, n, 4, 128, bm, act_order=bool(act), pair_a=bool(pair),
                         hopper=bool(h))
            assert got == want, (name, phase, m, h, act, pair, bm)


def test_a_plan_is_stable_under_its_own_block_size():
    """fused_moe chooses once and aligns with plan.block_m; fused_moe_gemm without a config chooses for that block
    size: both give the same launch."""
    for model in MODELS.values():
        for k, n, top_k in model.phases().values():
            for m in (1, 3, 16, 64, 200, 1024):
                for gpu in (H200, PORTABLE):
                    for act in (False, True):
                        plan = choose(m, model.num_experts, top_k, k, n, 4, 128, act_order=act, gpu=gpu)
                        again = choose(m, model.num_experts, top_k, k, n, 4, 128, plan.block_m, act_order=act, gpu=gpu)
                        assert plan == again
                        assert configs.fallback(plan, act_order=act, hopper=gpu.hopper) == plan


def test_choices_leave_module_state_alone():
    state = lambda: copy.deepcopy({name: value for module in (catalogue, heuristic, tuned)
                                   for name, value in vars(module).items()
                                   if name.isupper() and isinstance(value, (dict, int, float, tuple))})
    before = state()
    for m in (1, 64, 256, 4096):
        for gpu in (H200, PORTABLE):
            choose(m, 8, 2, 4096, 28672, 4, 128, gpu=gpu)
            choose(m, 8, 2, 4096, 28672, 4, 128, 32, act_order=True, pair_a=True, gpu=gpu)
    configs.all_name_expressions("sm_90a")
    assert state() == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        configs.DECODE.split_k = 2


def _numpy_problem(act_order=False):
    rng = np.random.default_rng(0)
    e, k, n, m, a = 4, 64, 32, 5, 2
    qweight = rng.integers(-2**31, 2**31, size=(e, k // 8, n), dtype=np.int64).astype(np.int32)
    scales = rng.uniform(0.01, 0.02, size=(e, 2, n)).astype(np.float16)
    g_idx = np.stack([reference.act_order_g_idx(k, 32, rng) for _ in range(e)]).astype(np.int32) if act_order else None
    w = StackedGptqWeight(qweight, scales, None, g_idx, bits=4, group_size=32)
    x = rng.standard_normal((m, k)).astype(np.float16)
    ids = np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32)
    return w, x, ids, (m, e, a, k, n)


def test_numpy_path_takes_a_config_and_checks_it():
    w, x, ids, (m, e, a, k, n) = _numpy_problem()
    plan = choose(m, e, a, k, n, 4, 32)
    aligned = moe_align_block_size(ids, plan.block_m, e)
    want = fused_moe_gemm(x, w, *aligned, a)
    np.testing.assert_array_equal(fused_moe_gemm(x, w, *aligned, a, config=plan), want)
    assert plan.block_m == 16  # what one pair per block is
    np.testing.assert_array_equal(fused_moe_gemm(x[:1], w, None, ids[:1], None, a, config=plan),
                                  fused_moe_gemm(x[:1], w, None, ids[:1], None, a))
    other = moe_align_block_size(ids, 64, e)
    with pytest.raises(ValueError, match=r"config: expected block_m = 64, the block size of sorted_token_ids"):
        fused_moe_gemm(x, w, *other, a, config=plan)
    with pytest.raises(TypeError, match="config: expected a GemmConfig"):
        fused_moe_gemm(x, w, *aligned, a, config=(16, 1))
    # one pair per block reads no aligned list: only the decode kernel runs that way
    swapped16 = configs.GemmConfig(mt=1, warps_m=1, warps_n=8, ng=1, ku=1, stages=6, kind="swapped")
    with pytest.raises(ValueError, match=r"config: expected kind 'reg' with one pair per block .* got kind 'swapped'"):
        fused_moe_gemm(x[:1], w, None, ids[:1], None, a, config=swapped16)
    # the swapped kernel has no pair-order variant; the tc kernel has no act-order variant
    swapped = choose(m, e, a, k, n, 4, 32, 32, gpu=H200)
    assert swapped.kind == "swapped"
    al32 = moe_align_block_size(ids, 32, e)
    with pytest.raises(ValueError, match=r"config: expected a shape with a kernel variant for act_order=False, "
                                         r"a_pair_order=True .* got kind 'swapped'"):
        fused_moe_gemm(reference.to_pair_order(x), w, *al32, a, a_pair_order=True, config=swapped)
    wa, xa, ida, _ = _numpy_problem(act_order=True)
    tc = choose(m, e, a, k, n, 4, 32, 64)
    assert tc.kind == "tc"
    with pytest.raises(ValueError, match=r"act_order=True.* got kind 'tc'"):
        fused_moe_gemm(xa, wa, *moe_align_block_size(ida, 64, e), a, config=tc)
    fused_moe_gemm(xa, wa, *moe_align_block_size(ida, 64, e), a, config=choose(m, e, a, k, n, 4, 32, 64,
                                                                                act_order=True))


def test_split_k_workspace_sizes():
    from cupy_moe.gemm import SplitKWorkspace
    # Mixtral-8x7B down M = 1: 8 slices of 56 chunks; 2 pairs aligned to 16 rows over 8 experts: 32 rows, 2 blocks
    plan = choose(2, 8, 1, 14336, 4096, 4, 128, 16)
    assert (plan.split_k, plan.warps_k) == (8, 1)
    assert SplitKWorkspace.size(plan, 14336, 4096, 2, 8) == (8 * 32 * 4096, 2 * 32)
    assert SplitKWorkspace.size(plan, 14336, 4096, 2, 8, one_pair=True) == (8 * 32 * 4096, 2 * 32)
    assert SplitKWorkspace.size(plan, 14336, 4096, 5, 8) == (8 * 80 * 4096, 5 * 32)  # 5 pairs on up to 5 experts
    assert SplitKWorkspace.size(replace(plan, split_k=1), 14336, 4096, 2, 8) == (0, 0)
    assert SplitKWorkspace.size(plan, 14336, 4096, 0, 8) == (0, 0)


def test_hopper_variants_in_name_expressions_and_shared_memory(monkeypatch):
    tc, dec = configs.PREFILL_128, configs.DECODE
    assert tc.name_expression(False, 4, False, 128).endswith(", false, false>")
    name, smem = tc.name_expression(False, 4, False, 128, hopper=True), tc.smem_bytes(4, hopper=True)
    assert name == f"moe_gemm_tc<false, 4, 128, {tc.block_n}, {tc.stages}, {tc.ku}, true, false>"
    # wgmma: 32-k steps rounded to 512 bytes (swizzle period) plus 1 KiB to align the base; TcSmem in the kernel
    step = 128 * 64 + 4 * tc.block_n * 4 + tc.block_n * 2 + tc.block_n // 2
    assert smem == tc.stages * tc.ku * (-(-step // 512) * 512) + 2 * tc.ku * tc.block_n * 64 + 1024
    # the decode kernel has no Hopper variant and uses static shared memory only
    assert dec.name_expression(True, 8, False, 128, hopper=True) == dec.name_expression(True, 8, False, 128)
    assert dec.smem_bytes(8, hopper=True) == dec.smem_bytes(8) == 0
    name = configs.GemmConfig(1, 1, 4, 1, 4, 2).name_expression(True, 8, False, 128)
    assert name == "moe_gemm<true, 8, 1, 1, 4, 1, 1, 4, 2, 1, 4, false>"  # group mode 1, bound to 4 CTAs per SM
    assert configs.GemmConfig(1, 1, 4, 1, 4, 2).name_expression(True, 8, True, 128).endswith(", 2, 3, false>")
    # the 4-bit, one-group-per-stage instance carries the launch bound of 4 CTAs per SM
    assert dec.name_expression(False, 4, False, 128).endswith(", 1, 4, false>")
    # act-order at a tc block size falls back to moe_gemm (group mode 2), which has no wgmma variant
    cfg = configs.fallback(tc, act_order=True, hopper=True)
    assert cfg == configs.ACT_ORDER_SHAPES[128] and cfg.smem_bytes(4, True) == 0
    assert cfg.name_expression(False, 4, True, 128, True).startswith("moe_gemm<")
    assert cfg.name_expression(False, 4, True, 128, True).endswith(", 2, 1, false>")
    with pytest.raises(ValueError, match="act_order: expected False for the tc kernel"):
        tc.name_expression(False, 4, True, 128)
    # activations in pair order: 4-bit, moe_gemm and the tc kernel; a swapped shape falls back to the portable one
    assert tc.name_expression(False, 4, False, 128, True, pair_a=True).endswith(", true, true>")
    assert dec.name_expression(False, 4, False, 128, pair_a=True).endswith(", 1, 4, true>")
    cfg = configs.fallback(configs.SWAPPED_32, act_order=False, hopper=True, pair_a=True)
    assert cfg.kind == "reg" and cfg.name_expression(False, 4, False, 128, True, pair_a=True).endswith(", true>")
    with pytest.raises(ValueError, match="pair_a: expected 4-bit weights"):
        dec.name_expression(False, 8, False, 128, pair_a=True)
    monkeypatch.setenv("CUPY_MOE_HOPPER", "0")  # the portable build on a Hopper GPU
    assert configs.build_arch("sm_90a") == "sm_90"
    monkeypatch.setenv("CUPY_MOE_HOPPER", "1")
    assert configs.build_arch("sm_90a") == "sm_90a"
    assert configs.build_arch("sm_90") == "sm_90" and configs.build_arch("sm_80") == "sm_80"


def test_name_expressions_by_source_file():
    for arch in ("sm_80", "sm_90a"):
        names = configs.all_name_expressions(arch)
        by_file = [n for f in sorted(set(configs.KERNEL_FILES.values())) for n in configs.all_name_expressions(arch, f)]
        assert sorted(by_file) == sorted(names)
        for kind, template in configs.TEMPLATES.items():
            if kind != "swapped" or arch == "sm_90a":
                in_file = configs.all_name_expressions(arch, configs.KERNEL_FILES[kind])
                assert any(n.startswith(template + "<") for n in in_file)
    assert configs.DECODE.source_file == configs.KERNEL_FILES["reg"]


def test_default_tiles_fit_one_sm():
    """Every instance the launcher can request fits an H100/H200 SM's 227 KiB of opt-in shared memory."""
    for cfg in (*configs.KERNEL_SHAPES.values(), *configs.SPLIT_WARPS_SHAPES.values(), configs.DECODE_WK_ONE_PAIR,
                *configs.HOPPER_SHAPES.values()):
        for bits in (4, 8):
            for hopper in (False, True):
                assert cfg.smem_bytes(bits, hopper) <= 227 * 1024, (cfg, bits, hopper)


def test_tune_checks_its_arguments_before_touching_a_gpu():
    from cupy_moe.tune import tune
    with pytest.raises(ValueError, match=r"ms: expected token counts M >= 1, got \[0\]"):
        tune(ms=(1, 0))
    with pytest.raises(ValueError, match="model: expected one of"):
        tune(models=["Mixtral-9x7B"])
    with pytest.raises(ValueError, match="bits: expected 4 or 8, got 3"):
        tune(models=["mixtral-8x7b"], bits=3)
    with pytest.raises(ValueError, match="group_size: expected -1 or a positive multiple of 32, got 48"):
        tune(models=["mixtral-8x7b"], group_size=48)
    with pytest.raises(ValueError, match="reps: expected a positive int, got 0"):
        tune(models=["mixtral-8x7b"], reps=0)


def test_every_catalogued_instance_is_reachable():
    # Each instance compiled for an arch is one the rules can launch there: the configuration choice over a grid of
    # problems, every block size (a tuned entry may name any) and every flag the launcher passes (one pair per
    # block included) reaches them all.
    for gpu in (H200, PORTABLE, configs.GpuInfo("Test sm_80", "sm_80", 108)):
        reached = set()
        for bf16 in (False, True):
            for bits in (4, 8):
                for act, group in ((False, 32), (False, 128), (True, 128)):
                    for pair_a in ((False, True) if bits == 4 else (False,)):
                        for m, e, a, k, n in ((1, 8, 2, 4096, 4096), (2, 8, 1, 14336, 4096), (4096, 8, 2, 4096, 4096)):
                            for block_m in (None, *configs.SUPPORTED_BLOCK_M):
                                splits = (None,) if block_m is None else (None, 1, 2, 4)
                                for split_k, one in itertools.product(splits, (False, True)[:1 + (block_m == 16)]):
                                    cfg = configs.choose_config(m, e, a, k, n, bits, group, block_m, act_order=act,
                                                                pair_a=pair_a, gpu=gpu, split_k=split_k, tuned=False,
                                                                one_pair=one)
                                    reached.add(cfg.name_expression(bf16, bits, act, k if group == -1 else group,
                                                                    gpu.hopper, k, pair_a))
        catalogue = set(configs.all_name_expressions(gpu.arch))
        assert catalogue <= reached, sorted(catalogue - reached)
        assert reached <= catalogue, sorted(reached - catalogue)
