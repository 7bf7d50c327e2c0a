"""The kernel launcher's argument marshalling (CPU only; the launches themselves are covered by the GPU tests)."""
import ctypes

import numpy as np
import pytest

from cupy_moe import _compile


def test_launch_arguments_keep_their_c_types():
    assert isinstance(_compile._c_arg(0, np.int32(-3)), ctypes.c_int32) and _compile._c_arg(0, np.int32(-3)).value == -3
    assert _compile._c_arg(1, np.int64(2**40)).value == 2**40
    assert _compile._c_arg(2, np.uintp(0)).value is None  # a null pointer
    assert _compile._c_arg(3, np.float32(0.5)).value == 0.5


@pytest.mark.parametrize("value", [5, 0.5, np.int16(1), None])
def test_launch_rejects_untyped_arguments(value):
    with pytest.raises(TypeError, match="kernel argument 4: expected a CuPy array or an np.uintp/int32/int64/float32"):
        _compile._c_arg(4, value)


def test_launch_structures_match_the_driver_layout():
    # CUlaunchAttribute: 4-byte id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: 7 uints, then pointers
    assert ctypes.sizeof(_compile._LaunchAttribute) == 72
    assert _compile._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_compile._LaunchConfig) == 56
    assert (_compile._LaunchConfig.stream.offset, _compile._LaunchConfig.attrs.offset,
            _compile._LaunchConfig.num_attrs.offset) == (32, 40, 48)
