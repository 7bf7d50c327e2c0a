"""The tuner's control flow without a GPU: every candidate timed, the fastest kept, entries saved after each model
phase (so a run stopped later keeps them), and choose_config following the saved table. The GPU pieces (arrays,
weights, the align, the GEMM, the timing) are stand-ins here; the tuner itself runs on the GPU in gpu_check.sh."""
import json
import types
from dataclasses import replace

import numpy as np
import pytest

from cupy_moe import configs, tune as tune_mod

GPU = configs.GpuInfo("Fake GPU", "sm_90a", 132)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Stand-ins for the GPU; `launched` records each candidate's configuration, top_k and whether it ran one pair
    per block (no aligned list) as the timing runs it; a configuration whose (block_m, split_k) is in `broken`
    returns zeros where the others return ones."""
    monkeypatch.setenv("CUPY_MOE_CACHE_DIR", str(tmp_path))
    launched, broken = [], set()
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    cp = types.SimpleNamespace(asarray=np.asarray, empty=np.empty, float16=np.float16, float32=np.float32,
                               linalg=np.linalg, get_default_memory_pool=lambda: pool)
    monkeypatch.setattr(tune_mod, "require_gpu", lambda what: cp)
    monkeypatch.setattr(configs, "gpu_info", lambda: GPU)
    big = types.SimpleNamespace(nbytes=1 << 30)  # one copy (timing.weight_copies)
    monkeypatch.setattr(tune_mod, "StackedGptqWeight", types.SimpleNamespace(random=lambda *a, **kw: big))
    monkeypatch.setattr(tune_mod, "moe_align_block_size", lambda ids, block_m, e: ("sorted", "blocks", "post"))
    monkeypatch.setattr(tune_mod, "random_activations",
                        lambda shape, dtype, seed: np.random.default_rng(seed).standard_normal(shape).astype(dtype))

    def gemm(x, w, s, eid, post, top_k, **kw):
        cfg = kw["config"]
        assert (s is None) == (post is None)
        launched.append((cfg, top_k, s is None))
        return np.full((x.shape[0] * top_k, 8), 0 if (cfg.block_m, cfg.split_k) in broken else 1, np.float16)
    monkeypatch.setattr(tune_mod, "fused_moe_gemm", gemm)

    def graph_time(calls, reps):  # the candidate's time: 64-row blocks split 2 ways win
        for call in calls:
            call()
        cfg = launched[-1][0]
        return 1e-6 * (1 if (cfg.block_m, cfg.split_k) == (64, 2) else 10 + cfg.split_k + cfg.block_m / 16)
    monkeypatch.setattr(tune_mod, "graph_time", graph_time)
    return types.SimpleNamespace(launched=launched, broken=broken, table=tmp_path / configs.table_file_name(GPU.name))


def test_tune_keeps_the_fastest_candidate_and_choose_config_follows_it(fake):
    found = tune_mod.tune(["tiny"], (1, 64), reps=1, log=lambda line: None)
    assert len(found) == 4  # two phases x two token counts
    aligned = [c for c, _, one_pair in fake.launched if not one_pair]
    assert {len({c for c in aligned if c.block_m == b}) > 0 for b in configs.SUPPORTED_BLOCK_M} == {True}
    assert any(c.block_m == 16 and c.warps_k == 4 for c in aligned)  # rule 4's alternative is timed too
    saved = json.loads(fake.table.read_text())
    assert saved["gpu"] == GPU.name and saved["entries"] == found
    tiny = tune_mod.get_model("tiny")
    k, n, top_k = tiny.phases()["gate_up"]
    for key, entry in found.items():  # M = 1 has 16-row candidates only; the fastest of those: unsplit
        want = (16, 1, 1, 12.0) if key.endswith(f"_P{top_k}") else (64, 2, 1, 1.0)
        assert (entry["block_m"], entry["split_k"], entry["warps_k"], entry["time_us"]) == want
    # choose_config now takes the table's block size and split for these problems (and not for others)
    heuristic = configs.choose_config(64, tiny.num_experts, top_k, k, n, 4, 128, gpu=GPU, tuned=False)
    tuned = configs.choose_config(64, tiny.num_experts, top_k, k, n, 4, 128, gpu=GPU)
    assert (heuristic.block_m, tuned.block_m, tuned.split_k) == (16, 64, 2)
    assert configs.choose_config(32, tiny.num_experts, top_k, k, n, 4, 128, gpu=GPU) == configs.choose_config(
        32, tiny.num_experts, top_k, k, n, 4, 128, gpu=GPU, tuned=False)  # M = 32 was not tuned


def test_tune_saves_each_phase_as_it_finishes(fake, monkeypatch):
    """A run that stops in the down phase has saved the gate/up entries already."""
    record = tune_mod.fused_moe_gemm

    def stop_in_down(*args, **kw):
        if args[5] == 1:  # top_k 1: the down phase
            raise KeyboardInterrupt
        return record(*args, **kw)
    monkeypatch.setattr(tune_mod, "fused_moe_gemm", stop_in_down)
    with pytest.raises(KeyboardInterrupt):
        tune_mod.tune(["tiny"], (1, 64), reps=1, log=lambda line: None)
    saved = json.loads(fake.table.read_text())["entries"]
    tiny = tune_mod.get_model("tiny")
    k, n, _ = tiny.phases()["gate_up"]
    assert sorted(saved) == sorted(configs.tuning_key(tiny.num_experts, k, n, 4, 128, m * tiny.top_k) for m in (1, 64))


def test_tune_dry_run_saves_nothing(fake):
    found = tune_mod.tune(["tiny"], (1,), reps=1, save=False, log=lambda line: None)
    assert len(found) == 2 and not fake.table.exists()


def test_tune_rejects_a_fast_candidate_whose_result_differs(fake):
    """A configuration that skips its work is fastest but wrong: it is logged as rejected and never kept."""
    fake.broken.add((64, 2))
    lines = []
    found = tune_mod.tune(["tiny"], (64,), reps=1, save=False, log=lines.append)
    assert len(found) == 2
    for entry in found.values():  # the next fastest: 16-row blocks unsplit (10 + 1 + 16/16 us)
        assert (entry["block_m"], entry["split_k"], entry["time_us"]) == (16, 1, 12.0)
    rejected = [line for line in lines if "rejected" in line]
    assert len(rejected) == 2 and all("64 S=2 (1.0 us, off by 1.0e+00)" in line for line in rejected)


@pytest.mark.parametrize("m", [1, 3])
def test_tune_times_one_pair_per_block_as_fused_moe_runs_it(fake, m):
    """fused_moe runs M = 1, and a few tokens of small experts (configs.one_pair_blocks), with one pair per 16-row
    block and no aligned list, so the tuner times exactly that: 16-row candidates only, each launched without an
    aligned list, the warps-along-K one in 64-k stages. More tokens are aligned."""
    tune_mod.tune(["tiny"], (m,), reps=1, save=False, log=lambda line: None)
    assert fake.launched and all(one_pair and c.block_m == 16 for c, _, one_pair in fake.launched)
    warps_k = {replace(c, split_k=1) for c, *_ in fake.launched if c.warps_k > 1}
    assert warps_k == {configs.DECODE_WK_ONE_PAIR}
    fake.launched.clear()
    tune_mod.tune(["tiny"], (5,), reps=1, save=False, log=lambda line: None)
    assert fake.launched and not any(one_pair for *_, one_pair in fake.launched)
