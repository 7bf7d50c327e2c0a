"""Where arrays live: NumPy on the host, CuPy on the device, and whether a GPU is usable at all.

`import cupy_moe` must work without CuPy and without a GPU, so nothing here imports CuPy eagerly
in a way that can fail.
"""
from __future__ import annotations

import functools

import numpy

# how to get CuPy (and NVRTC), for every message that says it is missing
INSTALL_HINT = ("from a checkout of cupy_moe: pip install -e \".[cuda12,nvrtc12]\" for a CUDA 12 driver, "
                "\".[cuda13,nvrtc13]\" for CUDA 13")

try:  # CuPy is an optional extra (cuda12 / cuda13).
    import cupy
except ImportError:  # pragma: no cover - exercised on machines without CuPy
    cupy = None


def is_device_array(x) -> bool:
    """True for a CuPy array (device memory)."""
    return cupy is not None and isinstance(x, cupy.ndarray)


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy is installed and at least one CUDA device answers."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no CUDA device, or a broken runtime
        return False


def require_gpu(what: str):
    """Return the cupy module, or raise a RuntimeError that says why `what` cannot run."""
    if cupy is None:
        raise RuntimeError(
            f"{what} needs CuPy: install cupy_moe with its CUDA extra, {INSTALL_HINT}")
    if not gpu_available():
        raise RuntimeError(f"{what} needs a CUDA GPU, and CuPy found none on this machine")
    return cupy


def asnumpy(x):
    """A host copy of `x` (NumPy arrays pass through unchanged)."""
    return cupy.asnumpy(x) if is_device_array(x) else x


def to_device(x, what: str = "copying to the device"):
    """A CuPy copy of host array `x`, made by one host-to-device copy straight from x's pages.

    (cupy.asarray stages through CuPy's pinned-memory pool, which then keeps a pinned copy of the largest
    tensor cached in the process: 1.5x the host memory of a loaded layer.)
    """
    cp = require_gpu(what)
    out = cp.empty(x.shape, x.dtype)
    out.set(numpy.ascontiguousarray(x))
    return out

# activations and outputs of the GEMMs and the layer, on both paths (the kernels' element types)
ACTIVATION_DTYPES = ("float16", "bfloat16")


def check_current_device(name: str, x):
    """ValueError unless CuPy array `x` lives on the current device (NumPy arrays pass)."""
    if is_device_array(x) and x.device.id != cupy.cuda.Device().id:
        raise ValueError(f"{name}: expected an array on the current device {cupy.cuda.Device().id}, got one on "
                         f"device {x.device.id} (make it current with `with cupy.cuda.Device({x.device.id}):`)")


def check_input(name: str, x, dtypes: tuple[str, ...], letters: str, ndim: int | tuple[int, ...] = 2):
    """The public functions' rule for one input array, the same on the NumPy and the CuPy path (so a script
    prototyped on NumPy moves to CuPy unchanged): a NumPy or CuPy array (TypeError otherwise, e.g. for a list),
    of one of `dtypes` (names, TypeError), with `ndim` dimensions (ValueError); a CuPy array on the current device
    (ValueError: a kernel must never be handed another GPU's pointers). Returns x."""
    if not isinstance(x, numpy.ndarray) and not is_device_array(x):
        raise TypeError(f"{name}: expected a NumPy or CuPy array {letters}, got {type(x).__name__}")
    check_current_device(name, x)
    if x.dtype.name not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(dtypes)}, got {x.dtype.name}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        raise ValueError(f"{name}: expected a {' or '.join(map(str, ndims))}-D array {letters}, got shape "
                         f"{tuple(x.shape)}")
    return x
