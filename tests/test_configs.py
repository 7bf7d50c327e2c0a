"""Tile choice: the heuristic and the tuned-config cache written by `python -m cupy_moe tune`. CPU only."""
import json
import warnings

import pytest

from cupy_moe import configs


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_MOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "_device_name", lambda: "Fake GPU")
    configs._WARNED.clear()
    return tmp_path / "tuned_configs.json"


def test_heuristic_block_sizes_follow_rows_per_expert():
    assert configs.choose_config(1, 8, 2, 4096, 28672, 4, 128).block_m == 16
    assert configs.choose_config(64, 8, 2, 4096, 28672, 4, 128).block_m == 16       # 16 rows per expert
    assert configs.choose_config(96, 8, 2, 4096, 28672, 4, 128).block_m == 16       # 24 rows per expert
    assert configs.choose_config(100, 8, 2, 4096, 28672, 4, 128).block_m == 64      # 25 rows per expert
    assert configs.choose_config(224, 8, 2, 4096, 28672, 4, 128).block_m == 64      # 56 rows per expert
    assert configs.choose_config(232, 8, 2, 4096, 28672, 4, 128).block_m == 128     # 58 rows per expert
    assert configs.choose_config(4096, 8, 2, 4096, 28672, 4, 128).block_m == 128    # 1024 rows per expert
    cfg = configs.choose_config(1, 8, 2, 4096, 4096, 4, 128)
    assert 1 < cfg.split_k <= 16  # few tiles: split-K fills the SMs


def test_tc_tiles_split_only_grids_under_one_wave():
    # Qwen2-57B-A14B down M = 256: 2048 rows on 64 experts, 64-row tiles, 896 CTAs (3.4 waves): not split
    cfg = configs.choose_config(2048, 64, 1, 2560, 3584, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 64, 1)
    # Mixtral-8x22B down M = 128: 8 experts x 24 column tiles = 192 CTAs, under one wave (2 per SM): split
    cfg = configs.choose_config(256, 8, 1, 16384, 6144, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m) == ("tc", 64) and cfg.split_k > 1


def test_a_split_64_row_pick_becomes_a_full_wave_of_128_row_tiles():
    # Mixtral-8x7B down M = 128: 32 rows on each of 8 experts. 64-row tiles: 128 CTAs, split; 128-row tiles: 128
    # CTAs, 0.97 of one wave -> 128 rows unsplit
    cfg = configs.choose_config(256, 8, 1, 14336, 4096, 4, 128, hopper=False)
    assert (cfg.kind, cfg.block_m, cfg.split_k) == ("tc", 128, 1)
    # forced 64 rows (an align already made) keeps them, split
    cfg = configs.choose_config(256, 8, 1, 14336, 4096, 4, 128, block_m=64, hopper=False)
    assert (cfg.block_m, cfg.split_k > 1) == (64, True)
    # Mixtral-8x22B down M = 128: 192 CTAs of 128 rows fill 0.73 of two waves -> 64 rows, split (test above)
    assert configs.choose_config(256, 8, 1, 16384, 6144, 4, 128, hopper=False).block_m == 64
    # the gate/up phase of the same layer: 896 CTAs of 64 rows, unsplit, stays 64
    assert configs.choose_config(128, 8, 2, 4096, 28672, 4, 128, hopper=False).block_m == 64


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
    tuned = configs.choose_config(1, 8, 2, 4096, 28672, 4, 128)
    assert (tuned.block_m, tuned.block_n, tuned.split_k, tuned.warps_k) == (16, 128, 7, 1)
    configs.save_tuned("Fake GPU", {configs.tuning_key(8, 4096, 28672, 4, 128, 2): {"block_m": 16, "split_k": 4}})
    tuned = configs.choose_config(1, 8, 2, 4096, 28672, 4, 128)
    assert (tuned.block_m, tuned.block_n, tuned.split_k, tuned.warps_k) == (16, 32, 1, 4)


def test_hopper_runs_the_swapped_kernel_for_32_row_blocks():
    # Mixtral-8x7B gate/up M = 88 at 32-row blocks (asked for; the heuristic picks 16): on sm_90a the ws kernel,
    # 256 columns
    ws = configs.choose_config(88, 8, 2, 4096, 28672, 4, 128, block_m=32, hopper=True)
    assert (ws.kind, ws.block_m, ws.block_n, ws.short_name) == ("ws", 32, 256, "32s")
    assert configs.choose_config(88, 8, 2, 4096, 28672, 4, 128, block_m=32, hopper=False).kind == "reg"
    assert configs.choose_config(1, 8, 2, 4096, 28672, 4, 128, hopper=True).kind == "reg"  # 16-row blocks stay
    # DeepSeek-V2-Lite down M = 256: 64 blocks x 8 tiles of 256 columns, 44 steps; 2 CTAs per SM (264 slots):
    # one slice (2 waves of 46) beats 2 (4 x 24) and 3 (6 x 17)
    assert configs.choose_config(1536, 64, 1, 1408, 2048, 4, 128, hopper=True).split_k == 1
    # act-order or another GPU: the portable shape of the block size, split kept
    cfg, name, smem = configs.kernel_instance(ws, False, 4, True, 128, hopper=True)
    assert cfg.kind == "reg" and cfg.block_m == 32 and cfg.split_k == ws.split_k and name.startswith("moe_gemm<")
    cfg, name, smem = configs.kernel_instance(ws, False, 4, False, 128, hopper=True)
    assert name == "moe_gemm_swapped<false, 4, 32, 2, 6, 1>" and smem == 6 * 7168 + 1024
    assert name in configs.all_name_expressions("sm_90a") and name not in configs.all_name_expressions("sm_80")


def test_split_k_weighs_waves_against_short_slices(monkeypatch):
    monkeypatch.setattr(configs, "WARPS_K_EXTRA_STAGES", -1)  # the estimate itself (warps along K: the next test)
    # Mixtral-8x7B M = 1 (2 experts) on 528 decode slots (4 CTAs per SM): gate/up 448 CTAs of 32 stages fit one
    # wave (estimate 36; 2 slices 2 waves of 16 stages, 40); down about 1.9 experts x 32 tiles = 60 CTAs of 112
    # stages: 8 slices (one wave); with act-order (3 CTAs per SM, 396 slots) 8 slices would take two waves, so 6
    assert configs.choose_config(1, 8, 2, 4096, 28672, 4, 128).split_k == 1
    # gate/up M = 64: 1792 CTAs of 32 stages, whole 4 waves x 36 = 144, 2 slices 7 waves x 20 = 140: within 5%, so
    # whole (with 2 fill stages, 136 against 126, it split, and 16 x 32 with warps along K ran 1.15x the time)
    assert configs.choose_config(64, 8, 2, 4096, 28672, 4, 128).split_k == 1
    assert configs.choose_config(2, 8, 1, 14336, 4096, 4, 128).split_k == 8
    assert configs.choose_config(2, 8, 1, 14336, 4096, 4, 128, act_order=True).split_k == 6
    # the 128 x 256 prefill tile (one CTA per SM): 256 CTAs of 448 steps are two full waves, no split
    assert configs.choose_config(1024, 8, 2, 14336, 4096, 4, 128).split_k == 1
    # slices keep at least 2 stages: K = 768 (6 stages of 128 k) splits at most 3 ways
    assert configs.choose_config(1, 128, 8, 768, 2048, 4, 128).split_k <= 3


def test_large_splits_of_16_row_blocks_become_warps_along_k():
    # Mixtral-8x7B down M = 64 (16 rows per expert): 2 ways; one 16 x 32 CTA of 4 warp slices instead
    cfg = configs.choose_config(128, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_m, cfg.block_n, cfg.warps_k, cfg.split_k) == (16, 32, 4, 1)
    # Mixtral-8x7B down M = 16 (4 rows per expert, the swapped path): 2 ways, 2 x 253 CTAs fit one wave of 528 slots:
    # the split 16 x 128 stays
    cfg = configs.choose_config(32, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_n, cfg.warps_k, cfg.split_k) == (128, 1, 2)
    # Mixtral-8x7B down M = 4: 3 ways; 16 x 32 with warps along K
    cfg = configs.choose_config(8, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_m, cfg.block_n, cfg.warps_k, cfg.split_k, cfg.threads) == (16, 32, 4, 1, 128)
    # Qwen3-30B-A3B down M = 1 (3 slices of 2 stages): the same
    cfg = configs.choose_config(8, 128, 1, 768, 2048, 4, 128)
    assert (cfg.warps_k, cfg.split_k, cfg.short_name) == (4, 1, "16k")
    assert cfg.name_expression(False, 4, False, 128) == "moe_gemm<false, 4, 1, 1, 1, 4, 1, 4, 2, 1, 4, false>"
    assert cfg.name_expression(False, 4, False, 128) in configs.all_name_expressions("sm_80")
    # Mixtral-8x7B down M = 1 (8 slices of 14 stages; 4 warp slices would be 28) keeps the 16 x 128 shape
    cfg = configs.choose_config(2, 8, 1, 14336, 4096, 4, 128)
    assert (cfg.block_n, cfg.warps_k, cfg.split_k) == (128, 1, 8)
    # Qwen1.5-MoE-A2.7B gate/up M = 1: 6 slices of 3 stages become 4 warp slices of 4
    cfg = configs.choose_config(1, 60, 4, 2048, 2816, 4, 128)
    assert (cfg.block_n, cfg.warps_k, cfg.split_k) == (32, 4, 1)
    # Mixtral-8x7B gate/up M = 1 (no split) and 64-row blocks keep their shapes
    assert configs.choose_config(1, 8, 2, 4096, 28672, 4, 128).warps_k == 1
    assert configs.choose_config(256, 8, 2, 4096, 28672, 4, 128).warps_k == 1


def test_tuning_key_buckets_pairs_by_powers_of_two():
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 1) == "E8_K4096_N28672_b4_G128_P1"
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 5).endswith("_P8")
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 8).endswith("_P8")
    assert configs.tuning_key(8, 4096, 28672, 4, 128, 9).endswith("_P16")


def test_tuned_entry_wins_and_survives_a_reload(fake_gpu):
    key = configs.tuning_key(8, 4096, 28672, 4, 128, 2)
    path = configs.save_tuned("Fake GPU", {key: {"block_m": 64, "split_k": 3, "time_us": 10.0}})
    assert path == fake_gpu
    assert json.loads(path.read_text())["Fake GPU"][key]["split_k"] == 3
    cfg = configs.choose_config(1, 8, 2, 4096, 28672, 4, 128)
    assert (cfg.block_m, cfg.split_k) == (64, 3)
    # an align block size forced by the caller that differs from the tuned one keeps the heuristic
    assert configs.choose_config(1, 8, 2, 4096, 28672, 4, 128, block_m=16).block_m == 16


def test_missing_problem_falls_back_with_one_note(fake_gpu):
    heuristic = configs.choose_config(1, 8, 2, 4096, 4096, 4, 128)  # no cache file yet: silent heuristic
    configs.save_tuned("Fake GPU", {"E1_K32_N32_b4_G32_P1": {"block_m": 16, "split_k": 1}})
    with pytest.warns(UserWarning, match=r"no tuned GEMM config for E8_K4096_N4096_b4_G128_P2 .* heuristic"):
        assert configs.choose_config(1, 8, 2, 4096, 4096, 4, 128) == heuristic
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per problem, not per call
        configs.choose_config(1, 8, 2, 4096, 4096, 4, 128)


def test_invalid_or_corrupt_cache_is_ignored(fake_gpu):
    key = configs.tuning_key(8, 4096, 4096, 4, 128, 2)
    configs.save_tuned("Fake GPU", {key: {"block_m": 48, "split_k": 3}})
    assert configs.choose_config(1, 8, 2, 4096, 4096, 4, 128).block_m == 16
    fake_gpu.write_text("{not json")
    configs._load_cache.cache_clear()
    with pytest.warns(UserWarning, match="ignoring the tuned-config cache"):
        assert configs.choose_config(1, 8, 2, 4096, 4096, 4, 128).block_m == 16


def test_no_gpu_no_cache_lookups(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_MOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "_device_name", lambda: None)
    assert configs.tuned_table() == {}


def test_tune_checks_its_arguments_before_touching_a_gpu():
    from cupy_moe.tune import tune
    with pytest.raises(ValueError, match=r"ms: expected token counts M >= 1, got \[0\]"):
        tune(ms=(1, 0))


def test_hopper_variants_in_name_expressions_and_shared_memory(monkeypatch):
    tc, dec = configs.PREFILL_128, configs.DECODE
    assert configs.kernel_instance(tc, False, 4, False, 128)[1].endswith(", false, false>")
    _, name, smem = configs.kernel_instance(tc, False, 4, False, 128, hopper=True)
    assert name == f"moe_gemm_tc<false, 4, 128, {tc.block_n}, {tc.stages}, {tc.ku}, true, false>"
    # wgmma: 32-k steps rounded to 512 bytes (swizzle period) plus 1 KiB to align the base; TcSmem in moe_gemm_prefill.cu
    step = 128 * 64 + 4 * tc.block_n * 4 + tc.block_n * 2 + tc.block_n // 2
    assert smem == tc.stages * tc.ku * (-(-step // 512) * 512) + 2 * tc.ku * tc.block_n * 64 + 1024
    # the decode kernel has no Hopper variant and uses static shared memory only
    plain = configs.kernel_instance(dec, True, 8, False, 128)
    assert configs.kernel_instance(dec, True, 8, False, 128, hopper=True) == plain and plain[2] == 0
    name = configs.GemmConfig(1, 1, 4, 1, 4, 2).name_expression(True, 8, False, 128)
    assert name == "moe_gemm<true, 8, 1, 1, 4, 1, 1, 4, 2, 1, 4, false>"  # group mode 1, bound to 4 CTAs per SM
    assert configs.GemmConfig(1, 1, 4, 1, 4, 2).name_expression(True, 8, True, 128).endswith(", 2, 3, false>")
    # the 4-bit, one-group-per-stage instance carries the launch bound of 4 CTAs per SM
    assert dec.name_expression(False, 4, False, 128).endswith(", 1, 4, false>")
    # act-order at a tc block size falls back to moe_gemm (group mode 2), which has no wgmma variant
    cfg, name, smem = configs.kernel_instance(tc, False, 4, True, 128, hopper=True)
    assert name.startswith("moe_gemm<") and name.endswith(", 2, 1, false>") and smem == 0
    # activations in pair order: 4-bit, moe_gemm and the tc kernel; a ws shape falls back to the portable one
    assert configs.kernel_instance(tc, False, 4, False, 128, True, pair_a=True)[1].endswith(", true, true>")
    assert dec.name_expression(False, 4, False, 128, pair_a=True).endswith(", 1, 4, true>")
    cfg, name, _ = configs.kernel_instance(configs.WS_32, False, 4, False, 128, True, pair_a=True)
    assert cfg.kind == "reg" and name.endswith(", true>")
    with pytest.raises(ValueError, match="pair_a: expected 4-bit weights"):
        dec.name_expression(False, 8, False, 128, pair_a=True)
    monkeypatch.setenv("CUPY_MOE_HOPPER", "0")
    assert not configs.hopper_enabled("sm_90a")
    monkeypatch.setenv("CUPY_MOE_HOPPER", "1")
    assert configs.hopper_enabled("sm_90a")
    assert not configs.hopper_enabled("sm_90") and not configs.hopper_enabled("sm_80")


def test_default_tiles_fit_one_sm():
    """Every instance the launcher can request fits an H100/H200 SM's 227 KiB of opt-in shared memory."""
    for cfg in (*configs.KERNEL_SHAPES.values(), *configs.SPLIT_WARPS_SHAPES.values()):
        for bits in (4, 8):
            for hopper in (False, True):
                assert cfg.smem_bytes(bits, hopper) <= 227 * 1024, (cfg, bits, hopper)


def test_benchmark_tile_specs_round_trip():
    """benchmarks/sweep_tiles.py writes winners through these specs; bench_gemm.py --tiles reads them."""
    import sys
    from pathlib import Path
    pytest.importorskip("cupy")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gemm
    from dataclasses import replace
    for cfg in (configs.DECODE, replace(configs.DECODE, ku=2, stages=3), configs.PREFILL, configs.PREFILL_128,
                configs.DECODE_WK):
        spec = bench_gemm.tile_spec(cfg)
        assert bench_gemm.parse_tiles(spec) == [cfg]
    with pytest.raises(ValueError, match="kind 'fast'"):
        bench_gemm.parse_tiles("16=fast:1,1,4,1,4,2")
    with pytest.raises(ValueError, match="block_m 16, not 64"):
        bench_gemm.parse_tiles("64=1,1,4,1,4,2")


def test_benchmark_verdicts():
    """bench_gemm.py's pass rule per bar: the issue-6 rows between the regimes compare against the faster regime."""
    import sys
    from pathlib import Path
    pytest.importorskip("cupy")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gemm

    def row(m, time_us, **kw):
        return dict(dict(m=m, time_us=time_us, baseline_ratio=2.0, floor_ratio=0.5, flop_ratio=0.5,
                         traffic_floor_us=20.0, regime_us={}), **kw)

    assert bench_gemm.verdict(row(1, 50.0), "issue3")
    assert not bench_gemm.verdict(row(1, 50.0, floor_ratio=0.39), "issue3")
    assert not bench_gemm.verdict(row(1, 24.0), "issue6") and bench_gemm.verdict(row(1, 23.5), "issue6")
    assert bench_gemm.verdict(row(1, 6.0, traffic_floor_us=2.5), "issue6")  # under 10 us: floor + 4 us
    assert not bench_gemm.verdict(row(1, 6.6, traffic_floor_us=2.5), "issue6")
    assert not bench_gemm.verdict(row(1024, 1.0), "issue6") and bench_gemm.verdict(row(1024, 1.0, flop_ratio=0.7),
                                                                                   "issue6")
    between = dict(regime_us={"16": 100.0, "128": 120.0})
    assert bench_gemm.verdict(row(256, 102.9, **between), "issue6")
    assert not bench_gemm.verdict(row(256, 103.1, **between), "issue6")
    assert not bench_gemm.verdict(row(256, 50.0, baseline_ratio=0.9, **between), "issue6")
    assert bench_gemm.verdict(row(256, 500.0, **between), "issue3")  # issue 3 has no rule between the regimes
    assert bench_gemm.verdict(row(1, 50.0, baseline_ratio=float("nan")), "issue3")  # --no-baseline: not judged
    assert not bench_gemm.verdict(row(1, 50.0, baseline_ratio=float("nan"), floor_ratio=0.3), "issue3")


def test_benchmark_marks_targets_under_the_traffic_floor():
    """A prefill row whose FLOPs at the bar's share of the matmul rate take less time than moving its bytes."""
    import sys
    from pathlib import Path
    pytest.importorskip("cupy")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gemm

    # 100 us at 0.35 of the matmul rate: the issue-6 target is 50 us, the issue-3 target 87.5 us
    row = dict(m=1024, time_us=100.0, flop_ratio=0.35, traffic_floor_us=60.0)
    assert bench_gemm.target_under_floor(row, "issue6") and not bench_gemm.target_under_floor(row, "issue3")
    assert not bench_gemm.target_under_floor(dict(row, traffic_floor_us=49.0), "issue6")
    assert not bench_gemm.target_under_floor(dict(row, m=512), "issue6")  # decode and between rows: no FLOP target
    rows = [{"pass": True, "pass_issue3": True, "target_under_floor": False},
            {"pass": False, "pass_issue3": True, "target_under_floor": True}]
    assert bench_gemm.summary(rows, "issue6") == ("# 1/2 rows meet the issue6 bar; 2/2 meet the issue3 bar; 1 prefill "
                                                  "rows have a target shorter than their traffic floor")
    assert bench_gemm.summary(rows[:1], "issue3") == "# 1/1 rows meet the issue3 bar"
