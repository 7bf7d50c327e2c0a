"""The target GPU as the configuration choice sees it: name, the NVRTC arch the kernels are built for, SM count.

`gpu_info()` asks the current device once per device id; without a GPU, callers (and tests) build a `GpuInfo`
themselves and pass it to `choose_config(..., gpu=...)`.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, replace

__all__ = ["GpuInfo", "gpu_info", "build_arch"]


@dataclass(frozen=True)
class GpuInfo:
    """name: the device name (`cudaDeviceProp.name`, e.g. "NVIDIA H200"), which selects the tuned table;
    arch: the NVRTC target the GEMM kernels are built for ("sm_90a" on compute capability 9.0, see build_arch);
    sm_count: `multiProcessorCount`."""
    name: str
    arch: str
    sm_count: int

    def __post_init__(self):
        if isinstance(self.sm_count, bool) or not isinstance(self.sm_count, int) or self.sm_count < 1:
            raise ValueError(f"sm_count: expected a positive int, got {self.sm_count!r}")
        if not re.fullmatch(r"sm_\d+a?", str(self.arch)):
            raise ValueError(f"arch: expected an NVRTC target like 'sm_90a', got {self.arch!r}")

    @property
    def hopper(self) -> bool:
        """Whether the sm_90a kernels run (the tc kernel's wgmma variant and the swapped-operand kernel)."""
        return self.arch == "sm_90a"


def build_arch(device_arch: str) -> str:
    """The target the GEMM kernels are built for on a device whose own target is `device_arch`: that one, except
    that CUPY_MOE_HOPPER=0 builds the portable sm_90 kernels on an sm_90a device (how the tests run the mma.sync
    kernels on a Hopper GPU)."""
    if device_arch == "sm_90a" and os.environ.get("CUPY_MOE_HOPPER", "1") == "0":
        return "sm_90"
    return device_arch


def gpu_info(device_id: int | None = None) -> GpuInfo:
    """The `GpuInfo` of a device (default: the current one). The device's properties are read once per id;
    CUPY_MOE_HOPPER is read on every call (build_arch)."""
    from .._xp import require_gpu
    cp = require_gpu("reading the GPU's properties")
    info = _device_facts(cp.cuda.Device().id if device_id is None else int(device_id))
    arch = build_arch(info.arch)
    return info if arch == info.arch else replace(info, arch=arch)  # a new object only for the portable build


@functools.lru_cache(maxsize=None)
def _device_facts(device_id: int) -> GpuInfo:
    from .. import _compile
    from .._xp import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return GpuInfo(name, _compile.device_arch(device_id), int(props["multiProcessorCount"]))
