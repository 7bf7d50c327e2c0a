"""The wheel ships kernels/*.cu and the package finds them once installed; import works without CuPy."""
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from cupy_moe import _compile

REPO = Path(__file__).resolve().parent.parent


def test_checkout_finds_every_kernel_source():
    assert _compile.kernels_dir() == REPO / "kernels"
    sources = sorted(p.name for p in (REPO / "kernels").glob("*.cu"))
    assert {"moe_align.cu", "moe_gemm_decode.cu", "moe_gemm_prefill.cu", "moe_gemm_swapped.cu",
            "moe_layer.cu"} <= set(sources)
    headers = sorted(p.name for p in (REPO / "kernels").glob("*.cuh"))
    assert {"gptq_dequant.cuh", "hopper.cuh", "moe_gemm_common.cuh", "pdl.cuh", "smem_pipeline.cuh",
            "split_k.cuh"} <= set(headers)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True)
    (path,) = out.glob("cupy_moe-*.whl")
    return path


def test_wheel_contains_the_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for cu in (REPO / "kernels").glob("*.cu*"):
        assert f"cupy_moe/kernels/{cu.name}" in names


def test_wheel_contains_the_tuned_tables(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tables = sorted((REPO / "cupy_moe" / "configs" / "tuned").glob("*.json"))
    assert tables, "no tuned table ships"
    for table in tables:
        assert f"cupy_moe/configs/tuned/{table.name}" in names


def test_installed_wheel_loads_kernel_sources(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    # The fresh venv borrows numpy and safetensors from this environment, nothing from the checkout.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = textwrap.dedent("""
        import cupy_moe, cupy_moe._compile as c
        from pathlib import Path
        assert Path(cupy_moe.__file__).parent.parent.name == "site-packages", cupy_moe.__file__
        src = c._source("moe_gemm_decode.cu")
        assert src.startswith('#line 1 "') and "moe_gemm" in src
        from cupy_moe.configs import tuned
        assert tuned.shipped_dir().is_dir() and "site-packages" in str(tuned.shipped_dir())
        for table in tuned.shipped_dir().glob("*.json"):
            gpu = __import__("json").loads(table.read_text())["gpu"]
            assert tuned.load_table(gpu, (tuned.shipped_dir(),)) == tuned.read_table(table, gpu)
        assert all((c.kernels_dir() / h).is_file() for h in ("moe_gemm_common.cuh", "split_k.cuh", "smem_pipeline.cuh"))
        print(c.kernels_dir())
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == Path(purelib) / "cupy_moe" / "kernels"


def test_import_without_cupy_runs_numpy_and_explains_the_gpu_path():
    code = textwrap.dedent("""
        import sys
        sys.modules["cupy"] = None  # as if CuPy were not installed
        import numpy as np
        import cupy_moe
        assert not cupy_moe.gpu_available()
        ids = np.array([[0, 1], [1, 0]], np.int32)
        sorted_ids, expert_ids, total = cupy_moe.moe_align_block_size(ids, 16, 2)
        assert int(total[0]) == 32
        try:
            cupy_moe._compile.get_kernel("moe_layer.cu", "moe_sum<f16>")
        except RuntimeError as exc:
            assert "needs CuPy" in str(exc), exc
        else:
            raise AssertionError("no error without CuPy")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
