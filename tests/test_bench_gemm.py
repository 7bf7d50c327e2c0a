"""What benchmarks/bench_gemm.py reports for a row, from what it counts (its GPU parts replaced). CPU only."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from cupy_moe import configs


def _bench_gemm():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_gemm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_row_floors_and_rates_follow_from_its_bytes_flops_and_time(monkeypatch):
    bench = _bench_gemm()
    # 3 routings touching 2, 3 and 4 experts of 1000 bytes each; 7 activation rows of K = 64, P = 14 pairs of N = 32
    sets = [(None,) * 6 + (touched,) for touched in (2, 3, 4)]
    row = SimpleNamespace(cfg=configs.DECODE, sets=sets, w_bytes_expert=1000, rows=7, k=64, n=32, p=14,
                          call=lambda i: None)
    monkeypatch.setattr(bench, "prepare_row", lambda *args, **kwargs: row)
    monkeypatch.setattr(bench, "graph_time", lambda calls, reps, warmup: 2e-6)
    out = bench.bench_row("Mixtral-8x7B", "gate_up", 7, copy_bw=1e9, mm_rate=1e12, iters=4, rotations=3,
                          baseline=False)
    traffic = 3 * 1000 + 7 * 64 * 2 + 14 * 32 * 2  # the mean touched experts' weights, activations read, outputs
    flops = 2.0 * 14 * 64 * 32
    assert bench.traffic_and_flops(row) == (traffic, flops)
    assert out["time_us"] == pytest.approx(2.0)
    assert out["traffic_floor_us"] == pytest.approx(traffic / 1e9 * 1e6)
    assert out["flop_floor_us"] == pytest.approx(flops / 1e12 * 1e6)
    assert out["floor_ratio"] == pytest.approx(traffic / 1e9 / 2e-6)
    assert out["roofline_ratio"] == pytest.approx(max(traffic / 1e9, flops / 1e12) / 2e-6)
    assert out["tbps"] == pytest.approx(traffic / 2e-6 / 1e12) and out["tflops"] == pytest.approx(flops / 2e-6 / 1e12)
    assert out["config"] == configs.DECODE.spec and out["k"] == 64 and out["n"] == 32


def test_row_config_runs_the_block_size_asked_for():
    bench = _bench_gemm()
    hopper, portable = configs.GpuInfo("Test H200", "sm_90a", 132), configs.GpuInfo("Test sm_90", "sm_90", 132)
    # Qwen2-57B-A14B at M = 256: about 32 rows per expert, which the rules give 48-row blocks on sm_90a (the
    # benchmark's GPU name has no tuned table), 64-row blocks elsewhere
    cfg, pair, single = bench.row_config("Qwen2-57B-A14B", "gate_up", 256, hopper)
    assert cfg.block_m == 48 and cfg.kind == "swapped" and not pair and not single
    cfg, _, _ = bench.row_config("Qwen2-57B-A14B", "gate_up", 256, portable)
    assert cfg.block_m == 64 and cfg.kind == "tc"
    cfg, _, _ = bench.row_config("Qwen2-57B-A14B", "gate_up", 256, hopper, block_m=32)
    assert cfg.block_m == 32 and cfg.kind == "swapped"
    cfg, _, _ = bench.row_config("Qwen2-57B-A14B", "gate_up", 256, portable, block_m=32)
    assert cfg.block_m == 32 and cfg.kind == "reg"
    # --tiles swaps the shape of the block size asked for, and only that one
    tile = configs.GemmConfig.from_spec("swapped:2,1,8,2,2,4,1")
    cfg, _, _ = bench.row_config("Qwen2-57B-A14B", "down", 256, hopper, tiles=[tile], block_m=32)
    assert (cfg.kind, cfg.block_m, cfg.ku, cfg.stages) == ("swapped", 32, 2, 4)
    cfg, _, _ = bench.row_config("Qwen2-57B-A14B", "down", 256, hopper, tiles=[tile])
    assert cfg.block_m == 48 and cfg.stages == 6
    # down rows on 16-row blocks read pair-ordered activations, on other block sizes natural ones
    cfg, pair, _ = bench.row_config("Qwen2-57B-A14B", "down", 64, hopper, block_m=16)
    assert cfg.block_m == 16 and pair
    cfg, pair, _ = bench.row_config("Qwen2-57B-A14B", "down", 64, hopper, block_m=32)
    assert cfg.block_m == 32 and not pair
    # one pair per block (M = 1) keeps its 16-row blocks
    cfg, _, single = bench.row_config("Qwen2-57B-A14B", "gate_up", 1, hopper, block_m=64)
    assert single and cfg.block_m == 16
