"""The performance targets of `cupy_moe.timing` (the timing functions themselves need a GPU), and the random
activations that timings run on (one GPU test)."""
import numpy as np
import pytest

from cupy_moe.timing import layer_target, random_activations, regime_summary, roofline_target

us = 1e-6


def test_roofline_targets_by_regime():
    # M <= 64: within the traffic floor / 0.85; under 10 us of floor, floor + 4 us
    assert roofline_target(1, 20 * us, 1 * us) == pytest.approx(20 * us / 0.85)
    assert roofline_target(64, 2.5 * us, 0.1 * us) == pytest.approx(6.5 * us)
    assert roofline_target(16, 12 * us, 50 * us) == pytest.approx(12 * us / 0.85)  # the FLOP floor is not judged
    # M >= 128: within the larger floor / 0.70
    assert roofline_target(128, 60 * us, 50 * us) == pytest.approx(60 * us / 0.70)
    assert roofline_target(4096, 60 * us, 350 * us) == pytest.approx(500 * us)
    # between the regimes: no target
    assert roofline_target(65, 60 * us, 50 * us) is None and roofline_target(127, 1 * us, 1 * us) is None


def test_layer_target_adds_launch_time_to_the_phase_floors():
    us = 1e-6
    assert layer_target(7 * us) == pytest.approx(13 * us)      # 7 / 0.70 + 3
    assert layer_target(0.0) == pytest.approx(3 * us)


def test_regime_summary_groups_rows_by_the_targets_regimes():
    rows = [dict(m=1, roofline_ratio=0.5, **{"pass": True}), dict(m=1, roofline_ratio=0.8, **{"pass": False}),
            dict(m=64, roofline_ratio=0.9, **{"pass": True}), dict(m=4096, roofline_ratio=0.4, **{"pass": False}),
            dict(m=600, roofline_ratio=0.4, **{"pass": True})]
    lines = regime_summary(rows)
    assert lines == ["M = 1: 2 rows, roofline 0.50 / 0.63 / 0.80 (min / geometric mean / max), 1 meet the target",
                     "1 < M <= 64: 1 rows, roofline 0.90 / 0.90 / 0.90 (min / geometric mean / max), 1 meet the target",
                     "M > 512: 2 rows, roofline 0.40 / 0.40 / 0.40 (min / geometric mean / max), 1 meet the target"]
    assert regime_summary([dict(m=256, roofline_ratio=0.25)]) == [
        "64 < M <= 512: 1 rows, roofline 0.25 / 0.25 / 0.25 (min / geometric mean / max)"]


def test_weight_copies_cover_512_mib_up_to_4():
    from cupy_moe.timing import weight_copies
    assert [weight_copies(mib << 20) for mib in (1024, 512, 200, 100, 1)] == [1, 1, 3, 4, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_random_activations_are_seeded_normal_samples_on_the_device(dtype):
    import cupy as cp
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    x = random_activations((512, 384), dtype, seed=3)
    assert isinstance(x, cp.ndarray) and x.shape == (512, 384) and x.dtype == np.dtype(dtype)
    assert bool((x == random_activations((512, 384), dtype, seed=3)).all())
    assert not bool((x == random_activations((512, 384), dtype, seed=4)).all())
    values = cp.asnumpy(x).astype(np.float32)
    assert abs(values.mean()) < 0.02 and 0.97 < values.std() < 1.03
    half = cp.asnumpy(random_activations((512, 384), dtype, seed=3, scale=0.5)).astype(np.float32)
    assert np.allclose(half, 0.5 * values, rtol=1e-2, atol=1e-3)


def test_random_activations_need_a_gpu(monkeypatch):
    from cupy_moe import _xp
    monkeypatch.setattr(_xp, "gpu_available", lambda: False)
    with pytest.raises(RuntimeError, match="timing needs"):
        random_activations((4, 4), np.float16, seed=0)
