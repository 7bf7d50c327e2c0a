"""The command line (demo, inspect, bench, tune) and every example, run as a user runs them."""
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cupy_moe import __main__ as cli
from cupy_moe._xp import gpu_available
from cupy_moe.__main__ import main
from cupy_moe.models import get_model
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
    (["demo", "--seed", "-1"], "argument --seed: expected a whole number >= 0, got -1"),
    (["demo", "--tokens", str(10**15)], "argument --tokens: expected a whole number <= 1,048,576, got 1,000,000,000"),
    (["tune", "--m", "1," + "9" * 20], "argument --m: expected a whole number <= 1,048,576, got 99,999"),
    (["inspect", ""], "python -m cupy_moe inspect: error: argument PATH: expected a path, got ''"),
    (["demo", "--dir", ""], "python -m cupy_moe demo: error: argument --dir: expected a path, got ''"),
    (["demo", "--debug"], "unrecognized arguments: --debug; --debug goes before the command: python -m cupy_moe "
                          "--debug demo"),
    (["tune", "--dry-run", "--debug", "x"], "unrecognized arguments: --debug x; --debug goes before the command"),
])
def test_bad_arguments_exit_2_before_any_gpu_check(monkeypatch, capsys, argv, needle):
    monkeypatch.setattr(cli, "gpu_problem", lambda: pytest.fail("looked for a GPU before checking arguments"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def demo_must_not_start(monkeypatch):
    for name in ("gpu_problem", "demo_cpu", "demo_gpu"):
        monkeypatch.setattr(cli, name, lambda *a: pytest.fail("the demo started before checking --dir"))


def test_demo_refuses_a_folder_that_holds_anything_and_leaves_it_alone(monkeypatch, capsys, tmp_path):
    demo_must_not_start(monkeypatch)
    (tmp_path / "mine.json").write_text("{}")
    (tmp_path / "weights.safetensors").write_bytes(b"precious")
    one_line_error(capsys, ["demo", "--cpu", "--dir", str(tmp_path)],
                   "argument --dir: expected a new or empty folder", str(tmp_path), "2 entries")
    assert (tmp_path / "mine.json").read_text() == "{}"
    assert (tmp_path / "weights.safetensors").read_bytes() == b"precious"


def test_demo_checks_dir_before_starting(monkeypatch, capsys, tmp_path):
    demo_must_not_start(monkeypatch)
    (tmp_path / "afile").write_text("x")
    one_line_error(capsys, ["demo", "--dir", str(tmp_path / "afile")], "argument --dir", "got a file",
                   str(tmp_path / "afile"))
    one_line_error(capsys, ["demo", "--dir", str(tmp_path / "afile" / "sub")], "argument --dir",
                   "expected a folder that can be created", str(tmp_path / "afile" / "sub"))


def test_demo_creates_a_new_dir(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "demo_cpu", lambda args, folder, shape, why: seen.setdefault("folder", folder) and 0)
    assert main(["demo", "--cpu", "--dir", str(tmp_path / "new" / "ckpt")]) == 0
    assert seen["folder"] == tmp_path / "new" / "ckpt" and seen["folder"].is_dir()


def test_a_demo_stopped_while_writing_leaves_its_dir_empty(monkeypatch, tmp_path):
    """--dir holds nothing of a checkpoint whose writing did not finish, so the same command runs again."""
    import cupy_moe.testing

    def write_then_stop(folder, **kw):
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(cupy_moe.testing, "write_checkpoint", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        cli.write_demo_checkpoint(tmp_path, get_model("tiny"), 0)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    cli.write_demo_checkpoint(tmp_path, get_model("tiny"), 0)
    assert {f.name for f in tmp_path.iterdir()} >= {"config.json", "model.safetensors"}


def test_demo_cpu_says_its_disk_and_memory_first(tmp_path):
    out = run("-m", "cupy_moe", "demo", "--cpu", "--tokens", "2", "--dir", str(tmp_path)).stdout
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "Estimated:" in line)
    assert at < next(i for i, line in enumerate(lines) if line.startswith("check:"))
    assert "NumPy path as asked (--cpu)" in lines[at] and "on disk" in lines[at] and "of memory" in lines[at]
    disk, peak = cli.cpu_footprint(cli.get_model("tiny"))
    written = sum(f.stat().st_size for f in tmp_path.iterdir())
    assert 0.8 * written <= disk <= 1.25 * written, (disk, written)  # the estimate is the checkpoint's size
    assert peak > disk


def test_cpu_footprint_of_a_large_model_says_gigabytes():
    disk, peak = cli.cpu_footprint(cli.get_model("DeepSeek-V3"))
    weights = 3 * 7168 * 2048 * 257
    assert weights / 2 < disk < weights * 0.6  # 4 bits a weight, plus scales and zeros
    assert disk + 8 * 2 * 7168 * 2048 * 8 <= peak  # top-8 experts' gate/up in float64 for one token


def test_the_float64_check_holds_one_expert_at_a_time(tmp_path):
    from cupy_moe import MoELayer
    from cupy_moe.testing import dense_layer_output
    h, i, e = 256, 512, 8
    write_checkpoint(tmp_path, hidden=h, intermediate=i, num_experts=e, top_k=2, group_size=64,
                     return_weights=False)
    layer = MoELayer.from_checkpoint(tmp_path, 0, device=False)
    x = np.random.default_rng(0).standard_normal((16, h)).astype(np.float16)
    assert len(np.unique(layer.route(x)[1])) >= 6
    tracemalloc.start()
    try:
        ref = dense_layer_output(layer, x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_expert = 3 * h * i * 8
    assert peak < 3 * one_expert, (peak, one_expert)  # caching every expert used would take 6 or more
    assert np.linalg.norm(ref - layer(x).astype(np.float64)) <= 1e-3 * np.linalg.norm(ref)


def test_sigterm_removes_the_demo_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "cupy_moe", "demo", "--cpu", "--model", "Mixtral-8x7B"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("cupy_moe_demo_*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp_path.glob("cupy_moe_demo_*")), "the demo made no temporary folder"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "python -m cupy_moe demo: interrupted (SIGTERM)"
    assert not list(tmp_path.glob("cupy_moe_demo_*"))


def test_main_restores_the_signal_handlers(tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


def run_into_a_closed_pipe(*args):
    """Run python -m cupy_moe with args, its stdout a pipe whose reader has already gone (as `| head` leaves it)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "cupy_moe", *args], cwd=REPO, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    return proc


@pytest.mark.parametrize("command", ["inspect", "demo"])
def test_a_closed_pipe_ends_quietly_with_status_141(tmp_path, command):
    write_checkpoint(tmp_path, num_layers=1, return_weights=False)
    args = ["inspect", str(tmp_path)] if command == "inspect" else ["demo", "--cpu", "--tokens", "1"]
    proc = run_into_a_closed_pipe(*args)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_cupy_moe_console_script_names_itself(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/cupy-moe", "inspect", str(tmp_path / "nowhere")])
    assert main() == 2
    assert capsys.readouterr().err.startswith("cupy-moe inspect: error: ")
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/cupy-moe", "demo", "--tokens", "0"])
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().err.startswith("cupy-moe demo: error: argument --tokens")
    monkeypatch.setattr(sys, "argv", ["/x/cupy_moe/__main__.py", "inspect", str(tmp_path / "nowhere")])
    assert main() == 2
    assert capsys.readouterr().err.startswith("python -m cupy_moe inspect: error: ")


@pytest.mark.parametrize("value", ["", "0", "false", "No", "OFF", " off "])
def test_debug_variable_off_values(monkeypatch, capsys, tmp_path, value):
    monkeypatch.setenv("CUPY_MOE_DEBUG", value)
    one_line_error(capsys, ["inspect", str(tmp_path / "nowhere")], "no such folder")


@pytest.mark.parametrize("value", ["1", "yes", "true", "on"])
def test_debug_variable_on_values(monkeypatch, tmp_path, value):
    monkeypatch.setenv("CUPY_MOE_DEBUG", value)
    with pytest.raises(cli.CliError):
        main(["inspect", str(tmp_path / "nowhere")])


# ------------------------------------------------------------------------------------------------------ tune


def test_tune_drops_repeated_models_and_token_counts():
    args = cli.parse(["tune", "--models", "mixtral-8x7b,DeepSeek-V3,Mixtral-8x7B", "--m", "16,1,16,4,1"])
    assert args.models == ["Mixtral-8x7B", "DeepSeek-V3"] and args.m == (16, 1, 4)


def test_tune_checks_its_cache_folder_before_any_gpu_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "gpu_problem", lambda: pytest.fail("looked for a GPU before checking the cache"))
    (tmp_path / "afile").write_text("x")
    for path, needle in ((tmp_path / "afile", "got a file"), (tmp_path / "afile" / "sub", "cannot be created")):
        monkeypatch.setenv("CUPY_MOE_CACHE_DIR", str(path))
        one_line_error(capsys, ["tune", "--models", "Mixtral-8x7B"], "CUPY_MOE_CACHE_DIR", str(path), needle)
    monkeypatch.setattr(cli, "require_gpu", lambda: None)  # --dry-run saves nothing: no cache folder needed
    monkeypatch.setattr("cupy_moe.tune.tune", lambda models, ms, **kw: {})
    assert main(["tune", "--models", "Mixtral-8x7B", "--dry-run"]) == 0


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


def test_inspect_json_is_strict_with_non_finite_numbers_as_strings(tmp_path, capsys):
    write_checkpoint(tmp_path, family="deepseek_v3", num_layers=2, hidden=64, intermediate=128, num_experts=16,
                     top_k=2, extra_config={"routed_scaling_factor": float("nan")}, return_weights=False)
    main(["inspect", str(tmp_path), "--json"])

    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    info = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert info["routing"]["routed_scaling_factor"]["value"] == "NaN"
    from cupy_moe._inspect_text import finite_json
    assert finite_json({"a": [float("inf"), -float("inf"), 1.5, "x"]}) == {"a": ["Infinity", "-Infinity", 1.5, "x"]}


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
    monkeypatch.setattr(cli, "run_script",
                        lambda script, args, prog: seen.update(script=script, args=args, prog=prog) or 7)
    monkeypatch.setattr("cupy_moe._xp.cupy", object())  # as if CuPy were installed, with a GPU
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    assert main(argv) == 7
    assert seen["args"] == ["--models", "tiny", "--iters", "3"]
    assert seen["script"] == REPO / "benchmarks" / "bench_gemm.py" and seen["prog"] == "python -m cupy_moe bench"


def test_bench_help_is_the_benchmarks_own():
    pytest.importorskip("cupy")
    out = run("-m", "cupy_moe", "bench", "--help").stdout
    assert "--iters" in out and "bench_gemm.py" in out


BENCH_ERRORS = [
    (["--models", "nope"], "argument --models: expected one of tiny, Mixtral-8x7B"),
    (["--m", "-1"], "argument --m: expected a whole number >= 1, got -1"),
    (["--m", "1,x"], "argument --m: expected a whole number >= 1, got 'x'"),
    (["--iters", "0"], "argument --iters: expected a whole number >= 1, got 0"),
    (["--tiles", "garbage"], "argument --tiles: expected 'kind:mt,warps_m,warps_n,ng,ku,stages,warps_k[/split_k]', "
                             "got 'garbage'"),
    (["--dtype", "float32"], "argument --dtype: invalid choice: 'float32'"),
    (["--block-m", "96"], "argument --block-m: invalid choice: 96"),
    (["--phases", "up"], "argument --phases: expected gate_up and/or down, comma-separated, got 'up'"),
    (["--json", "/no/such/folder/x.json"], "argument --json: expected a file in an existing folder"),
    (["--dtype", "bfloat16"], "argument --dtype: expected float16 without --no-baseline"),
]


@pytest.mark.parametrize("args, needle", BENCH_ERRORS)
def test_bench_checks_its_arguments_in_one_line_before_any_gpu_work(monkeypatch, capsys, args, needle):
    pytest.importorskip("cupy")
    monkeypatch.setattr("cupy_moe.configs.gpu_info", lambda: pytest.fail("looked at the GPU before the arguments"))
    err = one_line_error(capsys, ["bench", *args], "python -m cupy_moe bench: error: ", needle)
    assert "usage" not in err and "bench_gemm" not in err


@pytest.mark.parametrize("args, needle", BENCH_ERRORS[:1] + BENCH_ERRORS[4:5])
def test_the_benchmark_run_directly_names_itself_in_one_line(args, needle):
    pytest.importorskip("cupy")
    err = run(str(REPO / "benchmarks" / "bench_gemm.py"), *args, status=2).stderr
    assert err.startswith("bench_gemm.py: error: ") and err.count("\n") == 1, err
    assert needle in err, err


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


def test_quickstart_checks_under_python_O_too():
    # a reference made wrong on purpose: the example must fail, also when asserts are off
    script = ("import runpy, cupy_moe.testing as t; real = t.dense_layer_output; "
              "t.dense_layer_output = lambda layer, x: 2 * real(layer, x); "
              f"runpy.run_path({str(REPO / 'examples' / 'quickstart.py')!r}, run_name='__main__')")
    proc = run("-O", "-c", script, status=1)
    assert "FAILED: relative L2 error" in proc.stderr


def test_all_layers_refuses_a_missing_folder_in_one_line(tmp_path):
    proc = run(str(REPO / "examples" / "all_layers.py"), str(tmp_path / "nowhere"), status=2)
    assert proc.stderr.count("\n") == 1 and "nowhere: expected a checkpoint folder, no such folder" in proc.stderr


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
