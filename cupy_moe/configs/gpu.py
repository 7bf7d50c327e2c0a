"""The target GPU as the configuration choice sees it: name, NVRTC arch, SM count, whether the Hopper kernels run.

`gpu_info()` asks the current device once per device id; without a GPU, callers (and tests) build a `GpuInfo`
themselves and pass it to `choose_config(..., gpu=...)`.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, replace

__all__ = ["GpuInfo", "gpu_info", "hopper_enabled"]


@dataclass(frozen=True)
class GpuInfo:
    """name: the device name (`cudaDeviceProp.name`, e.g. "NVIDIA H200"), which selects the tuned table;
    arch: the NVRTC target ("sm_90a" on compute capability 9.0); sm_count: `multiProcessorCount`;
    hopper: whether the sm_90a kernels run (the tc kernel's wgmma variant and the swapped-operand kernel)."""
    name: str
    arch: str
    sm_count: int
    hopper: bool

    def __post_init__(self):
        if isinstance(self.sm_count, bool) or not isinstance(self.sm_count, int) or self.sm_count < 1:
            raise ValueError(f"sm_count: expected a positive int, got {self.sm_count!r}")
        if not re.fullmatch(r"sm_\d+a?", str(self.arch)):
            raise ValueError(f"arch: expected an NVRTC target like 'sm_90a', got {self.arch!r}")
        if self.hopper and self.arch != "sm_90a":
            raise ValueError(f"hopper: expected False for arch {self.arch!r} (the Hopper kernels need sm_90a), "
                             "got True")


def hopper_enabled(arch: str) -> bool:
    """Whether the Hopper kernels run: on `sm_90a` unless the environment sets CUPY_MOE_HOPPER=0 (the portable
    kernels then run, e.g. to compare)."""
    return arch == "sm_90a" and os.environ.get("CUPY_MOE_HOPPER", "1") != "0"


def gpu_info(device_id: int | None = None) -> GpuInfo:
    """The `GpuInfo` of a device (default: the current one). The device's properties are read once per id;
    CUPY_MOE_HOPPER is read on every call."""
    from .._xp import require_gpu
    cp = require_gpu("reading the GPU's properties")
    info = _device_facts(cp.cuda.Device().id if device_id is None else int(device_id))
    return info if hopper_enabled(info.arch) else replace(info, hopper=False)


@functools.lru_cache(maxsize=None)
def _device_facts(device_id: int) -> GpuInfo:
    from .. import _compile
    from .._xp import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    arch = _compile.device_arch(device_id)
    return GpuInfo(name, arch, int(props["multiProcessorCount"]), arch == "sm_90a")
