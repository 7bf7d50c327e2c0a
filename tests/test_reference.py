"""cupy_moe.reference: GPTQ packing, (de)quantization, the MoE GEMM, routing and the whole layer.

Shape letters: M tokens, K in-features, N out-features, E experts, A top-k, G group size, P = M*A pairs,
H hidden, I intermediate. Sizes are irregular on purpose (K = 40 with G = 16 leaves a partial last group).
"""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupy_moe import reference as ref
from cupy_moe.weights import StackedGptqWeight

BITS = (2, 3, 4, 8)


def u32(x):
    """int32 word(s) -> Python int(s) of the same 32 bits."""
    return np.asarray(x, np.int32).view(np.uint32).tolist()


def unit(bits):
    """Values per whole number of words: K (qweight) and N (qzeros) must be multiples of this."""
    return 32 if bits == 3 else 32 // bits


def stream_pack(values, bits):
    """The §2 definition written with Python big ints: value i at stream bits [bits*i, bits*i + bits),
    word w = stream bits [32w, 32w + 32). For 2/4/8 bits this is exactly 'least-significant field = lowest k'."""
    stream = 0
    for i, v in enumerate(values):
        stream |= int(v) << (bits * i)
    nwords = len(values) * bits // 32
    return [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(nwords)]


# --------------------------------------------------------------------------- worked examples (docs/gptq_layout.md)
def test_worked_example_4bit_qweight():
    q = np.array([3, 0, 15, 7, 8, 1, 12, 5]).reshape(8, 1)  # [K=8, N=1]
    qweight = ref.pack_rows(q, 4)
    assert qweight.dtype == np.int32 and qweight.shape == (1, 1)
    assert u32(qweight)[0][0] == 0x5C187F03 and int(qweight[0, 0]) == 1545109251
    np.testing.assert_array_equal(ref.unpack_rows(qweight, 4), q)


def test_worked_example_4bit_qzeros():
    z = np.array([[10, 11, 12, 13, 14, 15, 1, 2]])  # [R=1, N=8]
    qzeros = ref.pack_cols(z, 4)
    assert qzeros.shape == (1, 1) and u32(qzeros)[0][0] == 0x21FEDCBA
    np.testing.assert_array_equal(ref.unpack_cols(qzeros, 4), z)


def test_worked_example_8bit_and_2bit():
    q8 = np.array([1, 128, 255, 0]).reshape(4, 1)
    assert u32(ref.pack_rows(q8, 8))[0][0] == 0x00FF8001
    q2 = (np.arange(16) % 4).reshape(16, 1)
    assert u32(ref.pack_rows(q2, 2))[0][0] == 0xE4E4E4E4
    np.testing.assert_array_equal(ref.unpack_rows(ref.pack_rows(q2, 2), 2), q2)


@pytest.mark.parametrize("bits, words", [
    (2, [0x55555555]), (4, [0x77777777]), (8, [0x7F7F7F7F]), (3, [0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D])])
def test_sym_v1_qzeros_constants(bits, words):
    # Symmetric v1 stores zero - 1 = 2**(bits-1) - 1 in every field; the quantizer must write exactly these words.
    n = 32
    z = np.full((3, n), (1 << (bits - 1)) - 1)
    per_row = n * bits // 32
    expected = (words * (per_row // len(words)))
    assert u32(ref.pack_cols(z, bits)) == [expected] * 3
    w = np.random.default_rng(bits).standard_normal((32, n)).astype(np.float16)
    quant = ref.quantize(w, bits=bits, group_size=16, sym=True)
    assert quant.checkpoint_format == "gptq"
    assert u32(quant.qzeros) == [expected] * 2


def test_sym_v2_4bit_constant():
    qzeros = ref.pack_cols(np.full((1, 8), 8), 4)  # real zero 8 stored as is (v2)
    assert u32(qzeros)[0][0] == 0x88888888 and int(qzeros[0, 0]) == -2004318072


@pytest.mark.parametrize("index, words", [(10, [0xC0000000, 0x1, 0x0]), (21, [0x0, 0x80000000, 0x3])])
def test_3bit_values_straddle_words(index, words):
    # Value 10 -> word0 bits 30-31 + word1 bit 0; value 21 -> word1 bit 31 + word2 bits 0-1.
    q = np.zeros((32, 1), np.int64)
    q[index] = 7
    assert [w[0] for w in u32(ref.pack_rows(q, 3))] == words
    np.testing.assert_array_equal(ref.unpack_rows(ref.pack_rows(q, 3), 3), q)


def test_worked_example_end_to_end_dequant():
    # Column n, G=4, K=8, scales [0.5, 0.25], stored v1 zeros [7, 7] (real 8).
    codes = np.array([8, 9, 7, 15, 0, 8, 12, 4])
    qweight = ref.pack_rows(np.repeat(codes[:, None], 8, axis=1), 4)  # [1, N=8]
    scales = np.repeat(np.array([[0.5], [0.25]], np.float16), 8, axis=1)  # [2, 8]
    qzeros = ref.pack_cols(np.full((2, 8), 7), 4)  # [2, 1]
    expected = np.array([0, 0.5, -0.5, 3.5, -2, 0, 1, -1], np.float32)
    for zeros in (qzeros, None):  # stored 7 in v1 == the symmetric default 8
        w = ref.dequantize(qweight, scales, zeros, bits=4, group_size=4)
        assert w.dtype == np.float32 and w.shape == (8, 8)
        np.testing.assert_array_equal(w, np.repeat(expected[:, None], 8, axis=1))
    # The same tensors read as v2 (real zero 7) shift every value up by one scale.
    w2 = ref.dequantize(qweight, scales, qzeros, bits=4, group_size=4, checkpoint_format="gptq_v2")
    np.testing.assert_array_equal(w2[:, 0], expected + np.repeat([0.5, 0.25], 4))


# --------------------------------------------------------------------------- packing properties
@st.composite
def codes(draw, axis):
    bits = draw(st.sampled_from(BITS))
    length = unit(bits) * draw(st.integers(1, 3))
    other = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    shape = (length, other) if axis == 0 else (other, length)
    q = np.random.default_rng(seed).integers(0, 1 << bits, size=shape)
    if draw(st.booleans()):  # the all-ones fields make the int32 words negative: the sign must not leak
        q[...] = (1 << bits) - 1
    return bits, q


@given(codes(axis=0))
def test_pack_rows_matches_bitstream_definition_and_round_trips(case):
    bits, q = case  # q [K, N]
    qweight = ref.pack_rows(q, bits)
    assert qweight.dtype == np.int32 and qweight.shape == (q.shape[0] * bits // 32, q.shape[1])
    per = unit(bits)
    for n in range(q.shape[1]):
        expected = []
        for start in range(0, q.shape[0], per):
            expected += stream_pack(q[start:start + per, n], bits)
        assert u32(qweight[:, n]) == expected
    back = ref.unpack_rows(qweight, bits)
    assert back.dtype == np.int32
    np.testing.assert_array_equal(back, q)


@given(codes(axis=1))
def test_pack_cols_matches_bitstream_definition_and_round_trips(case):
    bits, z = case  # z [R, N]
    qzeros = ref.pack_cols(z, bits)
    assert qzeros.dtype == np.int32 and qzeros.shape == (z.shape[0], z.shape[1] * bits // 32)
    per = unit(bits)
    for r in range(z.shape[0]):
        expected = []
        for start in range(0, z.shape[1], per):
            expected += stream_pack(z[r, start:start + per], bits)
        assert u32(qzeros[r]) == expected
    np.testing.assert_array_equal(ref.unpack_cols(qzeros, bits), z)


@given(st.sampled_from(BITS), st.integers(0, 2**32 - 1))
def test_unpack_rows_of_arbitrary_words_round_trips(bits, seed):
    words_per = 3 if bits == 3 else 1
    qweight = np.random.default_rng(seed).integers(-2**31, 2**31, size=(2 * words_per, 3)).astype(np.int32)
    q = ref.unpack_rows(qweight, bits)
    assert q.min() >= 0 and q.max() < (1 << bits)
    np.testing.assert_array_equal(ref.pack_rows(q, bits), qweight)
    np.testing.assert_array_equal(ref.pack_cols(ref.unpack_cols(qweight.T.copy(), bits), bits), qweight.T)


def test_pack_validation_messages():
    with pytest.raises(ValueError, match=r"bits: expected one of \(2, 3, 4, 8\), got 5"):
        ref.pack_rows(np.zeros((8, 1), np.int64), 5)
    with pytest.raises(ValueError, match=r"q: K \(axis 0\) must be a multiple of 8 .* got shape \(12, 1\)"):
        ref.pack_rows(np.zeros((12, 1), np.int64), 4)
    with pytest.raises(ValueError, match=r"q: expected values in \[0, 15\] for 4 bits, got range \[16, 16\]"):
        ref.pack_rows(np.full((8, 1), 16), 4)
    with pytest.raises(TypeError, match=r"q: expected an integer array, got float32"):
        ref.pack_rows(np.zeros((8, 1), np.float32), 4)
    with pytest.raises(ValueError, match=r"z: N \(axis 1\) must be a multiple of 32"):
        ref.pack_cols(np.zeros((1, 16), np.int64), 3)
    with pytest.raises(TypeError, match=r"qweight: expected int32, got int64"):
        ref.unpack_rows(np.zeros((1, 1), np.int64), 4)
    with pytest.raises(ValueError, match=r"qzeros: axis 1 must be a multiple of 3 words for 3 bits"):
        ref.unpack_cols(np.zeros((1, 2), np.int32), 3)
    with pytest.raises(TypeError, match=r"qweight: expected a NumPy array, got builtins.list"):
        ref.unpack_rows([[1]], 4)


# --------------------------------------------------------------------------- dequantize
def direct_dequant(qweight, scales, zeros_real, g_idx, bits):
    """W[k, n] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]) with scalar loops over the bit formula."""
    k_total, n_total = qweight.shape[0] * 32 // bits, qweight.shape[1]
    w = np.zeros((k_total, n_total))
    per = unit(bits)
    words_per = per * bits // 32
    for n in range(n_total):
        for k in range(k_total):
            block = k // per
            stream = 0
            for j in range(words_per):
                stream |= u32(qweight[block * words_per + j, n]) << (32 * j)
            q = (stream >> (bits * (k % per))) & ((1 << bits) - 1)
            g = g_idx[k]
            w[k, n] = float(scales[g, n]) * (q - zeros_real[g, n])
    return w


def v1_real_zeros(stored, bits):
    """The real zeros of v1 stored fields [R, N] (docs/gptq_layout.md): each packed word read as a number plus one
    in every field, mod 2**32 (a field holding 2**bits - 1 carries into the next), for 2/4/8 bits; 3-bit fields
    one by one, (stored + 1) mod 2**bits."""
    mask = (1 << bits) - 1
    if bits == 3:
        return (stored + 1) & mask
    per = 32 // bits
    words = [int(sum(int(v) << (bits * j) for j, v in enumerate(row[c:c + per]))) for row in stored
             for c in range(0, len(row), per)]
    ones = sum(1 << (bits * j) for j in range(per))
    out = [((w + ones) % 2**32 >> (bits * j)) & mask for w in words for j in range(per)]
    return np.array(out).reshape(stored.shape)


def test_v1_zero_of_zero_borrows_and_decodes_exactly():
    """GPTQModel exports real zeros [9, 5, 0, 7, 3, 12, 4, 11] (word 0xB4C37059) as 0xB4C37059 - 0x11111111 =
    0xA3B25F48: the 0 borrows from the 7. Decoding adds 0x11111111 back, so every column keeps its zero (field by
    field, (stored + 1) & 15, would read column 3's zero as 6)."""
    real = np.array([[9, 5, 0, 7, 3, 12, 4, 11]])
    assert int(ref.pack_cols(real, 4)[0, 0]) % 2**32 == 0xB4C37059
    stored = np.array([[0xA3B25F48 - 2**32]], np.int32)
    np.testing.assert_array_equal(v1_real_zeros(ref.unpack_cols(stored, 4), 4), real)
    q = np.full((8, 8), 5)
    w = ref.dequantize(ref.pack_rows(q, 4), np.ones((1, 8), np.float16), stored, bits=4, group_size=-1)
    np.testing.assert_array_equal(w[0], 5 - real[0])


@given(st.sampled_from(BITS), st.sampled_from(["gptq", "gptq_v2", None]), st.booleans(),
       st.sampled_from([16, 24, -1]), st.integers(0, 2**32 - 1))
def test_dequantize_matches_direct_formula(bits, fmt, act_order, group_size, seed):
    rng = np.random.default_rng(seed)
    k, n = 2 * unit(bits), unit(bits)  # K = 64 for 3 bits, else 2*32/bits; N one packing unit
    glen = k if group_size == -1 else group_size
    groups = -(-k // glen)
    q = rng.integers(0, 1 << bits, size=(k, n))
    stored = rng.integers(0, 1 << bits, size=(groups, n))
    scales = rng.uniform(0.01, 2, size=(groups, n)).astype(np.float16)
    g_idx = ref.act_order_g_idx(k, group_size, rng) if act_order else None
    qzeros = None if fmt is None else ref.pack_cols(stored, bits)
    w = ref.dequantize(ref.pack_rows(q, bits), scales, qzeros, g_idx, bits=bits, group_size=group_size,
                       checkpoint_format=fmt or "gptq")
    real = {None: np.full((groups, n), 1 << (bits - 1)), "gptq": v1_real_zeros(stored, bits), "gptq_v2": stored}[fmt]
    gi = np.arange(k) // glen if g_idx is None else g_idx
    expected = direct_dequant(ref.pack_rows(q, bits), scales, real, gi, bits)
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, expected)  # fp16 scale * small int is exact in float32


def test_dequantize_bf16_scales():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    scales = np.array([[0.3] * 8], ml_dtypes.bfloat16)
    qweight = ref.pack_rows(np.arange(8).reshape(8, 1).repeat(8, 1), 4)
    w = ref.dequantize(qweight, scales, bits=4, group_size=-1)
    np.testing.assert_array_equal(w[:, 0], scales.astype(np.float32)[0, 0] * (np.arange(8) - 8))


def test_dequantize_validation_messages():
    qweight = np.zeros((5, 8), np.int32)  # K = 40, N = 8 at 4 bits
    scales = np.ones((3, 8), np.float16)  # ceil(40/16) = 3 groups
    with pytest.raises(ValueError, match=r"scales: expected shape \(3, 8\) = \[ceil\(K/G\), N\] for K=40, G=16"):
        ref.dequantize(qweight, scales[:2], bits=4, group_size=16)
    with pytest.raises(TypeError, match=r"scales: expected float16, float32 or bfloat16, got int32"):
        ref.dequantize(qweight, scales.astype(np.int32), bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"qzeros: expected shape \(3, 1\) = \[ceil\(K/G\), N\*bits/32\]"):
        ref.dequantize(qweight, scales, np.zeros((3, 2), np.int32), bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"g_idx: expected shape \(40,\) = \[K\], got \(39,\)"):
        ref.dequantize(qweight, scales, g_idx=np.zeros(39, np.int32), bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"g_idx: expected values in \[0, 2\] .* got range \[3, 3\]"):
        ref.dequantize(qweight, scales, g_idx=np.full(40, 3, np.int32), bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"checkpoint_format: expected one of \('gptq', 'gptq_v2'\), got 'awq'"):
        ref.dequantize(qweight, scales, bits=4, group_size=16, checkpoint_format="awq")
    with pytest.raises(ValueError, match=r"group_size: expected -1 or a positive int, got 0"):
        ref.dequantize(qweight, scales, bits=4, group_size=0)


# --------------------------------------------------------------------------- quantize
def exact_scale(w64, groups, num_groups, bits, sym):
    """float64 scale [R, N] of §5 before fp16 rounding, and a mask [R, N] of sym groups whose values are all >= 0."""
    maxq = (1 << bits) - 1
    n = w64.shape[1]
    xmin, xmax = np.zeros((num_groups, n)), np.zeros((num_groups, n))
    for g in range(num_groups):
        rows = w64[groups == g]
        xmin[g], xmax[g] = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
    nonneg = (xmin == 0) & (xmax > 0)
    if sym:
        xmax = np.maximum(-xmin, xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    zero = (xmin == 0) & (xmax == 0)
    xmin, xmax = np.where(zero, -1, xmin), np.where(zero, 1, xmax)
    return (xmax - xmin) / maxq, nonneg & sym


@st.composite
def weight_cases(draw):
    bits = draw(st.sampled_from(BITS))
    k = unit(bits) * draw(st.integers(1, 3 if bits == 3 else 6))
    n = unit(bits) * draw(st.integers(1, 2 if bits == 3 else 3))
    group_size = draw(st.sampled_from([-1, 8, 16, 24]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    magnitude = draw(st.sampled_from([1e-6, 1e-3, 1.0, 300.0]))
    w = rng.standard_normal((k, n)) * magnitude
    if draw(st.booleans()):
        w += magnitude * draw(st.floats(-3, 3))  # groups of one sign
    if draw(st.booleans()):
        w[:, 0] = 0  # an all-zero column: xmin = xmax = 0 -> (-1, 1)
    dtype = draw(st.sampled_from([np.float16, np.float32]))
    act_order = draw(st.booleans())
    g_idx = ref.act_order_g_idx(k, group_size, rng) if act_order else None
    return bits, group_size, w.astype(dtype), draw(st.booleans()), g_idx


@given(weight_cases())
def test_quantize_dequantize_error_at_most_half_a_step(case):
    """Bound, with s the exact float64 scale and s16 the stored fp16 scale (both [R, N]):
    an element whose code is not clamped is off by at most s16/2 (codes divide by s16). A clamped element lies
    beyond the end of the code range; with zero = round(-xmin/s) (asym) or 2**(bits-1) (sym) that end is within
    s/2 of xmin/xmax at scale s, and moving to s16 moves it by at most maxq*|s - s16|. So
        |dequant - w| <= s16/2 + maxq*|s - s16|      (|s - s16| <= 2**-11 s for normal fp16)
    except for the AutoGPTQ sym quirk (groups with no negative value keep xmin = 0), tested separately.
    A tiny float64 slack covers the division and subtraction roundings."""
    bits, group_size, w, sym, g_idx = case
    k, n = w.shape
    quant = ref.quantize(w, bits=bits, group_size=group_size, sym=sym, g_idx=g_idx)
    glen = k if group_size == -1 else group_size
    groups = np.arange(k) // glen if g_idx is None else g_idx
    num_groups = -(-k // glen)
    assert quant.qweight.shape == (k * bits // 32, n) and quant.qweight.dtype == np.int32
    assert quant.qzeros.shape == (num_groups, n * bits // 32) and quant.qzeros.dtype == np.int32
    assert quant.scales.shape == (num_groups, n) and quant.scales.dtype == np.float16
    assert quant.g_idx.dtype == np.int32
    np.testing.assert_array_equal(quant.g_idx, groups)
    assert quant.checkpoint_format == ("gptq" if sym else "gptq_v2")

    w64 = w.astype(np.float64)
    s, quirk = exact_scale(w64, groups, num_groups, bits, sym)
    np.testing.assert_array_equal(quant.scales, s.astype(np.float16))
    s16 = quant.scales.astype(np.float64)
    maxq = (1 << bits) - 1
    bound = (s16 / 2 + maxq * np.abs(s - s16)) * (1 + 1e-12) + 1e-300
    deq = ref.dequantize(quant.qweight, quant.scales, quant.qzeros, quant.g_idx, bits=bits,
                         group_size=group_size, checkpoint_format=quant.checkpoint_format)
    err = np.abs(deq.astype(np.float64) - w64)
    checked = ~quirk[groups]  # [K, N]
    assert np.all(err[checked] <= bound[groups][checked]), float(np.max((err - bound[groups])[checked]))
    # Codes strictly inside (0, maxq) were not clamped: there the bound is exactly half a stored step
    # (unless the scale underflowed fp16 to 0, where codes fall back to the exact scale and read back as 0).
    codes = ref.unpack_rows(quant.qweight, bits)
    inside = (codes > 0) & (codes < maxq) & (s16[groups] > 0)
    half = s16[groups] / 2 * (1 + 1e-9)
    assert np.all(err[inside] <= half[inside]), float(np.max((err - half)[inside]))


def test_quantize_sym_nonnegative_group_quirk():
    # AutoGPTQ keeps xmin = 0 for a sym group without negative values: scale = xmax/maxq, zero = 8, so
    # codes clamp at 15 and the group's top values come back as 7 * scale. Kept on purpose (genuine tensors).
    w = np.tile(np.linspace(0, 1.5, 8)[:, None], (1, 8)).astype(np.float16)  # [K=8, N=8], each column 0..1.5
    quant = ref.quantize(w, bits=4, group_size=-1, sym=True)
    deq = ref.dequantize(quant.qweight, quant.scales, quant.qzeros, bits=4, group_size=-1)
    np.testing.assert_array_equal(quant.scales, np.full((1, 8), np.float16(1.5 / 15)))
    assert deq.max() == np.float32(quant.scales[0, 0]) * 7


@given(st.sampled_from(BITS), st.booleans(), st.integers(0, 2**32 - 1))
def test_quantize_v1_and_v2_describe_the_same_weights(bits, sym, seed):
    # Re-express the zeros in the other convention (v1: GPTQModel's export, word by word) and dequantize again.
    rng = np.random.default_rng(seed)
    k, n = 2 * unit(bits), unit(bits)
    w = rng.standard_normal((k, n)).astype(np.float16)
    g_idx = ref.act_order_g_idx(k, 16, rng)
    quant = ref.quantize(w, bits=bits, group_size=16, sym=sym, g_idx=g_idx)
    stored = ref.unpack_cols(quant.qzeros, bits)
    mask = (1 << bits) - 1
    if quant.checkpoint_format == "gptq":
        other, fmt = ref.pack_cols(v1_real_zeros(stored, bits), bits), "gptq_v2"
    elif bits == 3:
        other, fmt = ref.pack_cols((stored - 1) & mask, bits), "gptq"
    else:  # one subtraction per word of the constant with 1 in every field
        ones = sum(1 << j for j in range(0, 32, bits))
        words = (quant.qzeros.astype(np.int64) % 2**32 - ones) % 2**32
        other, fmt = words.astype(np.uint32).view(np.int32), "gptq"
    kwargs = dict(bits=bits, group_size=16)
    a = ref.dequantize(quant.qweight, quant.scales, quant.qzeros, g_idx, checkpoint_format=quant.checkpoint_format,
                       **kwargs)
    b = ref.dequantize(quant.qweight, quant.scales, other, g_idx, checkpoint_format=fmt, **kwargs)
    np.testing.assert_array_equal(a, b)
    if sym:  # symmetric v1 zeros are the default zero: qzeros may be dropped
        np.testing.assert_array_equal(a, ref.dequantize(quant.qweight, quant.scales, None, g_idx, **kwargs))


@given(st.integers(0, 300), st.sampled_from([1, 7, 32, 128, -1]), st.integers(0, 2**32 - 1))
def test_act_order_g_idx_groups(k, group_size, seed):
    g_idx = ref.act_order_g_idx(k, group_size, seed)
    glen = max(k, 1) if group_size == -1 else group_size
    assert g_idx.dtype == np.int32 and g_idx.shape == (k,)
    counts = np.bincount(g_idx, minlength=-(-k // glen))
    expected = [glen] * (k // glen) + ([k % glen] if k % glen else [])
    assert counts.tolist() == expected
    np.testing.assert_array_equal(g_idx, ref.act_order_g_idx(k, group_size, seed))  # seeded: reproducible


def test_act_order_g_idx_is_not_monotone():
    g_idx = ref.act_order_g_idx(256, 32, np.random.default_rng(3))
    assert np.any(np.diff(g_idx) < 0)


def test_quantize_validation_messages():
    with pytest.raises(ValueError, match=r"w: K and N must be multiples of 32 for 3 bits, got shape \(32, 16\)"):
        ref.quantize(np.zeros((32, 16), np.float32), bits=3, group_size=8)
    with pytest.raises(TypeError, match=r"w: expected float16, float32 or bfloat16, got int64"):
        ref.quantize(np.zeros((8, 8), np.int64), bits=4, group_size=8)
    with pytest.raises(ValueError, match=r"w: expected finite values"):
        ref.quantize(np.full((8, 8), np.inf, np.float32), bits=4, group_size=8)
    with pytest.raises(ValueError, match=r"w: values too large for float16 scales"):
        ref.quantize(np.full((8, 8), 1e9, np.float32), bits=4, group_size=8)
    with pytest.raises(ValueError, match=r"w: expected 2-D \[K, N\], got shape \(8,\)"):
        ref.quantize(np.zeros(8, np.float32), bits=4, group_size=8)


# --------------------------------------------------------------------------- the MoE GEMM
def ulp(x, dtype):
    """Spacing of `dtype` at |x| (float64 array)."""
    x = np.abs(np.asarray(x, np.float64))
    if np.dtype(dtype).name == "bfloat16":  # 8 significant bits: 2**16 float32 ulps (normal range)
        return np.spacing(x.astype(np.float32)).astype(np.float64) * 2.0**16
    return np.spacing(x.astype(dtype)).astype(np.float64)


def assert_rounded_once(got, exact, dtype):
    """got (dtype) is exact (float64) rounded to nearest, up to float64 summation-order noise."""
    assert got.dtype == np.dtype(dtype)
    got64 = got.astype(np.float64)
    tol = 0.5 * ulp(got64, dtype) + 1e-12 * np.abs(exact) + 1e-300
    assert np.all(np.abs(got64 - exact) <= tol), float(np.max(np.abs(got64 - exact) - tol))


def dtypes():
    out = [np.float16, np.float32]
    try:
        import ml_dtypes
        out.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    return out


def make_stacked(rng, k, n, e, bits, group_size=16, sym=True, act_order=False, keep_sym_zeros=True):
    """A StackedGptqWeight built through quantize + from_experts, and its dequantized float64 [E, K, N]."""
    g_idx = ref.act_order_g_idx(k, group_size, rng) if act_order else None
    quants = [ref.quantize((rng.standard_normal((k, n)) * 0.5).astype(np.float16), bits=bits,
                           group_size=group_size, sym=sym, g_idx=g_idx) for _ in range(e)]
    weight = StackedGptqWeight.from_experts(
        [q.qweight for q in quants], [q.scales for q in quants],
        [q.qzeros for q in quants] if keep_sym_zeros or not sym else None,
        None if g_idx is None else [q.g_idx for q in quants],
        bits=bits, group_size=group_size, checkpoint_format=quants[0].checkpoint_format)
    dense = np.stack([ref.dequantize(q.qweight, q.scales, q.qzeros, q.g_idx, bits=bits, group_size=group_size,
                                     checkpoint_format=q.checkpoint_format) for q in quants]).astype(np.float64)
    return weight, dense


@st.composite
def stacked_cases(draw, k=None, n=None, e=None, bits=None):
    bits = bits or draw(st.sampled_from(BITS))
    u = unit(bits)
    k = k or u * draw(st.integers(1, 2 if bits == 3 else 5))
    n = n or u * draw(st.integers(1, 1 if bits == 3 else 3))
    e = e or draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return make_stacked(rng, k, n, e, bits, group_size=draw(st.sampled_from([-1, 16, 24])),
                        sym=draw(st.booleans()), act_order=draw(st.booleans()), keep_sym_zeros=draw(st.booleans()))


def routing(rng, m, a_k, e):
    """topk_ids int32 [M, A]: A distinct experts per token."""
    return np.array([rng.permutation(e)[:a_k] for _ in range(m)], np.int32).reshape(m, a_k)


@given(stacked_cases(), st.integers(0, 9), st.sampled_from([1, 4, 16]), st.sampled_from(dtypes()),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_fused_moe_gemm_matches_dense_einsum(case, m, block, dtype, weighted, seed):
    weight, dense = case  # dense [E, K, N] float64
    e, k, n = dense.shape
    rng = np.random.default_rng(seed)
    a_k = int(rng.integers(1, e + 1))
    ids = routing(rng, m, a_k, e)  # [M, A]
    a = rng.standard_normal((m, k)).astype(dtype)
    topk_weights = rng.uniform(0.1, 1, size=(m, a_k)).astype(np.float32) if weighted else None
    sorted_ids, expert_ids, total = ref.moe_align_block_size(ids, block, e)
    y = ref.fused_moe_gemm(a, weight, sorted_ids, expert_ids, total, a_k, topk_weights)
    exact = np.einsum("mk,makn->man", a.astype(np.float64), dense[ids])  # [M, A, N]
    if weighted:
        exact = exact * topk_weights.astype(np.float64)[..., None]
    assert y.shape == (m * a_k, n)
    assert_rounded_once(y, exact.reshape(m * a_k, n), dtype)


def test_fused_moe_gemm_out_rows_never_produced_stay_untouched():
    rng = np.random.default_rng(7)
    e, k, n, m, a_k, block = 3, 40, 24, 11, 2, 4
    weight, dense = make_stacked(rng, k, n, e, 4, group_size=16, sym=False, act_order=True)
    ids = routing(rng, m, a_k, e)
    a = rng.standard_normal((m, k)).astype(np.float16)
    topk_weights = rng.uniform(size=(m, a_k)).astype(np.float32)
    sorted_ids, expert_ids, total = ref.moe_align_block_size(ids, block, e)
    expert_ids = expert_ids.copy()
    expert_ids[expert_ids == 1] = -1  # another rank owns expert 1 (expert parallel): its blocks are skipped
    marker = np.float16(-1234)
    out = np.full((m * a_k, n), marker, np.float16)
    y = ref.fused_moe_gemm(a, weight, sorted_ids, expert_ids, total, a_k, topk_weights, out=out)
    assert y is out
    flat = ids.reshape(-1)
    exact = np.einsum("pk,pkn->pn", a.astype(np.float64)[np.arange(m * a_k) // a_k], dense[flat])
    exact *= topk_weights.reshape(-1, 1)
    skipped = flat == 1
    assert skipped.any() and (~skipped).any()
    assert np.all(out[skipped] == marker)
    assert_rounded_once(out[~skipped], exact[~skipped], np.float16)
    # A new output starts from zeros; blocks at or past num_tokens_post_padded are not computed either.
    fresh = ref.fused_moe_gemm(a, weight, sorted_ids, expert_ids, np.array([0], np.int32), a_k, topk_weights)
    assert np.all(fresh == 0)


def test_fused_moe_gemm_one_pair_per_block_is_the_aligned_result():
    rng = np.random.default_rng(8)
    e, k, n, m, a_k = 4, 48, 16, 3, 2
    weight, _ = make_stacked(rng, k, n, e, 4, group_size=16, sym=False, act_order=False)
    ids = np.array([[2, 0], [2, 2], [3, 1]], np.int32)  # a repeated expert, and a repeated id in one token
    a = rng.standard_normal((m, k)).astype(np.float16)
    topk_weights = rng.uniform(size=(m, a_k)).astype(np.float32)
    want = ref.fused_moe_gemm(a, weight, *ref.moe_align_block_size(ids, 4, e), a_k, topk_weights)
    for layout in (ids, ids.reshape(-1)):
        np.testing.assert_array_equal(ref.fused_moe_gemm(a, weight, None, layout, None, a_k, topk_weights), want)
    with pytest.raises(ValueError, match=r"expert_ids: expected M\*A = 6 expert ids \(one pair per block\), got "
                                         r"shape \(5,\)"):
        ref.fused_moe_gemm(a, weight, None, ids.reshape(-1)[:5], None, a_k)


def test_fused_moe_gemm_refuses_a_pair_after_padding_in_a_block():
    """The kernels take a block's first padding slot for its end, so the definition refuses a list that puts a pair
    after padding (moe_align_block_size never does)."""
    rng = np.random.default_rng(5)
    e, k, n, m, a_k = 2, 32, 16, 3, 1
    weight, _ = make_stacked(rng, k, n, e, 4, group_size=16, sym=True, act_order=False)
    a = rng.standard_normal((m, k)).astype(np.float16)
    sentinel = m * a_k
    ok = np.array([0, 1, sentinel, sentinel, 2, sentinel, sentinel, sentinel], np.int32)
    ref.fused_moe_gemm(a, weight, ok, np.array([0, 1], np.int32), np.array([8], np.int32), a_k)
    bad = np.array([0, sentinel, 1, sentinel, 2, sentinel, sentinel, sentinel], np.int32)
    with pytest.raises(ValueError, match=r"sorted_token_ids: expected each block's pairs before its padding \(as "
                                         r"moe_align_block_size writes them\), got block 0: \[0, 3, 1, 3\]"):
        ref.fused_moe_gemm(a, weight, bad, np.array([0, 1], np.int32), np.array([8], np.int32), a_k)


def test_pair_order_round_trip_and_gemm():
    x = np.arange(2 * 24).reshape(2, 24)
    np.testing.assert_array_equal(ref.to_pair_order(x)[0, :8], [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(ref.from_pair_order(ref.to_pair_order(x)), x)
    with pytest.raises(ValueError, match=r"x: expected a last dimension that is a multiple of 8, got shape \(2, 12\)"):
        ref.to_pair_order(x[:, :12])
    rng = np.random.default_rng(9)
    weight, _ = make_stacked(rng, 48, 16, 3, 4, group_size=16, sym=False, act_order=True)
    a = rng.standard_normal((5, 48)).astype(np.float16)
    ids = routing(rng, 5, 2, 3)
    aligned = ref.moe_align_block_size(ids, 4, 3)
    np.testing.assert_array_equal(ref.fused_moe_gemm(ref.to_pair_order(a), weight, *aligned, 2, a_pair_order=True),
                                  ref.fused_moe_gemm(a, weight, *aligned, 2))


def test_fused_moe_gemm_takes_any_weight_like_object_and_empty_input():
    weight, dense = make_stacked(np.random.default_rng(5), 32, 32, 2, 3, group_size=-1, sym=False)
    duck = SimpleNamespace(qweight=weight.qweight, scales=weight.scales, qzeros=weight.qzeros,
                           g_idx=weight.g_idx, bits=weight.bits, group_size=weight.group_size)
    a = np.ones((1, 32), np.float32)
    s, e, t = ref.moe_align_block_size(np.array([[1]]), 8, 2)
    y = ref.fused_moe_gemm(a, duck, s, e, t, 1)
    assert_rounded_once(y, a.astype(np.float64) @ dense[1], np.float32)
    s, e, t = ref.moe_align_block_size(np.zeros((0, 2), np.int32), 8, 2)
    assert ref.fused_moe_gemm(np.zeros((0, 32), np.float16), weight, s, e, t, 2).shape == (0, 32)


def test_fused_moe_gemm_validation_messages():
    weight, _ = make_stacked(np.random.default_rng(6), 16, 8, 2, 4)
    a = np.zeros((3, 16), np.float16)
    s, e, t = ref.moe_align_block_size(np.zeros((3, 1), np.int32), 4, 2)
    with pytest.raises(ValueError, match=r"a: expected K = 16 columns to match weight, got shape \(3, 8\)"):
        ref.fused_moe_gemm(a[:, :8], weight, s, e, t, 1)
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 8\) = \[M\*top_k, N\] and dtype float16"):
        ref.fused_moe_gemm(a, weight, s, e, t, 1, out=np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"topk_weights: expected M\*top_k = 3 elements, got shape \(2,\)"):
        ref.fused_moe_gemm(a, weight, s, e, t, 1, topk_weights=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"expert_ids: expected values in \[-1, 1\], got range \[5, 5\]"):
        ref.fused_moe_gemm(a, weight, s, np.full_like(e, 5), t, 1)
    with pytest.raises(ValueError, match=r"sorted_token_ids: expected a size that is a multiple of expert_ids"):
        ref.fused_moe_gemm(a, weight, s[:-1], e, t, 1)
    with pytest.raises(TypeError, match=r"weight: expected a StackedGptqWeight-like object with .qweight"):
        ref.fused_moe_gemm(a, object(), s, e, t, 1)
    with pytest.raises(TypeError, match=r"weight.scales: expected a NumPy \(host\) array, got builtins.list"):
        ref.fused_moe_gemm(a, SimpleNamespace(**{**weight.__dict__, "scales": [1]}), s, e, t, 1)
    with pytest.raises(ValueError, match=r"top_k: expected a positive int, got 0"):
        ref.fused_moe_gemm(a, weight, s, e, t, 0)


# --------------------------------------------------------------------------- routing
@given(st.integers(0, 12), st.integers(1, 9), st.data())
def test_select_experts_matches_direct_computation(m, e, data):
    a_k = data.draw(st.integers(1, e))
    renormalize = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if data.draw(st.booleans()):  # integer logits: many exact ties, which must go to the lower expert
        logits = rng.integers(-2, 3, size=(m, e)).astype(np.float16)
    else:
        logits = (rng.standard_normal((m, e)) * 4).astype(np.float32)
    weights, ids = ref.select_experts(logits, a_k, renormalize)
    assert weights.dtype == np.float32 and ids.dtype == np.int32
    assert weights.shape == ids.shape == (m, a_k)
    for row in range(m):
        x = logits[row].astype(np.float32)
        p32 = np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # float32 softmax, the order is defined on it
        expected = sorted(range(e), key=lambda j: (-p32[j], j))[:a_k]
        assert ids[row].tolist() == expected
        x64 = logits[row].astype(np.float64)
        p64 = np.exp(x64 - x64.max()) / np.exp(x64 - x64.max()).sum()
        want = p64[expected] / (p64[expected].sum() if renormalize else 1.0)
        np.testing.assert_allclose(weights[row], want, rtol=1e-5, atol=1e-7)


def test_select_experts_ties_and_validation():
    weights, ids = ref.select_experts(np.array([[0, 1, 1, 0]], np.float32), 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 0]]
    np.testing.assert_allclose(weights.sum(), 1, rtol=1e-6)
    with pytest.raises(ValueError, match=r"top_k: expected at most E = 4, got 5"):
        ref.select_experts(np.zeros((1, 4), np.float32), 5, False)
    with pytest.raises(TypeError, match=r"router_logits: expected float16, float32 or bfloat16, got int64"):
        ref.select_experts(np.zeros((1, 4), np.int64), 1, False)


# --------------------------------------------------------------------------- the whole layer
def dense_layer(hidden, dense13, dense2, topk_weights, ids, dtype):
    """The layer with the contract's roundings, written as einsums over gathered experts."""
    m, a_k = ids.shape
    inter = dense13.shape[2] // 2
    x1 = np.einsum("mh,mahn->man", hidden.astype(np.float64), dense13[ids]).astype(dtype)  # [M, A, 2I]
    gate, up = x1[..., :inter].astype(np.float32), x1[..., inter:].astype(np.float32)
    with np.errstate(over="ignore"):
        act = (gate / (np.float32(1) + np.exp(-gate)) * up).astype(dtype)  # silu(gate) * up, [M, A, I]
    x2 = np.einsum("mai,maih->mah", act.astype(np.float64), dense2[ids])
    x2 = (x2 * topk_weights.astype(np.float64)[..., None]).astype(dtype)  # [M, A, H]
    acc = np.zeros((m, dense2.shape[2]), np.float32)
    for slot in range(a_k):
        acc += x2[:, slot].astype(np.float32)
    return acc.astype(dtype), x2


@given(st.sampled_from(BITS), st.integers(0, 9), st.integers(1, 5), st.sampled_from([1, 8, 16]),
       st.sampled_from(dtypes()), st.data())
def test_fused_moe_matches_dense_layer(bits, m, e, block, dtype, data):
    u = unit(bits)
    h = u * data.draw(st.integers(1, 2 if bits == 3 else 5))
    inter = u * data.draw(st.integers(1, 1 if bits == 3 else 3))
    w13, d13 = data.draw(stacked_cases(k=h, n=2 * inter, e=e, bits=bits))
    w2, d2 = data.draw(stacked_cases(k=inter, n=h, e=e, bits=bits))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hidden = rng.standard_normal((m, h)).astype(dtype)
    a_k = int(rng.integers(1, e + 1))
    logits = rng.standard_normal((m, e)).astype(np.float32)
    topk_weights, ids = ref.select_experts(logits, a_k, renormalize=bool(rng.integers(2)))
    got = ref.fused_moe(hidden, w13, w2, topk_weights, ids, block_size=block)
    want, x2 = dense_layer(hidden, d13, d2, topk_weights, ids, dtype)
    assert got.shape == (m, h) and got.dtype == np.dtype(dtype)
    # Both sides round at the same points; float64 sums in a different order may flip a rounding of x1 or x2
    # by one ulp, which moves the output by at most ~A ulps of the largest term, plus its own rounding.
    tol = (a_k + 1) * ulp(np.abs(x2.astype(np.float64)).max(axis=1, initial=0), dtype)[:, None] \
        + ulp(want.astype(np.float64), dtype)
    assert np.all(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tol)


def test_fused_moe_all_tokens_on_one_expert_and_validation():
    rng = np.random.default_rng(11)
    h, inter, e, m = 24, 16, 4, 9
    w13, d13 = make_stacked(rng, h, 2 * inter, e, 8, group_size=16, act_order=True)
    w2, d2 = make_stacked(rng, inter, h, e, 8, group_size=-1, sym=False)
    hidden = rng.standard_normal((m, h)).astype(np.float16)
    ids = np.full((m, 1), 2, np.int32)
    topk_weights = np.ones((m, 1), np.float32)
    got = ref.fused_moe(hidden, w13, w2, topk_weights, ids, block_size=4)
    want, _ = dense_layer(hidden, d13, d2, topk_weights, ids, np.float16)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2**-9, atol=2**-14)
    with pytest.raises(ValueError, match=r"w2: expected K = I = 16 and N = H = 24, got K = 24, N = 32"):
        ref.fused_moe(hidden, w13, w13, topk_weights, ids)
    with pytest.raises(ValueError, match=r"topk_weights, topk_ids: expected equal shapes"):
        ref.fused_moe(hidden, w13, w2, np.ones((m, 2), np.float32), ids)
    with pytest.raises(ValueError, match=r"w13: expected K = H = 16, got K = 24"):
        ref.fused_moe(hidden[:, :16], w13, w2, topk_weights, ids)
