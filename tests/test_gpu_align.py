"""GPU moe_align_block_size equals the reference bit for bit (and keeps its invariants)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupy_moe import reference
from cupy_moe.align import MAX_EXPERTS, MAX_PAIRS, align_capacity, moe_align_block_size

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _fast_expected(topk_ids, block, num_experts):
    """The reference's outputs, vectorized (the loop reference takes minutes at 2^24 pairs)."""
    flat = topk_ids.reshape(-1).astype(np.int64)
    p = flat.size
    order = np.argsort(flat, kind="stable")  # ascending p inside an expert
    counts = np.bincount(flat, minlength=num_experts)
    padded = -(-counts // block) * block
    start = np.concatenate([[0], np.cumsum(padded)])
    capacity = align_capacity(p, block, num_experts)
    sorted_ids = np.full(capacity, p, np.int32)
    first = np.concatenate([[0], np.cumsum(counts)])[:-1]
    rank = np.arange(p) - np.repeat(first, counts)
    sorted_ids[np.repeat(start[:-1], counts) + rank] = order
    expert_ids = np.full(capacity // block, -1, np.int32)
    expert_ids[:start[-1] // block] = np.repeat(np.arange(num_experts), padded // block)
    return sorted_ids, expert_ids, np.array([start[-1]], np.int32)


def _check(topk_ids, block, num_experts, fast=False):
    s, e, t = moe_align_block_size(cp.asarray(topk_ids), block, num_experts)
    if fast:
        rs, re, rt = _fast_expected(topk_ids, block, num_experts)
    else:
        rs, re, rt = reference.moe_align_block_size(topk_ids, block, num_experts)
        for x, y in zip(_fast_expected(topk_ids, block, num_experts), (rs, re, rt)):
            np.testing.assert_array_equal(x, y)  # the fast builder is the reference
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
                                         (1025, 8, 1024, 16)])
def test_align_large(m, a, e, block):
    rng = np.random.default_rng(m)
    _check(rng.integers(0, e, size=(m, a)).astype(np.int32), block, e, fast=m * a > 100000)


def test_align_2_pow_24_pairs():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1024, size=(1 << 21, 8)).astype(np.int32)  # P = 2^24
    _check(ids, 16, 1024, fast=True)


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
