"""The performance targets of `cupy_moe.timing` (the timing functions themselves need a GPU). CPU only."""
import pytest

from cupy_moe.timing import layer_target, roofline_target

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
