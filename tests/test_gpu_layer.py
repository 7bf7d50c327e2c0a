"""The whole MoE layer on the GPU against the NumPy path, select_experts, CUDA graph replay, DLPack interop."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, strategies as st

import cupy_moe
from cupy_moe import reference
from cupy_moe.layer import fused_moe, plan_moe, select_experts
from cupy_moe.testing import dense_layer_output, write_checkpoint

from random_weights import make_weight
from tolerances import REL_L2

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

H, I, E = 256, 384, 8


def _dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.float16


def rel_l2(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


QUIRKS = [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", dict(sym=False)),
    ("deepseek_v2", dict(desc_act=True, group_size=64)),
    ("deepseek_v3", dict(extra_config=dict(n_group=4, topk_group=2))),
    ("mixtral", dict(bits=8, group_size=-1)),
    ("qwen2_moe", dict(scales_dtype="bfloat16", zero_bias=True, num_shards=3)),
    ("mixtral", dict(bias=True)),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family,extra", QUIRKS)
def test_layer_gpu_matches_dense_reference(tmp_path, family, extra, dtype):
    spec = dict(hidden=H, intermediate=I, num_experts=E, top_k=2, group_size=128, return_weights=False)
    spec.update(extra)
    write_checkpoint(tmp_path, family=family, **spec)
    gpu = cupy_moe.load_moe_layer(tmp_path, 0)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    dt = _dtype(dtype)
    for m in (0, 1, 37, 300):
        x = np.random.default_rng(m).standard_normal((m, H)).astype(dt)
        y = gpu(cp.asarray(x))
        assert y.shape == (m, H) and y.dtype == dt
        if m == 0:
            continue
        y = cp.asnumpy(y).astype(np.float32)
        assert not np.isnan(y).any()
        # Routing is float32 on both sides, summed in different orders: compare the tokens routed alike.
        same = (cp.asnumpy(gpu.route(cp.asarray(x))[1]) == host.route(x)[1]).all(axis=1)
        assert same.mean() >= 0.9
        assert rel_l2(y[same], dense_layer_output(host, x[same])) <= REL_L2[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 5, 64, 513])
def test_fused_moe_gpu_matches_reference(tmp_path, dtype, m):
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, H)).astype(_dtype(dtype))
    weights, ids = reference.select_experts(rng.standard_normal((m, E)).astype(np.float32), 4, True)
    want = reference.fused_moe(x, host.w13, host.w2, weights, ids)
    out = cp.full((m, H), np.nan, np.float16).astype(x.dtype)
    got = fused_moe(cp.asarray(x), w13, w2, cp.asarray(weights), cp.asarray(ids), out=out)
    assert got is out
    got = cp.asnumpy(got).astype(np.float32)
    assert not np.isnan(got).any()
    assert rel_l2(got, want.astype(np.float32)) <= REL_L2[dtype]


@st.composite
def layer_cases(draw):
    e = draw(st.sampled_from([1, 2, 3, 8, 60, 128]))
    return dict(e=e, a=draw(st.integers(1, min(e, 8))), m=draw(st.sampled_from([1, 2, 7, 33, 130, 300])),
                h=draw(st.sampled_from([32, 96, 256, 544])), i=draw(st.sampled_from([32, 64, 96, 384])),
                bits=draw(st.sampled_from([4, 8])), group_size=draw(st.sampled_from([32, 64, 128, -1])),
                sym=draw(st.booleans()), act_order=draw(st.booleans()),
                dtype=draw(st.sampled_from(["float16", "bfloat16"])),
                ids_dtype=draw(st.sampled_from(["int32", "int64"])), outside=draw(st.sampled_from([0.0, 0.2, 1.0])),
                out=draw(st.sampled_from([None, "aligned", "unaligned"])), plan=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31)))


@given(layer_cases())
def test_fused_moe_fuzz(case):
    """fused_moe over random shapes (E, A, M, H, I), bits, group sizes, zero points, act-order, dtypes, id dtypes,
    slots with ids outside [0, E) (none, some, all), into a new, an aligned or an unaligned `out`, with and without
    a plan: the reference's values, a slot with an id outside adding nothing (the reference with weight 0 there).

    The scales are powers of two, so that every dequantized weight is exact in fp16 and bf16 (an integer of at most
    8 bits times 2^j): the kernels then differ from the reference only where a float32 sum rounds to the other side
    of a 16-bit value, far inside the bar. With general scales the weights' rounding, carried through the layer's
    four roundings (x1, act, x2, out), can put a layer of a few dozen outputs above the bar of one GEMM (H = 32, one
    token: 1.2e-3 in fp16; the kernels' values, emulated in NumPy, to every digit); the GEMM tests take general
    scales."""
    rng = np.random.default_rng(case["seed"])
    e, a, m, h, i = (case[k] for k in "eamhi")
    quant = case["bits"], case["group_size"], case["sym"], case["act_order"]
    w13, w2 = (replace(w, scales=np.exp2(np.round(np.log2(w.scales.astype(np.float32)))).astype(np.float16))
               for w in (make_weight(rng, e, h, 2 * i, *quant), make_weight(rng, e, i, h, *quant)))
    x = rng.standard_normal((m, h)).astype(_dtype(case["dtype"]))
    weights = rng.uniform(0.1, 1.0, (m, a)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32)
    bad = rng.random((m, a)) < case["outside"]
    ids_gpu = np.where(bad, rng.choice([-1, e, 2**31 - 1], (m, a)), ids).astype(case["ids_dtype"])
    want = reference.fused_moe(x, w13, w2, np.where(bad, 0, weights).astype(np.float32), ids).astype(np.float32)
    dev13, dev2 = w13.to_device(), w2.to_device()
    out = None
    if case["out"] == "aligned":
        out = cp.full((m, h), np.nan, np.float32).astype(x.dtype)
    elif case["out"] == "unaligned":
        out = cp.full(m * h + 1, np.nan, np.float32).astype(x.dtype)[1:].reshape(m, h)
    plan = plan_moe(m, dev13, dev2, a) if case["plan"] else None
    got = fused_moe(cp.asarray(x), dev13, dev2, cp.asarray(weights), cp.asarray(ids_gpu), out=out, plan=plan)
    assert out is None or got is out
    got = cp.asnumpy(got).astype(np.float32)
    assert got.shape == (m, h) and not np.isnan(got).any()
    if not want.any():  # every slot outside: zeros
        assert not got.any()
    else:
        assert rel_l2(got, want) <= REL_L2[case["dtype"]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_moe_into_an_unaligned_out_gives_the_same_bits(tmp_path, dtype):
    """The top-k sum takes 8 columns at a time where `out` is 16-byte aligned and one at a time where it is not:
    the same float32 sums in the same order, so the same bits."""
    m = 37
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    rng = np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal((m, H)).astype(_dtype(dtype)))
    weights, ids = (cp.asarray(v) for v in reference.select_experts(rng.standard_normal((m, E)).astype(np.float32),
                                                                     4, True))
    aligned = fused_moe(x, w13, w2, weights, ids)
    out = cp.zeros(m * H + 1, np.float16).astype(x.dtype)[1:].reshape(m, H)
    assert out.data.ptr % 16 and out.flags.c_contiguous
    assert fused_moe(x, w13, w2, weights, ids, out=out) is out
    assert (cp.asnumpy(out).view(np.uint16) == cp.asnumpy(aligned).view(np.uint16)).all()


@pytest.mark.parametrize("h", [64, 40])  # 64: add_shared's one launch; 40 (dense experts only): the array expressions
@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_on_the_gpu_match_numpy(h, gated):
    """MoELayer adds its shared experts (scaled by the sigmoid gate where it has one) as the NumPy path does."""
    from cupy_moe.checkpoint import MoELayerWeights, SharedExpertWeights
    rng = np.random.default_rng(h + gated)
    e, i, i_s, m = 4, 32, 48, 9
    f = lambda *shape, scale=0.2: (scale * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    host = MoELayerWeights(family="qwen2_moe", layer=0, hidden_size=h, intermediate_size=i, num_experts=e,
                           w13=f(e, h, 2 * i), w2=f(e, i, h), router_weight=f(e, h, scale=1.0), top_k=2,
                           renormalize=False, shared=SharedExpertWeights(f(1, h, 2 * i_s), f(1, i_s, h), i_s),
                           shared_gate_weight=f(1, h, scale=1.0) if gated else None)
    dev = MoELayerWeights(**{**vars(host), "w13": cp.asarray(host.w13), "w2": cp.asarray(host.w2),
                             "router_weight": cp.asarray(host.router_weight),
                             "shared": SharedExpertWeights(cp.asarray(host.shared.gate_up),
                                                           cp.asarray(host.shared.down), i_s),
                             "shared_gate_weight": None if not gated else cp.asarray(host.shared_gate_weight)})
    x = rng.standard_normal((m, h)).astype(np.float16)
    host_layer, dev_layer = cupy_moe.MoELayer(host), cupy_moe.MoELayer(dev)
    want = host_layer(x).astype(np.float32)
    got = cp.asnumpy(dev_layer(cp.asarray(x))).astype(np.float32)
    assert got.shape == (m, h) and not np.isnan(got).any()
    same = (cp.asnumpy(dev_layer.route(cp.asarray(x))[1]) == host_layer.route(x)[1]).all(axis=1)  # float32 routing
    assert same.mean() >= 0.8
    assert rel_l2(got[same], want[same]) <= REL_L2["float16"]


@pytest.mark.parametrize("m", [1, 3])
def test_fused_moe_one_pair_per_block_skips_the_align(tmp_path, monkeypatch, m):
    """M = 1, and a few tokens of small experts (configs.one_pair_blocks): the GEMMs take one pair per block and no
    align runs, with int32 and with int64 ids; bitwise the aligned path of the same configurations, for distinct ids
    and for ids repeated within and across tokens."""
    import dataclasses
    import cupy_moe.layer as layer_mod
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    plan = cupy_moe.plan_moe(m, w13, w2, 4)
    assert plan.one_pair
    x = cp.asarray(np.random.default_rng(3).standard_normal((m, H)).astype(np.float16))
    weights = cp.asarray(np.tile(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32), (m, 1)))
    for ids in ([[6, 1, 3, 0]], [[2, 2, 5, 2]]):
        ids = (np.array(ids * m) + np.arange(m)[:, None] * (len(ids[0]) - 1)) % E  # tokens share some experts
        aligned = fused_moe(x, w13, w2, weights, cp.asarray(ids.astype(np.int32)),
                            plan=dataclasses.replace(plan, one_pair=False))
        for dtype in (np.int32, np.int64):
            calls = []
            monkeypatch.setattr(layer_mod, "moe_align_block_size", lambda *args: calls.append(args))
            direct = fused_moe(x, w13, w2, weights, cp.asarray(ids.astype(dtype)))
            monkeypatch.undo()
            assert calls == []
            cp.testing.assert_array_equal(direct, aligned)


@pytest.mark.parametrize("m,dtype", [(1, np.int32), (1, np.int64), (5, np.int32), (300, np.int64)])
def test_fused_moe_slots_with_ids_outside_the_experts_add_nothing(tmp_path, m, dtype):
    """ids outside [0, E) are not checked on the GPU (a host sync): their slots add nothing, as if their weight were
    zero (the NumPy path, which raises on them, computes that with a valid id and weight 0)."""
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, H)).astype(np.float16)
    weights, ids = reference.select_experts(rng.standard_normal((m, E)).astype(np.float32), 4, True)
    bad = np.zeros_like(ids, bool)
    bad[:, 1] = True
    bad[0, 3] = True
    ids_bad = np.where(bad, np.array([-1, E, 2**31 - 1, -7])[np.arange(m)[:, None] % 4], ids).astype(dtype)
    if dtype == np.int64:
        ids_bad[0, 1] = 2**32 + 1  # would wrap to a valid id as int32
    want = reference.fused_moe(x, host.w13, host.w2, np.where(bad, 0, weights).astype(np.float32), ids)
    got = fused_moe(cp.asarray(x), w13, w2, cp.asarray(weights), cp.asarray(ids_bad))
    assert rel_l2(cp.asnumpy(got).astype(np.float32), want.astype(np.float32)) <= REL_L2["float16"]


@pytest.mark.parametrize("m", [1, 37])
def test_fused_moe_one_slot_writes_the_down_gemm_into_out(tmp_path, m):
    """One slot per token (top_k = 1, as the shared experts run): the down GEMM writes `out` itself after a zero fill,
    so a token whose id is outside [0, E) gets zeros; the values are those of the top-k sum, which still runs where
    a caller's `out` is not 16-byte aligned."""
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    rng = np.random.default_rng(m)
    x = cp.asarray(rng.standard_normal((m, H)).astype(np.float16))
    weights = cp.asarray(rng.uniform(0.5, 1.5, (m, 1)).astype(np.float32))
    ids = rng.integers(0, E, (m, 1))
    ids[::3] = np.array([-1, E])[np.arange(len(ids[::3])) % 2][:, None]  # every third token: an id outside
    ids = cp.asarray(ids.astype(np.int32))
    direct = fused_moe(x, w13, w2, weights, ids, out=cp.full((m, H), np.nan, np.float16))
    unaligned = cp.full(m * H + 1, np.nan, np.float16)[1:].reshape(m, H)
    assert unaligned.data.ptr % 16
    summed = fused_moe(x, w13, w2, weights, ids, out=unaligned)
    direct, summed = cp.asnumpy(direct).astype(np.float32), cp.asnumpy(summed).astype(np.float32)
    assert not np.isnan(direct).any() and (direct[::3] == 0).all() and (m == 1 or (direct[1::3] != 0).any())
    np.testing.assert_array_equal(direct, summed)  # equal values (a -0 of the GEMM is +0 after the sum)


def test_fused_moe_with_a_plan_chooses_nothing_and_caches_no_workspace(monkeypatch):
    """A plan made once: calls with it choose no configuration, use the plan's split-K workspace (the per-stream
    cache stays empty) and give bitwise the result of calls without one."""
    import cupy_moe.gemm as gemm_mod
    from cupy_moe import configs
    h, inter, e, a = 2048, 768, 16, 4  # long K: M = 1 splits K (the plan's workspace is used)
    w13 = cupy_moe.StackedGptqWeight.random(e, h, 2 * inter, seed=1)
    w2 = cupy_moe.StackedGptqWeight.random(e, inter, h, seed=2)
    rng = np.random.default_rng(5)
    split = 0
    for m in (1, 3, 40, 300):
        x = cp.asarray(rng.standard_normal((m, h)).astype(np.float16))
        weights, ids = (cp.asarray(v) for v in reference.select_experts(
            rng.standard_normal((m, e)).astype(np.float32), a, True))
        plain = fused_moe(x, w13, w2, weights, ids)
        plan = cupy_moe.plan_moe(m, w13, w2, a)
        split += plan.workspace.partials.size > 0
        one = configs.one_pair_blocks(m, a, (w13.nbytes + w2.nbytes) / e)
        assert plan.one_pair == one == (m <= 3)
        assert plan.up == configs.choose_config(m, e, a, h, 2 * inter, 4, 128, 16 if one else None, one_pair=one)
        stream = cp.cuda.Stream(non_blocking=True)  # the plan's workspace is ready for any stream
        cp.cuda.get_current_stream().synchronize()  # the inputs and `plain` were made on this one

        def no_choice(*args, **kw):
            raise AssertionError("a configuration was chosen")
        monkeypatch.setattr(configs, "choose_config", no_choice)
        with stream:
            got = fused_moe(x, w13, w2, weights, ids, plan=plan)
            stream.synchronize()
        monkeypatch.undo()
        assert (cp.cuda.Device().id, stream.ptr) not in gemm_mod._WORKSPACES
        cp.testing.assert_array_equal(got, plain)
    assert split  # at least one problem ran split-K on the plan's workspace


def test_fused_moe_chooses_once_per_phase_and_passes_the_choice_down(tmp_path, monkeypatch):
    """fused_moe makes one configuration per GEMM phase and launches exactly those (fused_moe_gemm chooses
    nothing), for the aligned path and the one-pair path of M = 1."""
    import cupy_moe.layer as layer_mod
    from cupy_moe import configs
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    rng = np.random.default_rng(11)
    for m in (1, 40, 300):
        x = cp.asarray(rng.standard_normal((m, H)).astype(np.float16))
        weights, ids = reference.select_experts(rng.standard_normal((m, E)).astype(np.float32), 4, True)
        choices, launched = [], []
        choose, gemm = configs.choose_config, layer_mod.fused_moe_gemm
        monkeypatch.setattr(configs, "choose_config", lambda *args, **kw: choices.append(choose(*args, **kw))
                            or choices[-1])
        monkeypatch.setattr(layer_mod, "fused_moe_gemm", lambda *args, **kw: launched.append(kw["config"])
                            or gemm(*args, **kw))
        fused_moe(x, w13, w2, cp.asarray(weights), cp.asarray(ids))
        monkeypatch.undo()
        assert len(choices) == 2 and launched == choices
        if m == 1:
            assert [c.block_m for c in choices] == [16, 16]


def test_fused_moe_aligns_again_when_the_phases_pick_different_blocks(tmp_path, monkeypatch):
    """A down phase that picks another block size gets an align of its own, and the result matches the reference."""
    import cupy_moe.layer as layer_mod
    from cupy_moe import configs
    write_checkpoint(tmp_path, family="qwen3_moe", hidden=H, intermediate=I, num_experts=E, top_k=4,
                     group_size=64, return_weights=False)
    host = cupy_moe.load_moe_layer(tmp_path, 0, device=False).weights
    w13, w2 = host.w13.to_device(), host.w2.to_device()
    rng = np.random.default_rng(7)
    m = 40  # 20 rows per expert: 16-row blocks for both phases by the heuristic
    x = rng.standard_normal((m, H)).astype(np.float16)
    weights, ids = reference.select_experts(rng.standard_normal((m, E)).astype(np.float32), 4, True)
    args = (cp.asarray(x), w13, w2, cp.asarray(weights), cp.asarray(ids))
    want = reference.fused_moe(x, host.w13, host.w2, weights, ids).astype(np.float32)
    choose, aligns = configs.choose_config, []
    for down_block in (64, 128):
        # the down phase (a = 1) is told to take down_block rows; the gate/up phase keeps its 16
        monkeypatch.setattr(configs, "choose_config", lambda m_, e_, a_, *rest, **kw: choose(
            m_, e_, a_, *rest, **(kw if a_ != 1 else dict(kw, block_m=down_block))))
        align = layer_mod.moe_align_block_size
        monkeypatch.setattr(layer_mod, "moe_align_block_size", lambda t, b, e: aligns.append(b) or align(t, b, e))
        got = fused_moe(*args)
        monkeypatch.undo()
        assert aligns[-2:] == [16, down_block]
        assert rel_l2(cp.asnumpy(got).astype(np.float32), want) <= REL_L2["float16"]


@pytest.mark.parametrize("logits_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("e,a", [(8, 2), (60, 4), (256, 8), (1024, 32), (5, 5)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_gpu(e, a, renormalize, logits_dtype):
    rng = np.random.default_rng(e * 100 + a)
    dt = np.float32 if logits_dtype == "float32" else _dtype(logits_dtype)
    logits = (rng.standard_normal((97, e)) * 3).astype(dt)
    want_w, want_ids = reference.select_experts(logits, a, renormalize)
    got_w, got_ids = select_experts(cp.asarray(logits), a, renormalize)
    assert got_w.dtype == np.float32 and got_ids.dtype == np.int32
    np.testing.assert_array_equal(cp.asnumpy(got_ids), want_ids)
    np.testing.assert_allclose(cp.asnumpy(got_w), want_w, rtol=2e-6, atol=1e-7)


ROUTINGS = [  # (E, A, scoring, bias, topk_method, n_group, topk_group, renormalize, routed_scaling_factor)
    (256, 8, "sigmoid", True, "noaux_tc", 8, 4, True, 2.5),
    (160, 6, "softmax", False, "group_limited_greedy", 8, 3, False, 16.0),
    (64, 6, "softmax", False, "greedy", 1, 1, False, 1.0),
    (64, 4, "sigmoid", True, "greedy", None, None, True, 1.0),
    (1024, 32, "sigmoid", True, "noaux_tc", 32, 8, True, 1.0),
    (7, 3, "softmax", True, None, None, None, False, 1.0),
]


@pytest.mark.parametrize("e,a,scoring,bias,method,n_group,topk_group,renormalize,scale", ROUTINGS)
def test_route_experts_gpu_matches_numpy(e, a, scoring, bias, method, n_group, topk_group, renormalize, scale):
    """One launch gives the experts of the NumPy definition, and their weights to float32 rounding."""
    from cupy_moe.layer import route_experts
    rng = np.random.default_rng(e * 10 + a)
    logits = (rng.standard_normal((97, e)) * 2).astype(np.float32)
    b = (rng.standard_normal(e) * 0.1).astype(np.float32) if bias else None
    kw = dict(scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
              renormalize=renormalize, routed_scaling_factor=scale)
    want_w, want_ids = route_experts(logits, a, e_score_correction_bias=b, **kw)
    got_w, got_ids = route_experts(cp.asarray(logits), a, e_score_correction_bias=None if b is None else cp.asarray(b),
                                   **kw)
    assert got_w.dtype == np.float32 and got_ids.dtype == np.int32 and got_ids.shape == (97, a)
    np.testing.assert_array_equal(cp.asnumpy(got_ids), want_ids)
    np.testing.assert_allclose(cp.asnumpy(got_w), want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("x_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("w_dtype", ["float16", "float32"])
@pytest.mark.parametrize("m,e,h", [(1, 256, 7168), (3, 60, 2048), (16, 8, 4096), (37, 160, 1000), (200, 7, 130)])
@pytest.mark.parametrize("large", [False, True])
def test_router_logits_gpu(m, e, h, x_dtype, w_dtype, large, monkeypatch):
    """Float32 sums of x @ w.T to within float32 rounding; a token's logits are the same bits in a batch of one, in
    a larger batch (large: with the tile for activations larger than L2), and with rows not aligned for vector
    loads."""
    from cupy_moe import layer
    from cupy_moe.layer import _linear_f32
    if large:
        monkeypatch.setattr(layer, "_ROUTER_L2_BYTES", 0)
    rng = np.random.default_rng(m * e + h)
    x = rng.standard_normal((m, h)).astype(_dtype(x_dtype))
    w = (rng.standard_normal((e, h)) * h ** -0.5).astype(w_dtype)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-6 * np.sqrt(h) * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
    got = _linear_f32(cp.asarray(x), cp.asarray(w))
    assert got.dtype == np.float32 and got.shape == (m, e)
    got = cp.asnumpy(got)
    assert (np.abs(got - exact) <= bound).all(), np.abs(got - exact).max()
    one = cp.asnumpy(_linear_f32(cp.asarray(x[-1:]), cp.asarray(w)))
    np.testing.assert_array_equal(one, got[-1:])
    flat = np.zeros(m * h + 1, x.dtype)  # one element in: rows 2 bytes off their alignment, scalar loads
    flat[1:] = x.ravel()
    shifted = cp.asarray(flat)[1:].reshape(m, h)
    assert shifted.data.ptr % 8 == 2
    np.testing.assert_array_equal(cp.asnumpy(_linear_f32(shifted, cp.asarray(w))), got)


def test_route_experts_gpu_ties_and_nan_rows():
    """Equal scores go to the lower group and expert; a row of NaN logits still gives expert ids in range."""
    from cupy_moe.layer import route_experts
    logits = cp.zeros((3, 16), cp.float32)
    logits[2] = cp.nan
    _, ids = route_experts(logits, 4, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2)
    ids = cp.asnumpy(ids)
    np.testing.assert_array_equal(ids[:2], np.tile(np.arange(4), (2, 1)))
    assert ((ids[2] >= 0) & (ids[2] < 16)).all()


def test_select_experts_gpu_ties_go_to_the_lower_expert():
    logits = cp.zeros((3, 16), cp.float32)
    _, ids = select_experts(logits, 4, False)
    np.testing.assert_array_equal(cp.asnumpy(ids), np.tile(np.arange(4), (3, 1)))


def test_select_experts_gpu_nan_rows_stay_in_range():
    logits = cp.asarray(np.random.default_rng(0).standard_normal((4, 40)).astype(np.float32))
    logits[1, 7] = cp.nan  # one NaN logit makes the whole softmax row NaN
    _, ids = select_experts(logits, 5, True)
    ids = cp.asnumpy(ids)
    assert ((ids >= 0) & (ids < 40)).all()
    np.testing.assert_array_equal(ids[[0, 2, 3]], reference.select_experts(cp.asnumpy(logits), 5, True)[1][[0, 2, 3]])


def test_select_experts_gpu_rejects():
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, min\(E, 32\)\] = \[1, 8\], got 9"):
        select_experts(cp.zeros((2, 8), cp.float32), 9)
    with pytest.raises(ValueError, match=r"router_logits: expected 1 <= E <= 1024 experts, got E=2048"):
        select_experts(cp.zeros((2, 2048), cp.float32), 2)
    with pytest.raises(TypeError, match=r"router_logits: expected dtype float16 or bfloat16 or float32, got int32"):
        select_experts(cp.zeros((2, 8), cp.int32), 2)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_graph_replay_is_bitwise_the_eager_result(tmp_path, family):
    write_checkpoint(tmp_path, family=family, hidden=H, intermediate=I, num_experts=E, top_k=2, group_size=128,
                     return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0)
    x = cp.asarray(np.random.default_rng(0).standard_normal((12, H)).astype(np.float16))
    captured = layer.capture(x)
    # the graph holds its stream's split-K workspace and side stream: no later call can grow (free) or use them
    # under the graph
    key = (cp.cuda.Device().id, captured.stream.ptr)
    assert key not in cupy_moe.gemm._WORKSPACES and key not in cupy_moe.layer._SIDE_STREAMS
    for seed in (1, 2):
        x[...] = cp.asarray(np.random.default_rng(seed).standard_normal((12, H)).astype(np.float16))
        cp.cuda.Device().synchronize()  # the graph's stream does not wait for the default stream
        captured.replay()
        captured.stream.synchronize()
        cp.testing.assert_array_equal(captured.out, layer(x))


def test_dlpack_inputs_are_used_without_a_copy(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    write_checkpoint(tmp_path, family="mixtral", hidden=H, intermediate=I, num_experts=E, return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0)
    xt = torch.randn(6, H, device="cuda", dtype=torch.float16)
    x = cp.from_dlpack(xt)
    assert x.data.ptr == xt.data_ptr()  # the same device memory: no copy
    y = torch.from_dlpack(layer(x))
    torch.testing.assert_close(y, torch.from_dlpack(layer(cp.asarray(xt.cpu().numpy()))), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: shared experts on the side stream
@pytest.mark.parametrize("m", [1, 40])
def test_programmatic_dependent_launch_changes_nothing(tmp_path, monkeypatch, m, family):
    """With programmatic dependent launch (compute capability 9.0+, kernels/pdl.cuh) a kernel may start before the
    previous one ends and must wait before touching memory: eight layers in a row, each reading the previous output,
    eager and replayed from a CUDA graph, give bitwise what plain launches give."""
    write_checkpoint(tmp_path, family=family, hidden=H, intermediate=I, num_experts=E, top_k=2, group_size=128,
                     return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0)
    x0 = cp.asarray(np.random.default_rng(m).standard_normal((m, H)).astype(np.float16))

    def chain():
        y = x0
        for _ in range(8):
            y = layer(y)
        return y

    monkeypatch.setenv("CUPY_MOE_PDL", "0")
    plain = chain()
    assert bool(cp.isfinite(plain).all())
    monkeypatch.setenv("CUPY_MOE_PDL", "1")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        eager = chain()
        stream.synchronize()
        stream.begin_capture()
        captured = chain()
        graph = stream.end_capture()
        for _ in range(3):
            captured.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            cp.testing.assert_array_equal(captured.view(cp.uint16), plain.view(cp.uint16))
    cp.testing.assert_array_equal(eager.view(cp.uint16), plain.view(cp.uint16))


def test_shared_experts_side_stream_on_two_streams(tmp_path):
    """MoELayer runs the shared experts on a side stream of the caller's stream: calls alternating between two
    streams, nothing synchronized until the end, give the bits of the same calls on the default stream."""
    write_checkpoint(tmp_path, family="qwen2_moe", hidden=H, intermediate=I, num_experts=E, top_k=2, group_size=128,
                     return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0)
    xs = [cp.asarray(np.random.default_rng(m).standard_normal((m, H)).astype(np.float16)) for m in (1, 33, 1, 300)]
    want = [cp.asnumpy(layer(x)) for x in xs]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    got = []
    for _ in range(4):
        for k, x in enumerate(xs):
            with streams[k % 2]:
                got.append(layer(x))
    cp.cuda.Device().synchronize()
    for k, y in enumerate(got):
        np.testing.assert_array_equal(cp.asnumpy(y).view(np.uint16), want[k % len(xs)].view(np.uint16))
