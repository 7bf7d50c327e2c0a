"""benchmarks/plot_bench.py: the roofline fraction of a benchmark row, from either key set a row may carry."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "plot_bench.py"
_spec = importlib.util.spec_from_file_location("plot_bench", _PATH)
plot_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_bench)


def test_roofline_fraction_from_floors_or_ratios():
    floors = dict(model="m", phase="down", m=1, time_us=10.0, traffic_floor_us=8.0, flop_floor_us=1.0)
    ratios = dict(model="m", phase="down", m=1, time_us=10.0, floor_ratio=0.8, flop_ratio=0.1)
    assert plot_bench.roofline_fraction(floors) == pytest.approx(0.8)
    assert plot_bench.roofline_fraction(ratios) == pytest.approx(0.8)
    prefill = dict(model="m", phase="gate_up", m=4096, time_us=100.0, traffic_floor_us=6.0, flop_ratio=0.61)
    assert plot_bench.roofline_fraction(prefill) == pytest.approx(0.61)  # the FLOP floor is the roofline here


def test_roofline_fraction_names_the_missing_keys():
    with pytest.raises(ValueError, match="flop_floor_us"):
        plot_bench.roofline_fraction(dict(model="m", phase="down", m=1, time_us=10.0, traffic_floor_us=8.0))


def test_plot_writes_a_png(tmp_path):
    rows = [dict(model=model, phase=phase, m=m, time_us=10.0 * m, floor_ratio=0.5, flop_ratio=0.1)
            for model in ("DeepSeek-V3", "mixtral-8x7b") for phase in ("gate_up", "down") for m in (1, 16, 1024)]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(dict(gpu="test GPU", copy_bw=4e12, mm_rate=7e14, rows=rows)))
    plot_bench.main(src, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_bench._model_order(["DeepSeek-V3", "mixtral-8x7b", "other"]) == ["mixtral-8x7b", "DeepSeek-V3", "other"]
