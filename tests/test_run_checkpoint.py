"""examples/run_checkpoint.py, run as a user runs it, on checkpoints written by cupy_moe.testing and real tools."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_moe.testing import write_checkpoint

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "run_checkpoint.py"


def run(*args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("kw", [dict(family="deepseek_v3", num_layers=3, num_shards=2, desc_act=True),
                                dict(family="mixtral", quant_method="compressed-tensors", sym=False)])
def test_runs_a_written_checkpoint(tmp_path, kw):
    write_checkpoint(tmp_path, hidden=128, intermediate=128, num_experts=8, group_size=64, return_weights=False,
                     **kw)
    rc, out, err = run(tmp_path, "--layer", kw.get("num_layers", 1) - 1, "--tokens", 5)
    assert rc == 0, out + err
    assert f"{kw['family']} (" in out and "E=8 A=2 H=128 I=128" in out
    line = next(x for x in out.splitlines() if "relative L2 error" in x)
    assert line.endswith("OK") and "y (5, 128) float16" in line
    assert 0 < float(re.search(r"weights ([0-9.e+-]+) \(bar", line).group(1)) <= 1e-3


def test_runs_a_real_tool_checkpoint():
    rc, out, err = run(REPO / "tests" / "data" / "real" / "mixtral_gptq_w4_g64_actorder")
    assert rc == 0, out + err
    assert "mixtral (mlp.gate_proj naming), gptq 4-bit group 64" in out and out.rstrip().endswith("OK")


def test_a_repository_id_gets_a_download_hint(tmp_path):
    rc, out, err = run("someone/Some-MoE-GPTQ-Int4")
    assert rc == 2
    assert ("checkpoint folder not found ('someone/Some-MoE-GPTQ-Int4' looks like a Hugging Face repository id: "
            "download it first, e.g. `hf download someone/Some-MoE-GPTQ-Int4 --local-dir DIR`") in err
    rc, out, err = run(tmp_path)
    assert rc == 2 and "not a checkpoint folder: expected config.json and *.safetensors files, found neither" in err


@pytest.mark.parametrize("tokens", ["0", "-3"])
def test_tokens_below_one_are_an_argument_error(tokens):
    rc, out, err = run("--tokens", tokens)
    assert rc == 2 and f"argument --tokens: expected a whole number >= 1, got {int(tokens)}" in err, out + err
    assert "OK" not in out and "Traceback" not in err
