"""cupy_moe.reference.moe_align_block_size: invariants as properties, plus the docstring's worked example.

Shape letters: M tokens, A top-k, E experts, B block size, P = M*A pairs (pair p = token*A + slot),
C capacity = (P + min(E, P) * (B - 1)) // B * B, T = num_tokens_post_padded.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupy_moe import reference as ref


def check_alignment(topk_ids, block, num_experts):
    """Run the reference and assert every invariant of the contract; returns its outputs."""
    sorted_ids, expert_ids, total = ref.moe_align_block_size(topk_ids, block, num_experts)
    flat = topk_ids.reshape(-1)  # [P] expert of pair p
    p_total = flat.size
    sentinel = p_total
    capacity = (p_total + min(num_experts, p_total) * (block - 1)) // block * block

    # dtypes and shapes: capacity formula exactly, a multiple of B
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == np.int32
    assert sorted_ids.shape == (capacity,) and capacity % block == 0
    assert expert_ids.shape == (capacity // block,) and total.shape == (1,)

    # padded total: a multiple of B, the sum of each expert's run rounded up to B, within the capacity
    t = int(total[0])
    counts = np.bincount(flat, minlength=num_experts)  # [E]
    assert t % block == 0 and t <= capacity
    assert t == int(sum(-(-c // block) * block for c in counts))

    # past the padded total: only sentinels and -1 blocks
    assert np.all(sorted_ids[t:] == sentinel)
    assert np.all(expert_ids[t // block:] == -1)
    used = expert_ids[:t // block]
    assert np.all((used >= 0) & (used < num_experts))  # expert ids in range
    assert np.all(np.diff(used) >= 0)  # grouped by expert, ascending

    # every pair exactly once; anything else is the sentinel
    real = sorted_ids[:t][sorted_ids[:t] != sentinel]
    assert sorted(real.tolist()) == list(range(p_total))
    assert np.all((sorted_ids >= 0) & (sorted_ids <= sentinel))

    for expert in range(num_experts):
        blocks = np.nonzero(used == expert)[0]
        assert blocks.size == -(-counts[expert] // block)  # exactly the blocks this expert needs
        if blocks.size == 0:
            continue
        assert np.all(np.diff(blocks) == 1)  # contiguous run
        run = sorted_ids[blocks[0] * block:(blocks[-1] + 1) * block]
        n_real = int(counts[expert])
        # the run holds exactly this expert's pairs in ascending p, then sentinels only as padding (< B of them)
        np.testing.assert_array_equal(run[:n_real], np.nonzero(flat == expert)[0])
        assert np.all(run[n_real:] == sentinel) and run.size - n_real < block
    # each block's pairs all belong to that block's expert
    for b in range(t // block):
        pairs = sorted_ids[b * block:(b + 1) * block]
        pairs = pairs[pairs != sentinel]
        assert pairs.size > 0  # a padded block always starts with a real pair
        assert np.all(flat[pairs] == used[b])
    return sorted_ids, expert_ids, total


@st.composite
def routings(draw, max_m=40, max_e=300):
    e = draw(st.integers(1, max_e))
    m = draw(st.integers(0, max_m))
    a_k = draw(st.integers(1, min(e, 8)))
    block = draw(st.sampled_from([1, 2, 3, 16, 64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    mode = draw(st.sampled_from(["distinct", "repeats", "skewed"]))
    if mode == "distinct":  # real routers: A distinct experts per token
        ids = np.array([rng.choice(e, a_k, replace=False) for _ in range(m)]).reshape(m, a_k)
    elif mode == "repeats":  # the reference does not require distinct slots
        ids = rng.integers(0, e, size=(m, a_k))
    else:  # a few hot experts, many empty ones
        ids = rng.integers(0, min(e, 3), size=(m, a_k)) * max(e // 3, 1) % e
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return ids.astype(dtype), block, e


@given(routings())
def test_align_invariants(case):
    check_alignment(*case)


def test_worked_example_from_docstring():
    sorted_ids, expert_ids, total = check_alignment(np.array([[1, 3], [1, 0], [3, 1]]), 4, 4)
    assert sorted_ids.tolist() == [3, 6, 6, 6, 0, 2, 5, 6, 1, 4, 6, 6, 6, 6, 6, 6]
    assert expert_ids.tolist() == [0, 1, 3, -1]
    assert total.tolist() == [12]


@pytest.mark.parametrize("block", [1, 16])
def test_no_tokens(block):
    sorted_ids, expert_ids, total = check_alignment(np.zeros((0, 2), np.int32), block, 8)
    assert sorted_ids.size == 0 and expert_ids.size == 0 and total.tolist() == [0]


def test_one_token():
    sorted_ids, expert_ids, total = check_alignment(np.array([[5, 2]], np.int32), 16, 8)
    # C = (2 + 2 * 15) // 16 * 16 = 32: both pairs padded to their own block, nothing left over
    assert sorted_ids.tolist() == [1] + [2] * 15 + [0] + [2] * 15
    assert expert_ids.tolist() == [2, 5] and total.tolist() == [32]


@given(st.integers(0, 50), st.sampled_from([1, 5, 16]))
def test_one_expert(m, block):
    _, expert_ids, total = check_alignment(np.zeros((m, 1), np.int32), block, 1)
    assert set(expert_ids[:total[0] // block].tolist()) <= {0}


@given(st.integers(1, 60), st.integers(1, 4), st.sampled_from([1, 4, 16]), st.integers(0, 256))
def test_every_token_on_one_expert_of_257(m, a_k, block, hot):
    # E = 257 (not a power of two, above 256); all pairs on expert `hot`; slots repeat that expert
    sorted_ids, expert_ids, total = check_alignment(np.full((m, a_k), hot, np.int32), block, 257)
    p_total = m * a_k
    assert total[0] == -(-p_total // block) * block
    assert sorted_ids[:p_total].tolist() == list(range(p_total))  # ascending p
    assert set(expert_ids[:total[0] // block].tolist()) == {hot}


@given(st.integers(1, 12), st.integers(1, 10), st.sampled_from([1, 3, 16]), st.integers(0, 2**32 - 1))
def test_top_k_equals_num_experts(m, e, block, seed):
    rng = np.random.default_rng(seed)
    ids = np.array([rng.permutation(e) for _ in range(m)], np.int32)  # [M, A = E]
    sorted_ids, expert_ids, total = check_alignment(ids, block, e)
    assert total[0] == e * (-(-m // block) * block)  # every expert has exactly M pairs


@given(st.integers(1, 40), st.sampled_from([1, 2, 7, 16]))
def test_capacity_is_reached_by_the_worst_routing(e, block):
    # One pair per expert: each needs a whole block, T = E * B, which is exactly C for P = E.
    ids = np.arange(e, dtype=np.int32).reshape(e, 1)
    sorted_ids, _, total = check_alignment(ids, block, e)
    assert total[0] == sorted_ids.size == e * block


def test_align_validation_messages():
    ids = np.array([[0, 1]], np.int32)
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 3\] \(num_experts=4\), "
                                         r"got range \[-1, 1\]"):
        ref.moe_align_block_size(np.array([[-1, 1]]), 4, 4)
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 1\] .* got range \[0, 2\]"):
        ref.moe_align_block_size(np.array([[0, 2]]), 4, 2)
    with pytest.raises(ValueError, match=r"block_size: expected a positive int, got 0"):
        ref.moe_align_block_size(ids, 0, 4)
    with pytest.raises(TypeError, match=r"num_experts: expected an int, got float"):
        ref.moe_align_block_size(ids, 4, 4.0)
    with pytest.raises(TypeError, match=r"topk_ids: expected an integer array, got float32"):
        ref.moe_align_block_size(ids.astype(np.float32), 4, 4)
    with pytest.raises(ValueError, match=r"topk_ids: expected 2-D \[M, A\], got shape \(2,\)"):
        ref.moe_align_block_size(ids[0], 4, 4)
