"""GPU moe_align_block_size equals the reference bit for bit (and keeps its invariants)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cupy_moe import reference
from cupy_moe.align import MAX_EXPERTS, MAX_PAIRS, align_capacity, moe_align_block_size

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _check(topk_ids, block, num_experts):
    s, e, t = moe_align_block_size(cp.asarray(topk_ids), block, num_experts)
    rs, re, rt = reference.moe_align_block_size(topk_ids, block, num_experts)
    assert s.dtype == e.dtype == t.dtype == cp.int32
    np.testing.assert_array_equal(cp.asnumpy(s), rs)
    np.testing.assert_array_equal(cp.asnumpy(e), re)
    np.testing.assert_array_equal(cp.asnumpy(t), rt)
    assert s.size == align_capacity(topk_ids.size, block, num_experts)


@st.composite
def routings(draw):
    e = draw(st.integers(1, 257))
    a = draw(st.integers(1, min(e, 8)))
    m = draw(st.sampled_from([0, 1, 2, 3, 7, 33, 127, 1000, 2049, 5000]))
    kind = draw(st.sampled_from(["uniform", "one", "few"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if kind == "uniform":
        ids = np.stack([rng.permutation(e)[:a] for _ in range(m)]) if m else np.zeros((0, a), np.int64)
    elif kind == "one":
        ids = np.full((m, a), draw(st.integers(0, e - 1)))
    else:
        ids = rng.integers(0, min(e, 3), size=(m, a))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    block = draw(st.sampled_from([1, 16, 64, 128, 7]))
    return ids.reshape(m, a).astype(dtype), block, e


@given(routings())
def test_align_matches_reference(case):
    _check(*case)


@pytest.mark.parametrize("m,a,e,block", [(40000, 8, 256, 16), (3000, 8, 1024, 64), (65536, 1, 1, 16),
                                         (1 << 21, 8, 128, 64)])
def test_align_large(m, a, e, block):
    rng = np.random.default_rng(m)
    _check(rng.integers(0, e, size=(m, a)).astype(np.int32), block, e)


def test_align_2_pow_24_pairs():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1024, size=(1 << 21, 8)).astype(np.int32)  # P = 2^24
    _check(ids, 16, 1024)


def test_align_rejects():
    ids = cp.zeros((4, 2), cp.int32)
    with pytest.raises(ValueError, match="num_experts"):
        moe_align_block_size(ids, 16, MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match="block_size"):
        moe_align_block_size(ids, 0, 8)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_align_block_size(ids.astype(cp.float32), 16, 8)
    with pytest.raises(ValueError, match="pairs"):
        moe_align_block_size(cp.zeros((MAX_PAIRS + 1, 1), cp.int8).astype(cp.int32), 16, 8)
