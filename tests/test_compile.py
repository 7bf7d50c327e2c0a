"""Every kernel instance compiles with NVRTC for sm_80 and sm_90(a), with no register spill. CPU only."""
import pytest

pytest.importorskip("cupy")
from cupy_moe import _compile, configs  # noqa: E402


def _nvrtc_ok():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC library not installed (pip install cupy_moe[nvrtc])")

ALIGN_NAMES = [f"moe_align_{kind}<{t}>" for kind in ("fused", "count", "scatter") for t in ("int", "long long")]
ALIGN_NAMES.append("moe_align_scan")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
@pytest.mark.parametrize("filename", ["moe_align.cu", *sorted(set(configs.KERNEL_FILES.values()))])
def test_compiles_without_spills(filename, arch):
    # every instance the launcher can request on this arch (sm_90a adds the Hopper variants)
    names = ALIGN_NAMES if filename == "moe_align.cu" else configs.all_name_expressions(arch, filename)
    log = _compile.compile_for_arch(filename, names, arch)
    report = _compile.parse_ptxas_report(log)
    assert len(report) == len(names), f"expected {len(names)} kernels in the ptxas report, got {len(report)}:\n{log}"
    spills = {k: v for k, v in report.items() if v.get("spill_stores") or v.get("spill_loads") or v.get("stack")}
    assert not spills, f"register spills / stack frames for {arch}: {spills}"
    assert all(v.get("registers", 0) <= 255 for v in report.values())


def test_compile_error_names_the_file():
    with pytest.raises(FileNotFoundError, match="no_such_kernel.cu"):
        _compile.compile_for_arch("no_such_kernel.cu", [], "sm_90")


def test_kernels_dir_holds_sources():
    d = _compile.kernels_dir()
    assert (d / "moe_gemm.cu").is_file() and (d / "moe_align.cu").is_file()
