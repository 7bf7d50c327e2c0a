"""The one kernel loader: `kernels/*.cu` -> `cupy.RawModule` -> `cupy.RawKernel`, lazily and cached.

Nothing here touches CuPy or a GPU at import time, so `import cupy_moe` works anywhere.

- `kernels_dir()` finds the CUDA sources: `cupy_moe/kernels` inside an installed wheel, else `<repo>/kernels`.
- `get_kernel(filename, name_expression)` compiles `kernels/<filename>` for the current device on first use
  (NVRTC through `cupy.RawModule`, `-std=c++17`, the kernels folder on the include path, a `#line` directive so
  compiler errors name the .cu file and its own lines) and caches the kernel per device.
- `compile_for_arch(filename, name_expressions, arch)` compiles without a GPU (NVRTC only) and returns the
  compiler log with the ptxas resource report; the CPU test uses it to catch compile errors and spills.

On compute capability 9.0 the target is `sm_90a` so that Hopper-only instructions (wgmma) are usable.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

__all__ = ["kernels_dir", "get_kernel", "compile_for_arch", "device_arch", "parse_ptxas_report"]

_PKG_DIR = Path(__file__).resolve().parent


def kernels_dir() -> Path:
    """The folder holding the .cu/.cuh sources (installed wheel first, then the repository checkout)."""
    for candidate in (_PKG_DIR / "kernels", _PKG_DIR.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"cupy_moe kernels folder not found: looked in {_PKG_DIR / 'kernels'} and {_PKG_DIR.parent / 'kernels'}")


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """Hash of every kernel source and header: CuPy's disk cache keys on the main source and the options only,
    so this goes into the options to make a changed header recompile."""
    h = hashlib.sha256()
    for p in sorted(kernels_dir().glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _source(filename: str) -> str:
    path = kernels_dir() / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {filename!r}: no such file in {kernels_dir()}")
    # `#line` makes NVRTC's messages point at the .cu file's own lines.
    return f'#line 1 "{path}"\n' + path.read_text()


def _options(arch: str) -> tuple[str, ...]:
    # NVRTC takes the first --gpu-architecture it is given; CuPy appends its own (plain sm_XX) after ours.
    opts = ("-std=c++17", f"-I{kernels_dir()}", f"--gpu-architecture={arch}", f"-DCUPY_MOE_SOURCES={_sources_digest()}")
    probe = os.environ.get("CUPY_MOE_PROBE")  # measurement only (benchmarks/probe_kernels.py): results are wrong
    return opts + (f"-DCUPY_MOE_PROBE={int(probe)}",) if probe else opts


def device_arch(device_id: int | None = None) -> str:
    """NVRTC target for a device (default: the current one): `sm_90a` on compute capability 9.0 (wgmma usable),
    else `sm_<major><minor>`."""
    from ._xp import require_gpu
    cp = require_gpu("compiling cupy_moe kernels")
    return _arch_of(cp.cuda.Device().id if device_id is None else device_id)


@functools.lru_cache(maxsize=None)
def _arch_of(device_id: int) -> str:
    from ._xp import cupy as cp
    cc = cp.cuda.Device(device_id).compute_capability  # e.g. "90"
    return "sm_90a" if cc == "90" else f"sm_{cc}"


@functools.lru_cache(maxsize=None)
def _module(filename: str, name_expressions: tuple[str, ...], arch: str):
    from ._xp import require_gpu
    cp = require_gpu(f"compiling kernels/{filename}")
    return cp.RawModule(code=_source(filename), options=_options(arch), name_expressions=list(name_expressions))


@functools.lru_cache(maxsize=None)
def _kernel(filename: str, name_expression: str, device_id: int):
    arch = device_arch(device_id)
    return _module(filename, (name_expression,), arch).get_function(name_expression)


def get_kernel(filename: str, name_expression: str):
    """The `cupy.RawKernel` for `name_expression` (e.g. `"moe_align<16>"`) from `kernels/<filename>`.

    Compiled on first use for the current device and cached (in memory here, on disk by CuPy).
    """
    from ._xp import require_gpu
    cp = require_gpu(f"kernel {name_expression}")
    return _kernel(filename, name_expression, cp.cuda.Device().id)


def compile_for_arch(filename: str, name_expressions, arch: str) -> str:
    """Compile `kernels/<filename>` with NVRTC for `arch` (e.g. "sm_80", "sm_90a"); no GPU needed.

    Returns the compiler log including ptxas's per-kernel report (registers, stack frame, spills).
    Raises RuntimeError with the log on a compile error.
    """
    from cupy.cuda import nvrtc  # NVRTC alone works without a driver
    name_expressions = list(name_expressions)
    prog = nvrtc.createProgram(_source(filename), str(kernels_dir() / filename), [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        opts = list(_options(arch)) + ["-ftz=true", "-Xptxas=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"compiling kernels/{filename} for {arch} failed:\n{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)
    header = "".join(f"// {name} -> {low}\n" for name, low in lowered.items())
    return header + log


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """{mangled kernel name: {"registers", "stack", "spill_stores", "spill_loads"}} from a `-Xptxas=-v` log."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (m := _SPILL.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            current["registers"] = int(m.group(1))
    return out
