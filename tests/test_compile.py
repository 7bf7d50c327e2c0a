"""Every kernel instance compiles with NVRTC for sm_80 and sm_90(a), with no register spill but the one bounded and
measured below. CPU only."""
import pytest

pytest.importorskip("cupy")
from cupy_moe import _compile, align, configs  # noqa: E402


def _nvrtc_ok():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC library not installed (the nvrtc12 / nvrtc13 extra)")

@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
@pytest.mark.parametrize("filename", ["moe_align.cu", *sorted(set(configs.KERNEL_FILES.values()))])
def test_compiles_without_spills(filename, arch):
    # every instance the launcher can request on this arch (sm_90a adds the Hopper variants); a file with none on
    # this arch (the swapped kernel below sm_90a) must still compile
    names = align.KERNEL_NAMES if filename == "moe_align.cu" else configs.all_name_expressions(arch, filename)
    log = _compile.compile_for_arch(filename, names, arch)
    report = _compile.parse_ptxas_report(log)
    assert len(report) == len(names), f"expected {len(names)} kernels in the ptxas report, got {len(report)}:\n{log}"
    # The swapped kernel's 48-row blocks run two CTAs per SM at 128 registers (its launch bound), which costs a few
    # loop-invariant values reloaded from L1: at most 44 bytes. Without the bound they take 147 registers and one CTA
    # per SM, and 1.10-1.33x the time (docs/heuristic.md, the swapped kernel).
    lowered = dict(line[3:].split(" -> ") for line in log.splitlines() if line.startswith("// "))
    bounded = {low for name, low in lowered.items() if name.startswith("moe_gemm_swapped<") and ", 48, " in name}
    assert bounded or filename != "moe_gemm_swapped.cu" or arch != "sm_90a"
    spills = {k: v for k, v in report.items() if (v.get("spill_stores") or v.get("spill_loads") or v.get("stack"))
              and not (k in bounded and max(v.get("spill_stores", 0), v.get("stack", 0)) <= 44)}
    assert not spills, f"register spills / stack frames for {arch}: {spills}"
    assert all(v.get("registers", 0) <= 255 for v in report.values())


def test_every_gemm_instance_has_a_file():
    # each instance's template lives in the file its kind names; the swapped kernel exists only on sm_90a
    files = {configs.TEMPLATES[kind]: f for kind, f in configs.KERNEL_FILES.items()}
    for arch in ("sm_80", "sm_90", "sm_90a"):
        for f in set(files.values()):
            for name in configs.all_name_expressions(arch, f):
                assert files[name.split("<")[0]] == f, (arch, name)
    assert configs.all_name_expressions("sm_90a", "moe_gemm_swapped.cu")
    assert not configs.all_name_expressions("sm_80", "moe_gemm_swapped.cu")


@pytest.mark.parametrize("cfg", [*configs.KERNEL_SHAPES.values(), *configs.HOPPER_SHAPES.values(),
                                 *configs.SPLIT_WARPS_SHAPES.values(), configs.DECODE_WK_ONE_PAIR,
                                 *configs.ACT_ORDER_SHAPES.values()])
def test_source_file_holds_the_config_kernel(cfg):
    # the launcher compiles cfg.source_file for the instance the config names
    name = cfg.name_expression(False, 4, False, 32, hopper=cfg.kind == "swapped")
    assert f"{name.split('<')[0]}(" in (_compile.kernels_dir() / cfg.source_file).read_text()


def test_compile_error_names_the_file():
    with pytest.raises(FileNotFoundError, match="no_such_kernel.cu"):
        _compile.compile_for_arch("no_such_kernel.cu", [], "sm_90")


def test_kernels_dir_holds_sources():
    d = _compile.kernels_dir()
    for name in ("moe_align.cu", "moe_layer.cu", *configs.KERNEL_FILES.values(), "moe_gemm_common.cuh", "gptq_dequant.cuh",
                 "smem_pipeline.cuh", "split_k.cuh", "hopper.cuh", "pdl.cuh"):
        assert (d / name).is_file(), name


def test_cubin_is_whole():
    # the ELF's section and program header tables lie inside the bytes returned (CuPy's own getCUBIN drops the last
    # byte, which cuobjdump then refuses)
    import struct
    cubin, lowered, _ = _compile.cubin_for_arch("moe_align.cu", align.KERNEL_NAMES, "sm_90a")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(align.KERNEL_NAMES)
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    assert phnum and shnum
    assert max(phoff + phentsize * phnum, shoff + shentsize * shnum) <= len(cubin)


@pytest.mark.compile
def test_ablation_variants_compile(monkeypatch):
    # tools/ablation.py removes or replaces statements of the kernels by their text: each must still occur in the
    # source and every variant must compile (the tool times them on a GPU)
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "tools" / "ablation.py"
    spec = importlib.util.spec_from_file_location("ablation", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    names = {"tc": [configs.PREFILL_128.name_expression(False, 4, False, 128, hopper=True)],
             "swapped": [c.name_expression(False, 4, False, 128, hopper=True) for c in configs.HOPPER_SHAPES.values()],
             "reg": [configs.DECODE.name_expression(False, 4, False, 128, hopper=True, pair_a=True),
                     configs.DECODE_WK_ONE_PAIR.name_expression(False, 4, False, 128, hopper=True)]}
    assert set(names) == set(tool.VARIANTS)
    monkeypatch.setattr(_compile, "_source", _compile._source)  # the tool swaps it; restored after the test
    for kind, (source_file, variants) in tool.VARIANTS.items():
        for variant, removed in variants.items():
            tool.use_variant(source_file, removed)
            report = _compile.parse_ptxas_report(_compile.compile_for_arch(source_file, names[kind], "sm_90a"))
            assert len(report) == len(names[kind]), f"{kind} {variant}: expected {len(names[kind])} kernels in the " \
                                                    f"ptxas report, got {report}"
        tool.use_variant(source_file, ())
