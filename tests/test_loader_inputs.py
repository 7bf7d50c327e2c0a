"""Bad arguments and malformed checkpoint folders fail up front, naming the argument or the file."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupy_moe import load_moe_layer, load_moe_model
from cupy_moe.checkpoint import inspect_checkpoint, load_stacked
from cupy_moe.testing import write_checkpoint

REPO = Path(__file__).resolve().parent.parent
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "ckpt"
    write_checkpoint(path, family="mixtral", hidden=64, intermediate=128, num_experts=4, top_k=2,
                     return_weights=False)
    return path


def _python(*args):
    """python ARGS in a subprocess: a FIFO opened by mistake hangs it, and the timeout fails the test."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def _inspect_cli(folder):
    return _python("-m", "cupy_moe", "inspect", str(folder))


def _load_error(folder) -> str:
    """The last line load_moe_layer(folder, 0, device=False) writes to stderr, run in a subprocess."""
    proc = _python("-c", f"import cupy_moe; cupy_moe.load_moe_layer({str(folder)!r}, 0, device=False)")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["directory", pytest.param("FIFO", marks=needs_fifo)])
def test_shard_that_is_not_a_regular_file(folder, kind):
    shard = folder / "model.safetensors"
    shard.unlink()
    shard.mkdir() if kind == "directory" else os.mkfifo(shard)
    message = f"{shard}: expected a safetensors file, got a {kind}, not a regular file"
    assert _load_error(folder) == f"ValueError: {message}"
    proc = _inspect_cli(folder)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"problem: {message}" in proc.stdout


@needs_fifo
def test_config_that_is_a_fifo(folder):
    config = folder / "config.json"
    config.unlink()
    os.mkfifo(config)
    message = f"{config}: expected a JSON file, got a FIFO, not a regular file"
    assert _load_error(folder) == f"ValueError: {message}"
    proc = _inspect_cli(folder)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key, value, problem", [
    ("hidden_size", math.nan, "config.json hidden_size: expected a positive int, got nan"),
    ("hidden_size", "64", "config.json hidden_size: expected a positive int, got '64'"),
    ("hidden_size", True, "config.json hidden_size: expected a positive int, got True"),
    ("intermediate_size", 128.0, "config.json intermediate_size: expected a positive int, got 128.0"),
    ("num_local_experts", "4", "config.json num_local_experts: expected a positive int, got '4'"),
])
def test_malformed_config_sizes(folder, key, value, problem):
    _edit_config(folder, **{key: value})
    assert problem in inspect_checkpoint(folder)["problems"]
    proc = _inspect_cli(folder)
    assert proc.returncode == 1 and f"problem: {problem}" in proc.stdout, proc.stdout + proc.stderr
    with pytest.raises(TypeError, match=re.escape(problem)):
        load_moe_layer(folder, 0, device=False)


def test_missing_config_sizes(folder):
    _edit_config(folder, hidden_size=None)
    assert inspect_checkpoint(folder)["problems"] == ["config.json has no hidden_size (or it is null)"]
    assert load_moe_layer(folder, 0, device=False).weights.hidden_size == 64  # the loader reads the tensors
    (folder / "config.json").write_text("{}")
    problems = inspect_checkpoint(folder)["problems"]
    assert {"config.json has no hidden_size (or it is null)",
            "config.json has no intermediate_size (or it is null)"} <= set(problems), problems


@pytest.mark.parametrize("layers, error, match", [
    ([0.7], TypeError, r"layers\[0\]: expected an int, got float"),
    (["0"], TypeError, r"layers\[0\]: expected an int, got str"),
    ([True], TypeError, r"layers\[0\]: expected an int, got bool"),
    (5, TypeError, r"layers: expected an iterable of ints \(layer indices\) or None, got 5"),
    ("0", TypeError, r"layers: expected an iterable of ints \(layer indices\) or None, got '0'"),
    ([0, 3], ValueError, r"layers\[1\]: layer 3 does not exist: config\.json has num_hidden_layers=1"),
])
def test_layers_argument(folder, layers, error, match):
    done = []
    with pytest.raises(error, match=match):
        load_moe_model(folder, device=False, layers=layers, progress=lambda *a: done.append(a))
    assert done == []  # refused before the first layer loads


def test_layers_argument_accepts_ints(folder):
    assert list(load_moe_model(folder, device=False, layers=(np.int64(0),), progress=False)) == [0]
    assert list(load_moe_model(folder, device=False, layers=iter([0]), progress=False)) == [0]


@pytest.mark.parametrize("progress", ["x", 1, 0.5])
def test_progress_argument(folder, progress, capsys):
    with pytest.raises(TypeError, match=re.escape(f"progress: expected None, True, False or a callable "
                                                  f"progress(done, total, layer), got {progress!r}")):
        load_moe_model(folder, device=False, progress=progress)
    assert capsys.readouterr().err == ""  # no bar drawn


@pytest.mark.parametrize("path", [None, 3, b"ckpt", ["ckpt"]])
def test_path_argument(path):
    match = re.escape(f"path: expected a checkpoint folder (str or os.PathLike), got {path!r}")
    for call in (lambda: load_moe_layer(path, 0, device=False), lambda: load_moe_model(path, device=False),
                 lambda: inspect_checkpoint(path)):
        with pytest.raises(TypeError, match=match):
            call()


@pytest.mark.parametrize("device", ["no", 0, None])
def test_device_argument(folder, device):
    match = re.escape(f"device: expected True (CuPy arrays) or False (NumPy arrays), got {device!r}")
    for call in (lambda: load_moe_layer(folder, 0, device=device), lambda: load_moe_model(folder, device=device),
                 lambda: load_stacked(folder, 0, "w13", device=device)):
        with pytest.raises(TypeError, match=match):
            call()
