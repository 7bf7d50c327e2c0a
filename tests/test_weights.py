"""cupy_moe.weights.StackedGptqWeight: validation, from_experts (v1 -> real zeros), concat_n, host/device.

Shape letters: E experts, K in-features, N out-features, G group size, R = ceil(K/G).
"""
import dataclasses
import sys
import types

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupy_moe import _xp, reference as ref
from cupy_moe.weights import StackedGptqWeight, concat_n, stacked_shapes

from gptqmodel_v1 import gptqmodel_v1

BITS = (2, 3, 4, 8)


def unit(bits):
    return 32 if bits == 3 else 32 // bits


def expert_tensors(rng, e, k, n, bits, group_size, sym=False, act_order=False):
    """Per-expert checkpoint tensors from the reference quantizer (sym -> v1, asym -> v2)."""
    g_idx = ref.act_order_g_idx(k, group_size, rng) if act_order else None
    quants = [ref.quantize(rng.standard_normal((k, n)).astype(np.float16), bits=bits, group_size=group_size,
                           sym=sym, g_idx=g_idx) for _ in range(e)]
    return quants


def stacked(e=3, k=40, n=24, bits=4, group_size=16, *, zeros=True, g_idx=True):
    """A valid host weight: E=3, K=40 (3 groups of 16, last partial), N=24 at 4 bits."""
    rng = np.random.default_rng(0)
    r = -(-k // (k if group_size == -1 else group_size))
    return StackedGptqWeight(
        rng.integers(-2**31, 2**31, size=(e, k * bits // 32, n)).astype(np.int32),
        rng.uniform(0.1, 1, size=(e, r, n)).astype(np.float16),
        rng.integers(-2**31, 2**31, size=(e, r, n * bits // 32)).astype(np.int32) if zeros else None,
        np.tile(np.arange(k, dtype=np.int32) // (k if group_size == -1 else group_size), (e, 1)) if g_idx else None,
        bits, group_size)


def fields(w):
    return dict(qweight=w.qweight, scales=w.scales, qzeros=w.qzeros, g_idx=w.g_idx, bits=w.bits,
                group_size=w.group_size)


def build(**changes):
    return StackedGptqWeight(**{**fields(stacked()), **changes})


# --------------------------------------------------------------------------- properties
def test_properties_and_repr():
    w = stacked()
    assert (w.num_experts, w.k, w.n, w.num_groups, w.group_len) == (3, 40, 24, 3, 16)
    assert w.nbytes == w.qweight.nbytes + w.scales.nbytes + w.qzeros.nbytes + w.g_idx.nbytes
    assert w.is_device is False
    assert w.to_host() is w
    assert "E=3, K=40, N=24, bits=4, group_size=16" in repr(w) and "host" in repr(w)
    one = stacked(k=64, n=32, bits=3, group_size=-1, zeros=False, g_idx=False)
    assert (one.k, one.n, one.num_groups, one.group_len) == (64, 32, 1, 64)
    assert one.nbytes == one.qweight.nbytes + one.scales.nbytes


# --------------------------------------------------------------------------- one pytest.raises per message
class FakeDevice(np.ndarray):
    """A NumPy array that the monkeypatched _xp.is_device_array reports as a CuPy array."""


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(_xp, "is_device_array", lambda x: isinstance(x, FakeDevice))


@pytest.mark.parametrize("changes, error, message", [
    (dict(bits="4"), TypeError, r"bits: expected an int, got str"),
    (dict(bits=5), ValueError, r"bits: expected one of \(2, 3, 4, 8\), got 5"),
    (dict(group_size=16.0), TypeError, r"group_size: expected an int, got float"),
    (dict(group_size=0), ValueError, r"group_size: expected -1 or a positive int, got 0"),
    (dict(qweight=[[[1]]]), TypeError, r"qweight: expected a NumPy or CuPy array, got list"),
    (dict(scales=None), TypeError, r"scales: expected a NumPy or CuPy array, got NoneType"),
    (dict(qweight=np.zeros((3, 5, 24), np.float32)), TypeError, r"qweight: expected int32, got float32"),
    (dict(scales=np.zeros((3, 3, 24), np.float32)), TypeError, r"scales: expected float16, got float32"),
    (dict(qzeros=np.zeros((3, 3, 3), np.uint32)), TypeError, r"qzeros: expected int32, got uint32"),
    (dict(g_idx=np.zeros((3, 40), np.int64)), TypeError, r"g_idx: expected int32, got int64"),
    (dict(qweight=np.zeros((5, 24), np.int32)), ValueError, r"qweight: expected 3-D \[E, K\*bits/32, N\], "
                                                           r"got shape \(5, 24\)"),
    (dict(scales=np.zeros((3, 24), np.float16)), ValueError, r"scales: expected 3-D \[E, ceil\(K/G\), N\]"),
    (dict(qzeros=np.zeros((3, 9), np.int32)), ValueError, r"qzeros: expected 3-D \[E, ceil\(K/G\), N\*bits/32\]"),
    (dict(g_idx=np.zeros(40, np.int32)), ValueError, r"g_idx: expected 2-D \[E, K\], got shape \(40,\)"),
    (dict(qweight=np.zeros((3, 24, 5), np.int32).transpose(0, 2, 1)), ValueError,
     r"qweight: expected a C-contiguous array, got strides"),
    (dict(qweight=np.zeros((0, 5, 24), np.int32), scales=np.zeros((0, 3, 24), np.float16)), ValueError,
     r"qweight: expected E, K\*bits/32 and N all >= 1, got shape \(0, 5, 24\)"),
    (dict(bits=3, qzeros=None), ValueError,
     r"qweight: expected K\*bits/32 \(axis 1\) a multiple of 3 for 3-bit \(K a multiple of 32\), "
     r"got shape \(3, 5, 24\)"),
    (dict(scales=np.zeros((3, 2, 24), np.float16)), ValueError,
     r"scales: expected shape \(3, 3, 24\) = \[E, ceil\(K/G\), N\] for K=40, group_size=16, got \(3, 2, 24\)"),
    (dict(qweight=np.zeros((3, 5, 20), np.int32), scales=np.zeros((3, 3, 20), np.float16),
          qzeros=np.zeros((3, 3, 2), np.int32)), ValueError,
     r"qzeros: N = 20 must be a multiple of 8 to pack 4-bit zeros, got N = 20"),
    (dict(qzeros=np.zeros((3, 3, 4), np.int32)), ValueError,
     r"qzeros: expected shape \(3, 3, 3\) = \[E, ceil\(K/G\), N\*bits/32\], got \(3, 3, 4\)"),
    (dict(g_idx=np.zeros((2, 40), np.int32)), ValueError, r"g_idx: expected shape \(3, 40\) = \[E, K\], "
                                                          r"got \(2, 40\)"),
    (dict(g_idx=np.full((3, 40), 3, np.int32)), ValueError,
     r"g_idx: expected values in \[0, 2\] \(ceil\(K/G\) = 3 groups\), got range \[3, 3\]"),
])
def test_validation_messages(changes, error, message):
    with pytest.raises(error, match=message):
        build(**changes)


def test_validation_all_host_or_all_device(fake_device):
    w = stacked()
    with pytest.raises(TypeError, match=r"scales: expected a host array like qweight \(all NumPy or all CuPy\), "
                                        r"got a device array"):
        build(scales=w.scales.view(FakeDevice))
    with pytest.raises(TypeError, match=r"g_idx: expected a host array like qweight"):
        build(g_idx=w.g_idx.view(FakeDevice))


def test_to_device_without_gpu_names_the_caller():
    if _xp.gpu_available():
        pytest.skip("a GPU is present: covered by test_device_round_trip")
    with pytest.raises(RuntimeError, match=r"StackedGptqWeight.to_device needs"):
        stacked().to_device()
    quants = expert_tensors(np.random.default_rng(0), 2, 16, 8, 4, 8)
    with pytest.raises(RuntimeError, match=r"StackedGptqWeight.to_device needs"):
        StackedGptqWeight.from_experts([q.qweight for q in quants], [q.scales for q in quants], None,
                                       bits=4, group_size=8, device=True)


@pytest.mark.gpu
def test_device_round_trip():
    import cupy
    quants = expert_tensors(np.random.default_rng(1), 3, 40, 24, 4, 16, act_order=True)
    args = ([q.qweight for q in quants], [q.scales for q in quants], [q.qzeros for q in quants],
            [q.g_idx for q in quants])
    host = StackedGptqWeight.from_experts(*args, bits=4, group_size=16, checkpoint_format="gptq_v2")
    dev = StackedGptqWeight.from_experts(*args, bits=4, group_size=16, checkpoint_format="gptq_v2", device=True)
    assert dev.is_device and isinstance(dev.qweight, cupy.ndarray) and dev.to_device() is dev
    back = dev.to_host()
    assert not back.is_device and back.nbytes == host.nbytes
    for name in ("qweight", "scales", "qzeros", "g_idx"):
        np.testing.assert_array_equal(getattr(back, name), getattr(host, name))
        np.testing.assert_array_equal(cupy.asnumpy(getattr(host.to_device(), name)), getattr(host, name))
    w13 = concat_n(dev, dev)
    assert w13.is_device and w13.n == 48


# --------------------------------------------------------------------------- from_experts
@given(st.sampled_from(BITS), st.booleans(), st.booleans(), st.sampled_from([-1, 16, 24]), st.integers(1, 4),
       st.integers(0, 2**32 - 1))
def test_from_experts_stacks_and_keeps_the_weights(bits, sym, act_order, group_size, e, seed):
    rng = np.random.default_rng(seed)
    k, n = 2 * unit(bits), unit(bits) * (1 if bits == 3 else 3)
    quants = expert_tensors(rng, e, k, n, bits, group_size, sym=sym, act_order=act_order)
    fmt = quants[0].checkpoint_format
    w = StackedGptqWeight.from_experts([q.qweight for q in quants], [q.scales.astype(np.float32) for q in quants],
                                       [q.qzeros for q in quants], [q.g_idx for q in quants] if act_order else None,
                                       bits=bits, group_size=group_size, checkpoint_format=fmt)
    assert (w.num_experts, w.k, w.n, w.bits, w.group_size) == (e, k, n, bits, group_size)
    assert w.scales.dtype == np.float16 and w.qweight.flags.c_contiguous
    for i, q in enumerate(quants):
        np.testing.assert_array_equal(w.qweight[i], q.qweight)
        np.testing.assert_array_equal(w.scales[i], q.scales)  # fp16 -> fp32 -> fp16 is exact
        want = ref.dequantize(q.qweight, q.scales, q.qzeros, q.g_idx, bits=bits, group_size=group_size,
                              checkpoint_format=fmt)
        got = ref.dequantize(w.qweight[i], w.scales[i], w.qzeros[i], None if w.g_idx is None else w.g_idx[i],
                             bits=bits, group_size=group_size, checkpoint_format="gptq_v2")  # real zeros now
        np.testing.assert_array_equal(got, want)


def test_from_experts_converts_scales_to_fp16():
    quants = expert_tensors(np.random.default_rng(2), 2, 16, 8, 4, 8)
    s32 = [np.random.default_rng(i).uniform(0, 1, size=(2, 8)).astype(np.float32) for i in range(2)]
    w = StackedGptqWeight.from_experts([q.qweight for q in quants], s32, None, bits=4, group_size=8)
    np.testing.assert_array_equal(w.scales, np.stack(s32).astype(np.float16))
    assert w.qzeros is None and w.g_idx is None


def test_from_experts_bf16_scales():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    quants = expert_tensors(np.random.default_rng(3), 2, 16, 8, 4, 8)
    sbf = [q.scales.astype(np.float32).astype(ml_dtypes.bfloat16) for q in quants]
    w = StackedGptqWeight.from_experts([q.qweight for q in quants], sbf, None, bits=4, group_size=8)
    np.testing.assert_array_equal(w.scales, np.stack(sbf).astype(np.float32).astype(np.float16))


@pytest.mark.parametrize("which", ["qweights", "scales", "qzeros", "g_idx"])
def test_from_experts_names_the_first_mismatched_expert(which):
    quants = expert_tensors(np.random.default_rng(4), 5, 32, 16, 4, 8, act_order=True)
    lists = {"qweights": [q.qweight for q in quants], "scales": [q.scales for q in quants],
             "qzeros": [q.qzeros for q in quants], "g_idx": [q.g_idx for q in quants]}
    bad = lists[which][2][:-1]  # expert 2 (and 4) lose a row
    expected_shape = lists[which][0].shape
    lists[which][2] = bad
    lists[which][4] = bad
    with pytest.raises(ValueError, match=rf"{which}\[2\]: expected shape {expected_shape} like expert 0, "
                                         rf"got {bad.shape}".replace("(", r"\(").replace(")", r"\)")):
        StackedGptqWeight.from_experts(lists["qweights"], lists["scales"], lists["qzeros"], lists["g_idx"],
                                       bits=4, group_size=8, checkpoint_format="gptq_v2")


def test_from_experts_validation_messages():
    quants = expert_tensors(np.random.default_rng(5), 2, 16, 8, 4, 8)
    qw, sc, qz = [q.qweight for q in quants], [q.scales for q in quants], [q.qzeros for q in quants]
    kw = dict(bits=4, group_size=8)
    with pytest.raises(ValueError, match=r"checkpoint_format: expected one of \('gptq', 'gptq_v2'\), got 'awq'"):
        StackedGptqWeight.from_experts(qw, sc, qz, checkpoint_format="awq", **kw)
    with pytest.raises(ValueError, match=r"bits: expected one of \(2, 3, 4, 8\), got 6"):
        StackedGptqWeight.from_experts(qw, sc, qz, bits=6, group_size=8)
    with pytest.raises(ValueError, match=r"qweights: expected at least one expert, got an empty sequence"):
        StackedGptqWeight.from_experts([], [], None, **kw)
    with pytest.raises(ValueError, match=r"scales: expected 2 experts like qweights, got 1"):
        StackedGptqWeight.from_experts(qw, sc[:1], qz, **kw)
    with pytest.raises(TypeError, match=r"qweights\[1\]: expected int32, got int64"):
        StackedGptqWeight.from_experts([qw[0], qw[1].astype(np.int64)], sc, qz, **kw)
    with pytest.raises(TypeError, match=r"qzeros\[0\]: expected int32, got uint32"):
        StackedGptqWeight.from_experts(qw, sc, [z.view(np.uint32) for z in qz], **kw)
    with pytest.raises(TypeError, match=r"scales\[0\]: expected float16, float32 or bfloat16, got int32"):
        StackedGptqWeight.from_experts(qw, [s.astype(np.int32) for s in sc], qz, **kw)
    with pytest.raises(TypeError, match=r"g_idx\[1\]: expected an integer array \(int32\), got float32"):
        StackedGptqWeight.from_experts(qw, sc, qz, [np.zeros(16, np.int32), np.zeros(16, np.float32)], **kw)
    with pytest.raises(TypeError, match=r"qweights\[0\]: expected a NumPy or CuPy array, got list"):
        StackedGptqWeight.from_experts([[1], [2]], sc, qz, **kw)
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 1, 8\)"):  # group_size disagrees
        StackedGptqWeight.from_experts(qw, sc, None, bits=4, group_size=-1)
    with pytest.raises(TypeError, match=r"qzeros: expected a sequence of arrays, one per expert, got int"):
        StackedGptqWeight.from_experts(qw, sc, 3, **kw)
    lists = StackedGptqWeight.from_experts(qw, sc, qz, **kw)  # any iterable of per-expert arrays will do
    made = StackedGptqWeight.from_experts(iter(qw), (x for x in sc), np.stack(qz), **kw)
    for name in ("qweight", "scales", "qzeros"):
        np.testing.assert_array_equal(getattr(made, name), getattr(lists, name))


@pytest.mark.parametrize("args,error,message", [
    ((1, 64, 128, 4, 0), ValueError, r"group_size: expected -1 or a positive int, got 0"),
    ((1, 64, 128, 5, 128), ValueError, r"bits: expected one of \(2, 3, 4, 8\), got 5"),
    ((-1, 64, 128, 4, 128), ValueError, r"num_experts: expected an int >= 1, got -1"),
    ((1, -8, 128, 4, 128), ValueError, r"k: expected an int >= 1, got -8"),
    ((1, 64, 128, 4, -2), ValueError, r"group_size: expected an int >= -1, got -2"),
    ((1, 4, 128, 4, 128), ValueError, r"k: expected K \* bits a multiple of 32 \(whole qweight words\), got K=4"),
    ((1, 64.0, 128, 4, 128), TypeError, r"k: expected an int, got float"),
    ((True, 64, 128, 4, 128), TypeError, r"num_experts: expected an int, got bool"),
])
def test_stacked_shapes_refuses_impossible_geometry(args, error, message):
    with pytest.raises(error, match=message):
        stacked_shapes(*args)
    assert stacked_shapes(2, 64, 128, 4, -1) == {"qweight": (2, 8, 128), "scales": (2, 1, 128),
                                                 "qzeros": (2, 1, 16), "g_idx": (2, 64)}


# --------------------------------------------------------------------------- v1 -> real zeros
def per_field_plus_one(qzeros, bits):
    """The v1 decode rule (docs/gptq_layout.md) field by field, via the reference's own unpack/pack."""
    mask = (1 << bits) - 1
    return ref.pack_cols((ref.unpack_cols(qzeros, bits) + 1) & mask, bits)


@st.composite
def v1_fields(draw, carry_free):
    bits = draw(st.sampled_from(BITS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    r, n = draw(st.integers(1, 4)), unit(bits) * draw(st.integers(1, 3))
    mask = (1 << bits) - 1
    stored = rng.integers(0, mask + 1, size=(r, n))
    if carry_free and bits != 3:
        # Word-level add carries out of a field only when it holds mask; allow that in the top field of a word
        # (the carry leaves the word, mod 2**32), not below it.
        top = (np.arange(n) % unit(bits)) == unit(bits) - 1
        stored = np.where(top, stored, rng.integers(0, mask, size=(r, n)))
    return bits, stored


def from_v1(qzeros, bits):
    """Run a [R, N*bits/32] v1 qzeros tensor through from_experts (one expert, G = 32/bits or 32, K = R*G) and
    return the stacked real zeros [R, N*bits/32]."""
    r, cols = qzeros.shape
    n, g = cols * 32 // bits, unit(bits)
    w = StackedGptqWeight.from_experts([np.zeros((r * g * bits // 32, n), np.int32)],
                                       [np.ones((r, n), np.float16)], [qzeros], bits=bits, group_size=g)
    return w.qzeros[0]


@given(v1_fields(carry_free=True))
def test_v1_conversion_equals_per_field_plus_one(case):
    bits, stored = case
    qzeros = ref.pack_cols(stored, bits)
    np.testing.assert_array_equal(from_v1(qzeros, bits), per_field_plus_one(qzeros, bits))
    mask = (1 << bits) - 1
    np.testing.assert_array_equal(ref.unpack_cols(from_v1(qzeros, bits), bits), (stored + 1) & mask)


@given(v1_fields(carry_free=False))
def test_v1_conversion_inverts_gptqmodel_export(case):
    # GPTQModel saves v1 by subtracting the packed constant word-wide (borrows included) for 2/4/8 bits and
    # field by field for 3 bits; converting back must give the real zeros exactly, whatever they are.
    bits, real = case
    np.testing.assert_array_equal(from_v1(gptqmodel_v1(real, bits), bits), ref.pack_cols(real, bits))


@pytest.mark.parametrize("bits, v1_words, real", [
    (2, [0x55555555], 2), (4, [0x77777777], 8), (8, [0x7F7F7F7F], 128),
    (3, [0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D], 4)])
def test_v1_sym_constants_become_the_symmetric_zero(bits, v1_words, real):
    words = np.array([v1_words * (unit(bits) * bits // 32 // len(v1_words))], np.uint32).view(np.int32)
    got = from_v1(words, bits)
    np.testing.assert_array_equal(ref.unpack_cols(got, bits), np.full((1, unit(bits)), real))
    if bits == 4:
        assert got.view(np.uint32).tolist() == [[0x88888888]]


# --------------------------------------------------------------------------- concat_n
@given(st.sampled_from(BITS), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_concat_n_puts_gate_columns_first(bits, sym, act_order, seed):
    rng = np.random.default_rng(seed)
    k = 2 * unit(bits)
    n_gate, n_up = unit(bits), unit(bits) * (1 if bits == 3 else 2)
    g_idx = ref.act_order_g_idx(k, 16, rng) if act_order else None
    built = []
    for n in (n_gate, n_up):
        quants = [ref.quantize(rng.standard_normal((k, n)).astype(np.float16), bits=bits, group_size=16, sym=sym,
                               g_idx=g_idx) for _ in range(2)]
        built.append(StackedGptqWeight.from_experts(
            [q.qweight for q in quants], [q.scales for q in quants], None if sym else [q.qzeros for q in quants],
            None if g_idx is None else [q.g_idx for q in quants], bits=bits, group_size=16,
            checkpoint_format=quants[0].checkpoint_format))
    gate, up = built
    w13 = concat_n(gate, up)
    assert (w13.num_experts, w13.k, w13.n) == (2, k, n_gate + n_up)
    assert StackedGptqWeight.concat_n(gate, up).n == w13.n
    for e in range(2):
        def deq(w, i=e):
            return ref.dequantize(w.qweight[i], w.scales[i], None if w.qzeros is None else w.qzeros[i],
                                  None if w.g_idx is None else w.g_idx[i], bits=bits, group_size=16,
                                  checkpoint_format="gptq_v2")
        np.testing.assert_array_equal(deq(w13), np.concatenate([deq(gate), deq(up)], axis=1))
    if act_order:
        np.testing.assert_array_equal(w13.g_idx, gate.g_idx)


def test_concat_n_validation_messages():
    gate = stacked()
    with pytest.raises(ValueError, match=r"up: expected g_idx equal to gate's"):
        g = gate.g_idx.copy()
        g[1, [0, 16]] = g[1, [16, 0]]  # expert 1: rows 0 and 16 trade groups (still valid act-order)
        concat_n(gate, dataclasses.replace(gate, g_idx=np.ascontiguousarray(g)))
    with pytest.raises(ValueError, match=r"up: expected bits = 4 like gate, got 8"):
        concat_n(gate, stacked(k=40, bits=8))
    with pytest.raises(ValueError, match=r"up: expected k = 40 like gate, got 48"):
        concat_n(gate, stacked(k=48))
    with pytest.raises(ValueError, match=r"up: expected num_experts = 3 like gate, got 2"):
        concat_n(gate, stacked(e=2))
    with pytest.raises(ValueError, match=r"up: expected group_size = 16 like gate, got -1"):
        concat_n(gate, stacked(group_size=-1))
    with pytest.raises(ValueError, match=r"up: expected qzeros present like gate .* got None"):
        concat_n(gate, stacked(zeros=False))
    with pytest.raises(ValueError, match=r"up: expected g_idx present like gate, got None"):
        concat_n(gate, stacked(g_idx=False))
    with pytest.raises(TypeError, match=r"up: expected a StackedGptqWeight, got dict"):
        concat_n(gate, {})


def test_concat_n_device_placement_must_agree(fake_device):
    gate = stacked()
    up = StackedGptqWeight(**{k: (v.view(FakeDevice) if isinstance(v, np.ndarray) else v)
                              for k, v in fields(stacked()).items()})
    assert up.is_device
    with pytest.raises(ValueError, match=r"up: expected is_device = False like gate, got True"):
        concat_n(gate, up)


# --------------------------------------------------------------------------- from_safetensors
def test_from_safetensors_delegates_to_checkpoint(monkeypatch):
    calls = []
    fake = types.ModuleType("cupy_moe.checkpoint")
    fake.load_stacked = (lambda path, layer, proj, *, device, scheme:
                         calls.append((path, layer, proj, device, scheme)) or "w")
    monkeypatch.setitem(sys.modules, "cupy_moe.checkpoint", fake)
    assert StackedGptqWeight.from_safetensors("ckpt", 3, "w13", device=False, scheme="s") == "w"
    assert StackedGptqWeight.from_safetensors("ckpt", 0, "w2") == "w"
    assert calls == [("ckpt", 3, "w13", False, "s"), ("ckpt", 0, "w2", True, None)]


@pytest.mark.gpu
def test_random_weight_for_timing():
    # the tuner's and benchmarks' weights: valid stacked shapes on the device, seeded, scales near 1/(2**bits sqrt(K))
    w = StackedGptqWeight.random(3, 256, 64, bits=8, group_size=64, seed=5)
    assert w.is_device and (w.num_experts, w.k, w.n, w.num_groups) == (3, 256, 64, 4) and w.qzeros is not None
    again = StackedGptqWeight.random(3, 256, 64, bits=8, group_size=64, seed=5)
    assert bool((w.qweight == again.qweight).all()) and bool((w.scales == again.scales).all())
    scale = float(w.scales.astype(np.float32).mean()) * 2**8 * 16
    assert 0.8 < scale < 1.2


def test_random_weight_needs_a_gpu(monkeypatch):
    from cupy_moe import _xp
    monkeypatch.setattr(_xp, "gpu_available", lambda: False)
    with pytest.raises(RuntimeError, match="StackedGptqWeight.random needs"):
        StackedGptqWeight.random(2, 64, 32)
