"""The layer kernels (kernels/moe_layer.cu) compile with NVRTC for sm_80 and sm_90 without spills. CPU only."""
import pytest

pytest.importorskip("cupy")
from cupy_moe import _compile  # noqa: E402
from cupy_moe.layer import KERNEL_NAMES  # noqa: E402


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_layer_kernels_compile_without_spills(arch):
    report = _compile.parse_ptxas_report(_compile.compile_for_arch("moe_layer.cu", KERNEL_NAMES, arch))
    assert len(report) == len(KERNEL_NAMES)
    for name, usage in report.items():
        assert usage["spill_stores"] == usage["spill_loads"] == usage["stack"] == 0, (name, usage)
