"""The command line (demo, inspect, bench, tune) and every example, run as a user runs them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_moe import __main__ as cli
from cupy_moe._xp import gpu_available
from cupy_moe.__main__ import main
from cupy_moe.testing import write_checkpoint

REPO = Path(__file__).resolve().parent.parent


def run(*args, cwd=REPO, env=None, status=0):
    """Run python with args, stdout and stderr piped (so not terminals); check the exit status."""
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == status, proc.stdout + proc.stderr
    return proc


def one_line_error(capsys, argv, *needles):
    """main(argv) fails with exit status 2 and one line on stderr that holds every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------------------------------------------ demo


def test_demo_cpu_path_checks_the_layer_quietly_when_piped(tmp_path):
    proc = run("-m", "cupy_moe", "demo", "--cpu", "--dir", str(tmp_path))
    out = proc.stdout
    assert "NumPy reference path" in out and "hidden size 256" in out
    line = next(line for line in out.splitlines() if line.startswith("check:"))
    err = float(line.split("relative L2 error ")[1].split(",")[0])
    assert 0 < err <= 1e-3 and line.endswith("PASS")
    assert "NumPy path as asked (--cpu)" in out
    assert (tmp_path / "config.json").is_file() and str(tmp_path) in out
    assert "step 1/4" not in proc.stderr and "\r" not in proc.stderr  # stderr is a pipe: no progress bar


def test_demo_names_a_temporary_folder_only_as_temporary():
    out = run("-m", "cupy_moe", "demo", "--cpu", "--tokens", "3").stdout
    assert "temporary folder" in out and "cupy_moe_demo_" not in out


@pytest.mark.skipif(gpu_available(), reason="checks the advice printed on a machine without a GPU")
def test_demo_without_a_gpu_says_why_and_what_to_install():
    out = run("-m", "cupy_moe", "demo").stdout
    last = out.strip().splitlines()[-1]
    assert "The GPU path did not run" in last
    from cupy_moe import _xp
    if _xp.cupy is None:
        assert "CuPy is not installed" in last and 'pip install -e ".[cuda12,nvrtc12]"' in last
    else:  # CuPy is there: the advice is about the GPU, not about installing what is installed
        assert "no CUDA GPU found" in last and "pip install" not in last


def test_demo_matches_model_names_in_any_case(monkeypatch, capsys, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "demo_cpu", lambda args, folder, shape, why: seen.setdefault("shape", shape) and 0)
    assert main(["demo", "--cpu", "--model", "QWEN3-30b-a3b", "--dir", str(tmp_path)]) == 0
    assert seen["shape"].name == "Qwen3-30B-A3B"


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--model", "mixtral"], "argument --model: expected one of tiny, Mixtral-8x7B"),
    (["demo", "--tokens", "0"], "argument --tokens: expected a whole number >= 1, got 0"),
    (["tune", "--models", "Mixtral-8x7B,nope"], "got 'nope'"),
    (["tune", "--models", ","], "expected at least one model name"),
    (["tune", "--m", "1,x"], "argument --m: expected a whole number >= 1, got 'x'"),
    (["tune", "--reps", "-1"], "argument --reps"),
])
def test_bad_arguments_exit_2_before_any_gpu_check(monkeypatch, capsys, argv, needle):
    monkeypatch.setattr(cli, "gpu_problem", lambda: pytest.fail("looked for a GPU before checking arguments"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------------------ tune


def test_tune_takes_model_names_in_any_case_and_shows_progress_only_on_a_terminal(monkeypatch, capsys):
    calls = {}

    def fake_tune(models, ms, *, reps, save, log):
        calls.update(models=models, ms=ms, reps=reps, save=save)
        for _ in range(len(models) * 2 * len(ms)):
            log("a measured row")
        log("saved")
        return {}

    monkeypatch.setattr("cupy_moe.tune.tune", fake_tune)
    monkeypatch.setattr(cli, "require_gpu", lambda: None)
    assert main(["tune", "--models", "mixtral-8x7b,DEEPSEEK-v3", "--m", "1,16", "--reps", "3", "--dry-run"]) == 0
    assert calls == {"models": ["Mixtral-8x7B", "DeepSeek-V3"], "ms": (1, 16), "reps": 3, "save": False}
    out, err = capsys.readouterr()
    assert out.count("a measured row") == 8 and "saved" in out
    assert "tuning" not in err and "\r" not in err  # capsys' stderr is no terminal: no bar


def test_tune_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "gpu_problem", lambda: "no CUDA GPU found (test); install nothing")
    one_line_error(capsys, ["tune", "--models", "Qwen3-30B-A3B"], "python -m cupy_moe tune: error: no CUDA GPU found")


def test_progress_bars_are_off_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    from cupy_moe._progress import progress_enabled
    assert not progress_enabled()
    with cli.steps(2) as step:
        step.next("one")
        step.say("within one")
        step.next("two")
    assert "one" not in capsys.readouterr().err

    class Terminal:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with cli.steps(2) as step:
        step.next("writing")
    assert "writing" in term.text  # the same bar draws on a terminal


# ------------------------------------------------------------------------------------------------------ inspect


def test_inspect_summarises_layers_in_order(tmp_path, capsys):
    write_checkpoint(tmp_path, family="deepseek_v2", num_layers=3, hidden=64, intermediate=128, num_experts=4,
                     desc_act=True, return_weights=False)
    assert main(["inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    text = "\n".join(lines)
    assert "deepseek_v2" in text and "act-order yes" in text and "GPTQ 4-bit" in text
    assert "3 in all: 2 MoE, 1 dense" in text and "1 layers" not in text and "None" not in text
    header = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    rows = [line.split() for line in lines[header + 1:header + 4]]
    assert [r[0] for r in rows] == ["0", "1", "2"]                     # layers in order
    assert rows[0][1] == "dense" and rows[1][1:4] == ["MoE", "4/4", "gptq"]
    dtypes = lines[lines.index(next(line for line in lines if line.startswith("tensors "))) + 1:]
    assert any(line.split()[:2] == ["experts", "I32"] for line in dtypes)  # the tensor/dtype summary
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["moe_layers"] == [1, 2] and info["quantization"]["bits"] == 4


def test_inspect_says_which_routing_settings_are_defaults(tmp_path, capsys):
    # a DeepSeek-V3 config without its selection keys (as transformers 5 writes them): the model type's defaults,
    # each named with where it came from
    write_checkpoint(tmp_path, family="deepseek_v3", num_layers=2, hidden=64, intermediate=128, num_experts=16,
                     top_k=2, return_weights=False)  # the default n_group=8: two experts a group
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("topk_method", "n_group", "topk_group"):
        cfg.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", str(tmp_path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("routing defaults"))
    assert "topk_method=noaux_tc [default for deepseek_v3" in row and "config.json has no topk_method" in row
    assert "top_k=" not in row  # read from config.json, so not listed here


def test_inspect_problems_one_line_each(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, num_layers=1, return_weights=False)
    one_line_error(capsys, ["inspect", str(tmp_path / "nowhere")], "nowhere: no such folder")
    one_line_error(capsys, ["inspect", str(folder / "model.safetensors")], "expected a checkpoint folder")
    (folder / "quantize_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(capsys, ["inspect", str(folder)], str(folder), "no quantization config")

@pytest.mark.parametrize("size", [1000, 30000])  # in the header; in the data
def test_inspect_describes_a_truncated_file_as_a_problem_and_exits_1(tmp_path, capsys, size):
    write_checkpoint(tmp_path, num_layers=1, return_weights=False)
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(size)
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.startswith("problem:")]
    assert problems[0].startswith("problem: model.safetensors:") and "truncated" in problems[0], out


def test_inspect_reports_a_missing_shard_once_and_exits_1(tmp_path, capsys):
    write_checkpoint(tmp_path, family="qwen2_moe", num_layers=1, num_shards=2, return_weights=False)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert main(["inspect", str(tmp_path)]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1 and "model-00002-of-00002.safetensors" in problems[0], problems


def test_debug_shows_the_traceback(tmp_path):
    proc = run("-m", "cupy_moe", "inspect", str(tmp_path / "nowhere"), status=2)
    assert proc.stderr.strip() == f"python -m cupy_moe inspect: error: {tmp_path / 'nowhere'}: no such folder"
    for argv, env in ((["--debug", "inspect"], None), (["inspect"], {"CUPY_MOE_DEBUG": "1"})):
        proc = run("-m", "cupy_moe", *argv, str(tmp_path / "nowhere"), env=env, status=1)
        assert "Traceback" in proc.stderr and "no such folder" in proc.stderr


# ------------------------------------------------------------------------------------------------------ bench


@pytest.mark.parametrize("argv", [["bench", "--models", "tiny", "--iters", "3"],
                                  ["bench", "--", "--models", "tiny", "--iters", "3"],
                                  ["--debug", "bench", "--models", "tiny", "--iters", "3"]])
def test_bench_passes_every_argument_to_the_benchmark(monkeypatch, argv):
    seen = {}
    monkeypatch.setattr(cli, "run_script", lambda script, args: seen.update(script=script, args=args) or 7)
    monkeypatch.setattr("cupy_moe._xp.cupy", object())  # as if CuPy were installed, with a GPU
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    assert main(argv) == 7
    assert seen["args"] == ["--models", "tiny", "--iters", "3"]
    assert seen["script"] == REPO / "benchmarks" / "bench_gemm.py"


def test_bench_help_is_the_benchmarks_own():
    pytest.importorskip("cupy")
    out = run("-m", "cupy_moe", "bench", "--help").stdout
    assert "--iters" in out and "bench_gemm.py" in out


def test_bench_checks_its_token_counts_before_any_gpu_work():
    pytest.importorskip("cupy")
    err = run("-m", "cupy_moe", "bench", "--m", "1,x", status=2).stderr
    assert "bench_gemm.py: error: --m: expected positive token counts, comma-separated, got '1,x'" in err
    for args, message in ((["--phases", "up"], "--phases: expected gate_up and/or down, comma-separated, got 'up'"),
                          (["--iters", "0"], "--iters: expected a positive int, got 0"),
                          (["--json", "/no/such/folder/x.json"], "--json: expected a file in an existing folder")):
        assert message in run("-m", "cupy_moe", "bench", *args, status=2).stderr


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
def test_bench_without_a_gpu_is_one_line():
    pytest.importorskip("cupy")
    proc = run("-m", "cupy_moe", "bench", "--iters", "3", status=2)
    assert proc.stderr.count("\n") == 1 and "no CUDA GPU found" in proc.stderr


def test_bench_outside_a_checkout_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "cupy_moe" / "__main__.py"))
    one_line_error(capsys, ["bench"], "from a source checkout")


# ------------------------------------------------------------------------------------------------------ examples


def test_quickstart_checks_its_output():
    out = run(str(REPO / "examples" / "quickstart.py")).stdout
    assert "relative L2 error vs float64" in out


def test_all_layers_runs_every_layer():
    out = run(str(REPO / "examples" / "all_layers.py")).stdout
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("layer ")] == [
        "layer 0", "layer 1", "layer 2"]


def test_dlpack_interop_runs_or_skips_for_its_one_reason():
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "dlpack_interop.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    try:
        import torch
        ready = torch.cuda.is_available() and gpu_available()
    except ImportError:
        ready = False
    if ready:
        assert proc.returncode == 0, proc.stderr
        assert "zero-copy round trip: OK" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "skipped: this example needs PyTorch with CUDA and a CUDA GPU"


def test_every_example_has_a_test():
    tested = {"quickstart.py", "all_layers.py", "dlpack_interop.py",
              "run_checkpoint.py"}  # tests/test_run_checkpoint.py
    assert {p.name for p in (REPO / "examples").glob("*.py")} == tested
