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


# the file of each GEMM kernel template (configs.GemmConfig.source_file must agree, see below)
GEMM_FILES = {"moe_gemm": "moe_gemm_decode.cu", "moe_gemm_tc": "moe_gemm_prefill.cu",
              "moe_gemm_swapped": "moe_gemm_swapped.cu"}


def _names(filename, arch):
    if filename == "moe_align.cu":
        return ALIGN_NAMES
    return [n for n in configs.all_name_expressions(arch) if GEMM_FILES[n.split("<")[0]] == filename]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
@pytest.mark.parametrize("filename", ["moe_align.cu", *GEMM_FILES.values()])
def test_compiles_without_spills(filename, arch):
    # every instance the launcher can request on this arch (sm_90a adds the Hopper variants); a file with none on
    # this arch (the swapped kernel below sm_90a) must still compile
    names = _names(filename, arch)
    log = _compile.compile_for_arch(filename, names, arch)
    report = _compile.parse_ptxas_report(log)
    assert len(report) == len(names), f"expected {len(names)} kernels in the ptxas report, got {len(report)}:\n{log}"
    spills = {k: v for k, v in report.items() if v.get("spill_stores") or v.get("spill_loads") or v.get("stack")}
    assert not spills, f"register spills / stack frames for {arch}: {spills}"
    assert all(v.get("registers", 0) <= 255 for v in report.values())


def test_every_gemm_instance_has_a_file():
    names = {n for arch in ("sm_80", "sm_90", "sm_90a") for n in configs.all_name_expressions(arch)}
    assert {n.split("<")[0] for n in names} == set(GEMM_FILES)
    assert len(_names("moe_gemm_swapped.cu", "sm_90a")) > 0 and not _names("moe_gemm_swapped.cu", "sm_80")


@pytest.mark.parametrize("cfg", [*configs.KERNEL_SHAPES.values(), *configs.HOPPER_SHAPES.values(),
                                 *configs.SPLIT_WARPS_SHAPES.values(), *configs.ACT_ORDER_SHAPES.values()])
def test_source_file_holds_the_config_kernel(cfg):
    # the launcher compiles cfg.source_file for the instance kernel_instance names
    hopper = cfg.kind == "ws"
    _, name, _ = configs.kernel_instance(cfg, False, 4, False, 32, hopper=hopper)
    assert GEMM_FILES[name.split("<")[0]] == cfg.source_file
    assert f"{name.split('<')[0]}(" in (_compile.kernels_dir() / cfg.source_file).read_text()


def test_compile_error_names_the_file():
    with pytest.raises(FileNotFoundError, match="no_such_kernel.cu"):
        _compile.compile_for_arch("no_such_kernel.cu", [], "sm_90")


def test_kernels_dir_holds_sources():
    d = _compile.kernels_dir()
    for name in ("moe_align.cu", "moe_layer.cu", *GEMM_FILES.values(), "moe_gemm_common.cuh", "gptq_dequant.cuh",
                 "smem_pipeline.cuh", "split_k.cuh", "hopper.cuh", "pdl.cuh"):
        assert (d / name).is_file(), name
