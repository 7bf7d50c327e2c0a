"""The command line (demo, inspect, bench) and every example, run as a user runs them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_moe.__main__ import main
from cupy_moe.testing import write_checkpoint

REPO = Path(__file__).resolve().parent.parent


def run(*args, cwd=REPO):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_demo_cpu_path_checks_the_layer(tmp_path):
    out = run("-m", "cupy_moe", "demo", "--cpu", "--dir", str(tmp_path))
    assert "NumPy path" in out
    err = float(out.split("relative L2 error vs dense float64 on dequantized weights = ")[1].split()[0])
    assert 0 < err <= 1e-3
    assert (tmp_path / "config.json").is_file()


def test_inspect_describes_without_loading(tmp_path, capsys):
    write_checkpoint(tmp_path, family="deepseek_v2", num_layers=2, hidden=64, intermediate=128, num_experts=4,
                     desc_act=True, return_weights=False)
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "deepseek_v2" in text and "desc_act=True" in text and "layer 1: 4 experts (gptq)" in text
    assert "layer 0: dense" in text
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["moe_layers"] == [1] and info["quantization"]["bits"] == 4


def test_inspect_reports_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["inspect", str(tmp_path / "nowhere")])


def test_bench_passes_its_arguments_to_the_script():
    out = run("-m", "cupy_moe", "bench", "--help")
    assert "usage" in out.lower()


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_example_runs(example):
    out = run(str(REPO / "examples" / example))
    assert out.strip()
