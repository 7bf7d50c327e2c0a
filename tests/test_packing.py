"""cupy_moe._packing against the reference's own packing (cupy_moe.reference) and the rules of
docs/gptq_layout.md: pack/unpack along either axis, the GPTQ v1 zero convention both ways, the AWQ nibble order."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_moe import _packing as P
from cupy_moe import reference as R

from gptqmodel_v1 import gptqmodel_v1

BITS = (2, 3, 4, 8)


@st.composite
def values(draw, along_rows=False):
    """(bits, int values [rows, cols] in [0, 2**bits)), the packed axis a whole number of units long."""
    bits = draw(st.sampled_from(BITS))
    per = P.unit(bits)[0]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    units, other = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    shape = (units * per, other) if along_rows else (other, units * per)
    return bits, rng.integers(0, 1 << bits, size=shape)


@pytest.mark.parametrize("bits, unit", [(2, (16, 1)), (3, (32, 3)), (4, (8, 1)), (8, (4, 1))])
def test_unit(bits, unit):
    assert P.unit(bits) == unit


@given(values())
def test_pack_along_last_axis_matches_reference_and_round_trips(case):
    bits, v = case
    packed = P.pack(v, bits)
    assert packed.dtype == np.int32 and packed.shape == (v.shape[0], v.shape[1] * bits // 32)
    np.testing.assert_array_equal(packed, R.pack_cols(v, bits))
    np.testing.assert_array_equal(P.unpack(packed, bits), v)


@given(values(along_rows=True))
def test_pack_along_axis_0_matches_reference_and_round_trips(case):
    bits, v = case
    packed = P.pack(v, bits, axis=0)
    np.testing.assert_array_equal(packed, R.pack_rows(v, bits))
    np.testing.assert_array_equal(P.unpack(packed, bits, axis=0), v)
    np.testing.assert_array_equal(P.unpack(R.pack_rows(v, bits), bits, axis=-2), v)


def test_worked_examples():
    """docs/gptq_layout.md: codes 3, 0, 15, 7, 8, 1, 12, 5 along K pack to 0x5C187F03; zeros 10..15, 1, 2 along N
    pack to 0x21FEDCBA."""
    word = P.pack(np.array([3, 0, 15, 7, 8, 1, 12, 5]).reshape(8, 1), 4, axis=0)
    assert word.view(np.uint32).tolist() == [[0x5C187F03]]
    word = P.pack(np.array([[10, 11, 12, 13, 14, 15, 1, 2]]), 4)
    assert word.view(np.uint32).tolist() == [[0x21FEDCBA]]


@given(values())
def test_v1_real_round_trip_every_zero(case):
    """real -> v1 (GPTQModel's word-level export, a real zero of 0 borrowing) -> real gives the zeros back."""
    bits, real = case
    real[0, 0] = 0  # the value v1 cannot hold in its own field
    v1 = P.real_to_v1(P.pack(real, bits), bits)
    np.testing.assert_array_equal(v1, gptqmodel_v1(real, bits))  # the export, written independently
    np.testing.assert_array_equal(P.unpack(P.v1_to_real(v1, bits), bits), real)


@given(values())
def test_v1_is_real_minus_one_without_borrows(case):
    """Real zeros >= 1 store real - 1 in every field (docs/gptq_layout.md), both directions agree per field."""
    bits, real = case
    real = np.maximum(real, 1)
    v1 = P.real_to_v1(P.pack(real, bits), bits)
    np.testing.assert_array_equal(R.unpack_cols(v1, bits), real - 1)
    np.testing.assert_array_equal(R.unpack_cols(P.v1_to_real(R.pack_cols(real - 1, bits), bits), bits), real)


@pytest.mark.parametrize("bits, word", [(2, 0x55555555), (4, 0x77777777), (8, 0x7F7F7F7F)])
def test_symmetric_v1_words(bits, word):
    """A symmetric v1 file stores 2**(bits-1) - 1 everywhere; v1_to_real turns it into 2**(bits-1)."""
    v1 = np.array([[word]], np.uint32).view(np.int32)
    np.testing.assert_array_equal(P.unpack(P.v1_to_real(v1, bits), bits), 1 << (bits - 1))


def test_v1_3bit_every_value_at_every_position():
    # Every 3-bit value at every stream position, including the straddling fields 10 and 21.
    stored = (np.arange(32)[None, :] + np.arange(8)[:, None]) % 8  # [8, 32]
    got = P.v1_to_real(R.pack_cols(stored, 3), 3)
    np.testing.assert_array_equal(R.unpack_cols(got, 3), (stored + 1) & 7)
    np.testing.assert_array_equal(R.unpack_cols(P.real_to_v1(got, 3), 3), stored)


def test_awq_order_worked_example():
    """Nibble i of an AWQ word holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7: columns 0..7 =
    [10, 11, 12, 13, 14, 15, 1, 2] pack to 0x2FDB1ECA."""
    columns = np.array([[10, 11, 12, 13, 14, 15, 1, 2]])
    word = P.pack(P.awq_interleave(columns), 4)
    assert word.view(np.uint32).tolist() == [[0x2FDB1ECA]]
    np.testing.assert_array_equal(P.awq_deinterleave(P.unpack(word, 4)), columns)


@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_awq_interleave_inverse(rows, words, seed):
    v = np.random.default_rng(seed).integers(0, 16, size=(rows, 8 * words))
    np.testing.assert_array_equal(P.awq_deinterleave(P.awq_interleave(v)), v)
    np.testing.assert_array_equal(P.awq_interleave(P.awq_deinterleave(v)), v)
    nib = P.awq_interleave(v).reshape(rows, words, 8)
    np.testing.assert_array_equal(nib, v.reshape(rows, words, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]])
