"""The one kernel loader: `kernels/*.cu` -> `cupy.RawModule` -> `cupy.RawKernel`, lazily and cached.

Nothing here touches CuPy or a GPU at import time, so `import cupy_moe` works anywhere.

- `kernels_dir()` finds the CUDA sources: `cupy_moe/kernels` inside an installed wheel, else `<repo>/kernels`.
- `get_kernel(filename, name_expression)` compiles `kernels/<filename>` for the current device on first use
  (NVRTC through `cupy.RawModule`, `-std=c++17`, the kernels folder on the include path for the shared .cuh
  headers, a `#line` directive so compiler errors name the .cu file and its own lines) and caches the kernel per
  device. The GEMM kernels live one family per file (configs.GemmConfig.source_file names it).
- `launch(kernel, grid, block, args, shared_mem)` starts a kernel on the current stream; on compute capability 9.0
  and later with programmatic dependent launch (kernels/pdl.cuh), so that its launch overlaps the tail of the
  previous kernel of the stream (also inside a CUDA graph). CUPY_MOE_PDL=0 in the environment turns that off.
- `compile_for_arch(filename, name_expressions, arch)` compiles without a GPU (NVRTC only) and returns the
  compiler log with the ptxas resource report; the CPU test uses it to catch compile errors and spills.
  `cubin_for_arch` returns the machine code too (tools/sass_digest.py disassembles it).

On compute capability 9.0 the target is `sm_90a` so that Hopper-only instructions (wgmma) are usable.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
from pathlib import Path

import numpy as np

__all__ = ["kernels_dir", "get_kernel", "launch", "compile_for_arch", "cubin_for_arch", "device_arch",
           "parse_ptxas_report"]

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
    """Hash of every kernel source and header (kernels/*.cu, *.cuh): CuPy's disk cache keys on the main source and
    the options only, so this goes into the options to make a changed header recompile."""
    h = hashlib.sha256()
    for p in sorted(p for p in kernels_dir().iterdir() if p.suffix in (".cu", ".cuh")):
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
    return ("-std=c++17", f"-I{kernels_dir()}", f"--gpu-architecture={arch}", f"-DCUPY_MOE_SOURCES={_sources_digest()}")


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
def _kernel(filename: str, name_expression: str, device_id: int, arch: str | None):
    return _module(filename, (name_expression,), arch or device_arch(device_id)).get_function(name_expression)


def get_kernel(filename: str, name_expression: str, arch: str | None = None):
    """The `cupy.RawKernel` for `name_expression` (e.g. `"moe_align<16>"`) from `kernels/<filename>`.

    Compiled on first use for the current device (arch: for that NVRTC target instead, one the device runs, e.g.
    the GEMM's `GpuInfo.arch`) and cached (in memory here, on disk by CuPy).
    """
    from ._xp import require_gpu
    cp = require_gpu(f"kernel {name_expression}")
    return _kernel(filename, name_expression, cp.cuda.Device().id, arch)


def launch(kernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, cluster_z: int = 1) -> None:
    """Start `kernel` (from get_kernel) on the current stream with `args` (CuPy arrays, np.uintp null pointers,
    np.int32 / np.int64 / np.float32 scalars). On compute capability 9.0 and later the launch carries the
    programmatic-serialization attribute (cuLaunchKernelEx): the kernel may be scheduled while the previous kernel
    of the stream still runs and waits in pdl::wait() (kernels/pdl.cuh) before touching memory, which saves the
    launch gap between back-to-back kernels. Every kernel of kernels/ calls it. CUPY_MOE_PDL=0: a plain launch.
    cluster_z > 1 (compute capability 9.0 and later, `clusters_available()`): the CTAs that differ only in
    blockIdx.z form one thread-block cluster of cluster_z CTAs (cluster dims 1 x 1 x cluster_z)."""
    from ._xp import cupy as cp
    dev = cp.cuda.Device().id
    launch_ex = _launch_ex(dev)
    if cluster_z > 1 and launch_ex is None:
        raise RuntimeError(f"launch({getattr(kernel, 'name', kernel)}): clusters need compute capability 9.0")
    attrs = []
    if os.environ.get("CUPY_MOE_PDL", "1") != "0":
        attrs.append(_LaunchAttribute(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, value=(1,)))
    if cluster_z > 1:
        attrs.append(_LaunchAttribute(id=_ATTR_CLUSTER_DIMENSION, value=(1, 1, int(cluster_z))))
    if launch_ex is None or not attrs:
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    values = [_c_arg(i, x) for i, x in enumerate(args)]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr_array = (_LaunchAttribute * len(attrs))(*attrs)
    dims = [int(d) for d in (*grid, 1, 1)[:3]] + [int(d) for d in (*block, 1, 1)[:3]]
    config = _LaunchConfig(*dims, int(shared_mem), cp.cuda.get_current_stream().ptr,
                           ctypes.cast(attr_array, ctypes.POINTER(_LaunchAttribute)), len(attrs))
    function = kernel.kernel if hasattr(kernel, "kernel") else kernel  # RawKernel -> cupy.cuda.Function
    status = launch_ex(ctypes.byref(config), ctypes.c_void_p(function.ptr), params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx({getattr(kernel, 'name', kernel)}): CUDA driver error {status}")


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_ATTR_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value {x, y, z}
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def clusters_available() -> bool:
    """Whether launch() can make thread-block clusters on the current device (compute capability 9.0 and later,
    through cuLaunchKernelEx)."""
    from ._xp import cupy as cp
    return _launch_ex(cp.cuda.Device().id) is not None


@functools.lru_cache(maxsize=None)
def _launch_ex(device_id: int):
    """The driver's cuLaunchKernelEx where programmatic dependent launch exists (compute capability >= 9.0), else
    None."""
    from ._xp import cupy as cp
    if int(cp.cuda.Device(device_id).compute_capability) < 90:
        return None
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def _c_arg(i: int, x):
    if hasattr(x, "data") and hasattr(x.data, "ptr"):  # a CuPy array: its device pointer
        return ctypes.c_void_p(x.data.ptr)
    for np_type, c_type in ((np.uintp, ctypes.c_void_p), (np.int32, ctypes.c_int32), (np.int64, ctypes.c_int64),
                            (np.float32, ctypes.c_float)):
        if isinstance(x, np_type):
            return c_type(x.item())
    raise TypeError(f"kernel argument {i}: expected a CuPy array or an np.uintp/int32/int64/float32 scalar, "
                    f"got {type(x).__name__}")


def compile_for_arch(filename: str, name_expressions, arch: str) -> str:
    """Compile `kernels/<filename>` with NVRTC for `arch` (e.g. "sm_80", "sm_90a"); no GPU needed.

    Returns the compiler log including ptxas's per-kernel report (registers, stack frame, spills).
    Raises RuntimeError with the log on a compile error.
    """
    log, lowered, _ = _nvrtc_compile(filename, name_expressions, arch)
    header = "".join(f"// {name} -> {low}\n" for name, low in lowered.items())
    return header + log


def cubin_for_arch(filename: str, name_expressions, arch: str) -> tuple[bytes, dict[str, str], str]:
    """As `compile_for_arch`, but returns (the cubin, {name expression: mangled name}, the compiler log): the
    machine code itself, for disassembly (tools/sass_digest.py)."""
    log, lowered, cubin = _nvrtc_compile(filename, name_expressions, arch, cubin=True)
    return cubin, lowered, log


def _nvrtc_compile(filename, name_expressions, arch, cubin=False):
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
        code = _cubin(prog) if cubin else None
    finally:
        nvrtc.destroyProgram(prog)
    return log, lowered, code


def _cubin(prog) -> bytes:
    # through the library CuPy loaded: cupy's getCUBIN wrapper drops the cubin's last byte (CuPy 13/14)
    maps = Path("/proc/self/maps")
    path = next((line.split()[-1] for line in (maps.read_text().splitlines() if maps.exists() else ())
                 if "libnvrtc.so" in line), None)
    if path is None:
        raise RuntimeError("cubin_for_arch: the NVRTC library CuPy loaded was not found in /proc/self/maps (Linux only)")
    lib = ctypes.CDLL(path)
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)):
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf):
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


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
