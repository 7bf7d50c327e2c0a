"""The whole MoE layer on the NumPy path: routing, experts, shared experts, biases, against plain loops."""
import re

import numpy as np
import pytest

import cupy_moe
from cupy_moe import reference
from cupy_moe import configs
from cupy_moe.layer import MoELayer, MoEPlan, fused_moe, plan_moe, route_experts, select_experts
from cupy_moe.testing import dense_layer_output, edit_checkpoint, write_checkpoint
from cupy_moe.weights import StackedGptqWeight

from tolerances import REL_L2

H, I, E = 128, 192, 8


def rel_l2(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def hidden(m, seed=0, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal((m, H)).astype(dtype)


@pytest.mark.parametrize("family,extra", [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", {}),
    ("deepseek_v2", {}),
    ("deepseek_v3", {}),
    ("mixtral", dict(desc_act=True, group_size=32)),
    ("qwen3_moe", dict(sym=False)),
    ("deepseek_v2", dict(bits=8, group_size=-1)),
    ("mixtral", dict(bias=True)),
    ("qwen2_moe", dict(quantize_shared=False)),
    ("mixtral", dict(dynamic={"-:.*experts.*": {}})),
])
def test_layer_matches_dense_float64(tmp_path, family, extra):
    spec = dict(hidden=H, intermediate=I, num_experts=E, top_k=2, group_size=64, return_weights=False)
    spec.update(extra)
    write_checkpoint(tmp_path, family=family, **spec)
    layer = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    assert isinstance(layer, MoELayer)
    x = hidden(7)
    y = layer(x)
    assert y.shape == (7, H) and y.dtype == np.float16
    assert rel_l2(y, dense_layer_output(layer, x)) <= REL_L2["float16"]


def test_layer_with_no_tokens(tmp_path):
    write_checkpoint(tmp_path, family="qwen2_moe", hidden=H, intermediate=I, num_experts=E, return_weights=False)
    y = cupy_moe.load_moe_layer(tmp_path, 0, device=False)(hidden(0))
    assert y.shape == (0, H)


def _plain_topk(scores, k):
    """Top-k per row by a plain Python sort: larger first, ties to the lower index."""
    return np.array([sorted(range(len(row)), key=lambda e: (-row[e], e))[:k] for row in scores])


def test_softmax_routing_matches_plain_sort(tmp_path):
    write_checkpoint(tmp_path, family="mixtral", hidden=H, intermediate=I, num_experts=E, return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    x = hidden(33, seed=3)
    weights, ids = layer.route(x)
    logits = x.astype(np.float32) @ layer.weights.router_weight.astype(np.float32).T
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want = _plain_topk(probs, 2)
    np.testing.assert_array_equal(ids, want)
    picked = np.take_along_axis(probs, want, 1)
    np.testing.assert_allclose(weights, picked / picked.sum(1, keepdims=True), rtol=1e-5)  # Mixtral renormalizes


def test_router_bias_is_loaded_and_added_to_the_logits(tmp_path):
    """A router with a `.bias` tensor: the loader keeps it (float32 [E]) and routing adds it to the logits."""
    write_checkpoint(tmp_path, family="mixtral", hidden=H, intermediate=I, num_experts=E, return_weights=False)
    bias = np.linspace(-1, 1, E).astype(np.float32)
    bias[5] = 30.0  # far above every logit of these tokens: expert 5 is everyone's first choice
    edit_checkpoint(tmp_path, replace={"model.layers.0.block_sparse_moe.gate.bias": bias.astype(np.float16)})
    layer = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    assert layer.weights.router_bias.dtype == np.float32
    np.testing.assert_array_equal(layer.weights.router_bias, bias.astype(np.float16).astype(np.float32))
    x = hidden(33, seed=3)
    weights, ids = layer.route(x)
    logits = x.astype(np.float32) @ layer.weights.router_weight.astype(np.float32).T + layer.weights.router_bias
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, _plain_topk(probs, 2))
    assert (ids[:, 0] == 5).all()


@pytest.mark.parametrize("topk_group", [1, 2])
def test_deepseek_v3_grouped_sigmoid_routing(tmp_path, topk_group):
    write_checkpoint(tmp_path, family="deepseek_v3", hidden=H, intermediate=I, num_experts=E, top_k=2,
                     extra_config=dict(n_group=4, topk_group=topk_group), return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    w = layer.weights
    x = hidden(9, seed=5)
    weights, ids = layer.route(x)
    logits = x.astype(np.float32) @ w.router_weight.astype(np.float32).T
    scores = 1 / (1 + np.exp(-logits))
    for m in range(9):
        choice = scores[m] + w.e_score_correction_bias
        groups = [sorted(choice[g * 2:(g + 1) * 2])[-2:] for g in range(4)]  # 2 experts per group
        kept = sorted(range(4), key=lambda g: (-sum(groups[g]), g))[:topk_group]
        masked = np.array([choice[e] if e // 2 in kept else -np.inf for e in range(E)])
        want = _plain_topk(masked[None], 2)[0]
        np.testing.assert_array_equal(ids[m], want)
        picked = scores[m, want]
        np.testing.assert_allclose(weights[m], picked / picked.sum() * w.routed_scaling_factor, rtol=1e-5)


def _plain_route(logits, a, scoring, bias, method, n_group, topk_group, renormalize, scale):
    """route_experts by plain Python sorts in float64, one token at a time."""
    weights, ids = [], []
    for row in logits.astype(np.float64):
        z = np.exp(row - row.max())
        scores = z / z.sum() if scoring == "softmax" else 1 / (1 + np.exp(-row))
        choice = scores + (0 if bias is None else bias)
        if method in ("group_limited_greedy", "noaux_tc") and n_group > 1:
            size = len(row) // n_group
            best = [sorted(choice[g * size:(g + 1) * size], reverse=True)[:2 if method == "noaux_tc" else 1]
                    for g in range(n_group)]
            kept = sorted(range(n_group), key=lambda g: (-sum(best[g]), g))[:topk_group]
            choice = np.array([c if e // size in kept else 0.0 for e, c in enumerate(choice)])
        pick = sorted(range(len(row)), key=lambda e: (-choice[e], e))[:a]
        w = scores[pick]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scale)
        ids.append(pick)
    return np.array(weights), np.array(ids)


ROUTINGS = [  # (E, A, scoring, bias, topk_method, n_group, topk_group, renormalize, routed_scaling_factor)
    (256, 8, "sigmoid", True, "noaux_tc", 8, 4, True, 2.5),          # DeepSeek-V3
    (160, 6, "softmax", False, "group_limited_greedy", 8, 3, False, 16.0),  # DeepSeek-V2
    (64, 6, "softmax", False, "greedy", 1, 1, False, 1.0),              # DeepSeek-V2-Lite
    (64, 4, "sigmoid", True, "greedy", None, None, True, 1.0),         # sigmoid scores, no groups
    (32, 4, "softmax", True, "noaux_tc", 16, 2, True, 1.5),             # groups of two experts
]


@pytest.mark.parametrize("e,a,scoring,bias,method,n_group,topk_group,renormalize,scale", ROUTINGS)
def test_route_experts_numpy_matches_plain_sorts(e, a, scoring, bias, method, n_group, topk_group, renormalize,
                                                 scale):
    rng = np.random.default_rng(e + a)
    logits = (rng.standard_normal((40, e)) * 2).astype(np.float32)
    b = (rng.standard_normal(e) * 0.1).astype(np.float32) if bias else None
    kw = dict(scoring_func=scoring, e_score_correction_bias=b, topk_method=method, n_group=n_group,
              topk_group=topk_group, renormalize=renormalize, routed_scaling_factor=scale)
    weights, ids = route_experts(logits, a, **kw)
    assert weights.dtype == np.float32 and ids.dtype == np.int32 and ids.shape == (40, a)
    want_w, want_ids = _plain_route(logits, a, scoring, b, method, n_group or 1, topk_group, renormalize, scale)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)


def test_route_experts_rejects_bad_arguments():
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match="router_logits: expected dtype float32, got float16"):
        route_experts(logits.astype(np.float16), 2)
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, min\(E, 32\)\] = \[1, 8\], got 9"):
        route_experts(logits, 9)
    with pytest.raises(ValueError, match="scoring_func: expected 'softmax' or 'sigmoid', got 'relu'"):
        route_experts(logits, 2, scoring_func="relu")
    with pytest.raises(ValueError, match="topk_method: expected 'greedy', 'group_limited_greedy' or 'noaux_tc'"):
        route_experts(logits, 2, topk_method="random")
    with pytest.raises(ValueError, match="n_group: expected a divisor of E = 8 of at most 32, got 3"):
        route_experts(logits, 2, topk_method="noaux_tc", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="n_group: expected groups of at least 2 experts with topk_method "
                                         "'noaux_tc'.*E = 8, n_group = 8"):
        route_experts(logits, 2, topk_method="noaux_tc", n_group=8, topk_group=1)
    with pytest.raises(ValueError, match=r"topk_group: expected an int in \[1, n_group = 4\], got 5"):
        route_experts(logits, 2, topk_method="noaux_tc", n_group=4, topk_group=5)
    with pytest.raises(ValueError, match=r"e_score_correction_bias: expected float32 \[E\] = \[8\]"):
        route_experts(logits, 2, e_score_correction_bias=np.zeros(4, np.float32))
    for call in (lambda: route_experts(logits, 2, renormalize="no"), lambda: select_experts(logits, 2, "no")):
        with pytest.raises(TypeError, match="renormalize: expected True or False, got 'no'"):
            call()
    for n_group in (0, -2, True, 2.0, "2"):  # never read as "no groups" or as another number
        with pytest.raises(ValueError, match=f"n_group: expected None or a positive int, got {n_group!r}"):
            route_experts(logits, 2, topk_method="noaux_tc", n_group=n_group, topk_group=1)
    for scale in (None, float("nan"), float("inf"), -1.0, 0, "x", True):
        with pytest.raises(ValueError, match=f"routed_scaling_factor: expected a positive finite number, got "
                                             f"{re.escape(repr(scale))}"):
            route_experts(logits, 2, routed_scaling_factor=scale)
    with pytest.raises(ValueError, match=r"top_k: expected at most topk_group \* E / n_group = 2 \(the experts of "
                                         r"the kept groups\), got 3"):
        route_experts(logits, 3, topk_method="group_limited_greedy", n_group=4, topk_group=1)


def test_select_experts_numpy_is_the_reference():
    logits = np.random.default_rng(1).standard_normal((11, 12)).astype(np.float32)
    for got, want in zip(select_experts(logits, 3, True), reference.select_experts(logits, 3, True)):
        np.testing.assert_array_equal(got, want)


def _stacked(tmp_path):
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, return_weights=False)
    return cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights


def test_fused_moe_numpy_is_the_reference(tmp_path):
    w = _stacked(tmp_path)
    x = hidden(5)
    logits = np.random.default_rng(2).standard_normal((5, E)).astype(np.float32)
    weights, ids = reference.select_experts(logits, 2, True)
    want = reference.fused_moe(x, w.w13, w.w2, weights, ids)
    np.testing.assert_array_equal(fused_moe(x, w.w13, w.w2, weights, ids), want)
    out = np.full((5, H), np.nan, np.float16)
    assert fused_moe(x, w.w13, w.w2, weights, ids, out=out) is out
    np.testing.assert_array_equal(out, want)


def test_fused_moe_gemm_and_align_numpy_are_the_reference(tmp_path):
    """The public NumPy paths of one GEMM phase and its align give the reference's outputs bit for bit: routing
    weights, `out`, pair-ordered activations, one pair per block; a padded total below the capacity."""
    w = _stacked(tmp_path)
    rng = np.random.default_rng(4)
    m, a = 5, 2
    ids = np.stack([rng.permutation(E)[:a] for _ in range(m)]).astype(np.int32)
    got = cupy_moe.moe_align_block_size(ids, 16, E)
    want = reference.moe_align_block_size(ids, 16, E)
    for g, r in zip(got, want):
        assert g.dtype == np.int32
        np.testing.assert_array_equal(g, r)
    assert got[2][0] < got[0].size  # the total is the routing's, not the capacity
    x, tw = hidden(m), rng.uniform(0.1, 1.0, (m, a)).astype(np.float32)
    for args, kw in (((x, w.w13, *got, a), {}), ((x, w.w13, *got, a, tw), {}),
                     ((x[:1], w.w13, None, ids[:1], None, a), {}),
                     ((reference.to_pair_order(rng.standard_normal((m * a, I)).astype(np.float16)), w.w2, *got, 1,
                       tw), dict(a_pair_order=True))):
        ref = reference.fused_moe_gemm(*args, **kw)
        assert ref.any()
        np.testing.assert_array_equal(cupy_moe.fused_moe_gemm(*args, **kw), ref)
        out = np.full_like(ref, np.nan)
        assert cupy_moe.fused_moe_gemm(*args, out=out, **kw) is out
        np.testing.assert_array_equal(out, ref)


H200 = configs.GpuInfo("Test H200", "sm_90a", 132)


@pytest.mark.parametrize("m", [1, 3, 5, 300])
def test_plan_moe_holds_the_configurations_fused_moe_launches(tmp_path, m):
    """Both phases' configurations as choose_config gives them (16-row blocks, one pair per block at M = 1 and, on
    these small experts, up to configs.one_pair_blocks' 4 tokens); no workspace for host weights; the NumPy path takes
    the plan and gives the reference bitwise."""
    w = _stacked(tmp_path)
    plan = plan_moe(m, w.w13, w.w2, 2, gpu=H200)
    one = m <= 4
    assert one == configs.one_pair_blocks(m, 2, (w.w13.nbytes + w.w2.nbytes) / E)
    block_m = 16 if one else None
    up = configs.choose_config(m, E, 2, H, 2 * I, w.w13.bits, w.w13.group_size, block_m, gpu=H200, one_pair=one)
    down = configs.choose_config(2 * m, E, 1, I, H, w.w2.bits, w.w2.group_size, block_m, gpu=H200, one_pair=one)
    assert (plan.up, plan.down) == (up, down)
    assert plan.pair_order == configs.down_pair_order(w.w2.bits, down.block_m)
    assert plan.one_pair == one and plan.workspace is None
    with pytest.raises(AttributeError):
        plan.up = down
    x = hidden(m)
    weights, ids = reference.select_experts(np.random.default_rng(m).standard_normal((m, E)).astype(np.float32), 2,
                                           True)
    np.testing.assert_array_equal(fused_moe(x, w.w13, w.w2, weights, ids, plan=plan),
                                  reference.fused_moe(x, w.w13, w.w2, weights, ids))


def test_shared_experts_keep_the_aligned_list_beyond_one_token(tmp_path):
    """MoELayer's shared experts run beside the routed ones (a side stream), where the align is off the critical
    path: their plan takes one pair per block at M = 1 only, though the rule fused_moe applies would take it up to 4
    tokens on these weights."""
    from cupy_moe import layer
    w = _stacked(tmp_path)
    for m in (1, 2, 3, 4):
        assert layer._choose(m, 1, w.w13, w.w2, H200, allocate=False, overlapped=True).one_pair == (m == 1)
        assert plan_moe(m, w.w13, w.w2, 1, gpu=H200).one_pair


def test_fused_moe_refuses_a_plan_of_another_problem(tmp_path):
    w = _stacked(tmp_path)
    x = hidden(4)
    weights, ids = np.full((4, 2), 0.5, np.float32), np.zeros((4, 2), np.int32)
    want = r"\(4, 2, 128, 192, 8, 4, 32, False, 4, 32, False\)"
    for plan in (plan_moe(3, w.w13, w.w2, 2, gpu=H200), plan_moe(4, w.w13, w.w2, 1, gpu=H200)):
        with pytest.raises(ValueError, match=r"plan: expected a plan of \(M, A, H, I, E, .*\) = " + want):
            fused_moe(x, w.w13, w.w2, weights, ids, plan=plan)
    with pytest.raises(TypeError, match=r"plan: expected a MoEPlan \(plan_moe\(...\)\) or None, got str"):
        fused_moe(x, w.w13, w.w2, weights, ids, plan="auto")
    assert isinstance(plan_moe(4, w.w13, w.w2, 2, gpu=H200), MoEPlan)


def test_plan_moe_rejects_bad_arguments(tmp_path):
    w = _stacked(tmp_path)
    with pytest.raises(ValueError, match=r"num_tokens: expected an int in \[1, inf\], got 0"):
        plan_moe(0, w.w13, w.w2, 2, gpu=H200)
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, 8\], got 9"):
        plan_moe(4, w.w13, w.w2, 9, gpu=H200)
    with pytest.raises(TypeError, match="num_tokens: expected an int, got bool"):
        plan_moe(True, w.w13, w.w2, 2, gpu=H200)
    with pytest.raises(ValueError, match=r"w13: expected N = 2I = 384 \(twice w2's K\), got N=128"):
        plan_moe(4, w.w2, w.w2, 2, gpu=H200)
    with pytest.raises(TypeError, match="w2: expected a StackedGptqWeight, got ndarray"):
        plan_moe(4, w.w13, np.zeros(3), 2, gpu=H200)


def test_fused_moe_rejects_bad_arguments(tmp_path):
    w = _stacked(tmp_path)
    x = hidden(4)
    weights = np.full((4, 2), 0.5, np.float32)
    ids = np.zeros((4, 2), np.int32)
    with pytest.raises(TypeError, match="w13: expected a StackedGptqWeight, got ndarray"):
        fused_moe(x, np.zeros(3), w.w2, weights, ids)
    with pytest.raises(ValueError, match=r"hidden_states: expected a 2-D array \[M, H\], got shape \(4, 128, 1\)"):
        fused_moe(x[:, :, None], w.w13, w.w2, weights, ids)
    with pytest.raises(ValueError, match=r"w13: expected K = H = 64 \(hidden_states' columns\), got K=128"):
        fused_moe(x[:, :64], w.w13, w.w2, weights, ids)
    with pytest.raises(ValueError, match=r"w13: expected N = 2I = 256 \(twice w2's K\), got N=384"):
        fused_moe(x, w.w13, w.w13, weights, ids)
    narrow = StackedGptqWeight(w.w2.qweight[..., :64].copy(), w.w2.scales[..., :64].copy(),
                               w.w2.qzeros[..., :8].copy() if w.w2.qzeros is not None else None, w.w2.g_idx,
                               bits=w.w2.bits, group_size=w.w2.group_size)
    with pytest.raises(ValueError, match=r"w2: expected N = H = 128, got N=64"):
        fused_moe(x, w.w13, narrow, weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids: expected 4 rows \(M\), got shape \(3, 2\)"):
        fused_moe(x, w.w13, w.w2, weights, ids[:3])
    with pytest.raises(ValueError, match=r"topk_weights: expected 2 columns, got shape \(4, 1\)"):
        fused_moe(x, w.w13, w.w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match=r"topk_ids: expected A >= 1 columns \(experts per token\), got shape "
                                         r"\(4, 0\)"):
        fused_moe(x, w.w13, w.w2, weights[:, :0], ids[:, :0])
    # `out` is checked with the rest, before any work, as on the GPU
    for out in (np.zeros((4, 128), np.float32), np.zeros((4, 127), np.float16), np.zeros((128, 4), np.float16).T,
                [0.0] * 4):
        with pytest.raises(ValueError, match=r"out: expected a C-contiguous NumPy array \[M, H\] = \[4, 128\] of "
                                             r"float16, got"):
            fused_moe(x, w.w13, w.w2, weights, ids, out=out)


def test_moe_layer_takes_loaded_weights_only(tmp_path):
    with pytest.raises(TypeError, match=r"weights: expected a cupy_moe.checkpoint.MoELayerWeights "
                                        r"\(load_layer_weights, or MoELayer.from_checkpoint\), got str"):
        MoELayer(str(tmp_path))


def test_layer_rejects_wrong_width_and_place(tmp_path):
    write_checkpoint(tmp_path, family="mixtral", hidden=H, intermediate=I, num_experts=E, return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    with pytest.raises(ValueError, match=r"hidden_states: expected 128 columns, got shape \(2, 64\)"):
        layer(hidden(2)[:, :64])
