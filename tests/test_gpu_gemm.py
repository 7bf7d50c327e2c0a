"""GPU fused_moe_gemm against the float64 reference: random GPTQ tensors, routings, dtypes; determinism; graphs."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupy_moe import configs, reference
from cupy_moe.align import moe_align_block_size
from cupy_moe.gemm import SplitKWorkspace, fused_moe_gemm
from cupy_moe.weights import StackedGptqWeight

from random_weights import make_weight
from tolerances import REL_L2

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.float16


def route(rng, m, e, a, kind):
    if kind == "one":
        return np.full((m, a), rng.integers(e)).astype(np.int32)
    if kind == "few":
        return rng.integers(0, min(e, 2), size=(m, a)).astype(np.int32)
    if m == 0:
        return np.zeros((0, a), np.int32)
    return np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32)


def run_case(rng, *, e, m, a, k, n, bits, group_size, sym, act_order, dtype_name, routed, kind, block_m=None,
             shape=None):
    """shape: run this GemmConfig (its split from the split estimate, as configs.split_k_estimate gives it) instead
    of the chosen one; `shape(split)` when callable."""
    dt = _dtype(dtype_name)
    w = make_weight(rng, e, k, n, bits, group_size, sym, act_order)
    a_host = rng.standard_normal((m, k)).astype(np.float32).astype(dt)
    ids = route(rng, m, e, a, kind)
    tw = rng.uniform(0.1, 1.0, size=(m, a)).astype(np.float32) if routed else None
    cfg = configs.choose_config(m, e, a, k, n, bits, group_size, block_m=block_m, act_order=act_order)
    if shape is not None:
        base = shape if isinstance(shape, configs.GemmConfig) else configs.DECODE
        split = configs.split_k_estimate(base, m, e, a, k, n, gpu=configs.gpu_info(), act_order=act_order)
        cfg = replace(shape, split_k=split) if isinstance(shape, configs.GemmConfig) else shape(split)
    s, eids, post = moe_align_block_size(cp.asarray(ids), cfg.block_m, e)
    out = cp.asarray(np.full((m * a, n), np.nan, dtype=dt))  # poison: every row must be written
    got = fused_moe_gemm(cp.asarray(a_host), w.to_device(), s, eids, post, a,
                         None if tw is None else cp.asarray(tw), out=out, config=cfg)
    assert got is out
    got = cp.asnumpy(got).astype(np.float64)
    hs, he, hp = (cp.asnumpy(x) for x in (s, eids, post))
    ref = reference.fused_moe_gemm(a_host.astype(np.float32), w, hs, he, hp, a, tw).astype(np.float64)
    assert not np.isnan(got).any(), "unwritten or NaN output rows"
    if ref.size:
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err <= REL_L2[dtype_name], f"relative L2 error {err:.3g} > {REL_L2[dtype_name]}"
    return got


@st.composite
def cases(draw):
    e = draw(st.sampled_from([1, 2, 3, 8, 60, 128, 257]))
    a = draw(st.integers(1, min(e, 8)))
    m = draw(st.sampled_from([0, 1, 3, 17, 64, 131, 300]))
    bits = draw(st.sampled_from([4, 8]))
    k = draw(st.sampled_from([32, 64, 96, 256, 768, 1408] if e <= 8 else [32, 64, 160, 256]))
    n = draw(st.sampled_from([32, 64, 96, 256, 288] if e <= 8 else [32, 64, 96]))
    group_size = draw(st.sampled_from([32, 64, 128, -1]))
    return dict(e=e, m=m, a=a, k=k, n=n, bits=bits, group_size=group_size, sym=draw(st.booleans()),
                act_order=draw(st.booleans()), dtype_name=draw(st.sampled_from(["float16", "bfloat16"])),
                routed=draw(st.booleans()), kind=draw(st.sampled_from(["uniform", "one", "few"])),
                block_m=draw(st.sampled_from([None, 16, 32, 48, 64, 128])), seed=draw(st.integers(0, 2**31)))


@given(cases())
def test_gemm_matches_reference(case):
    seed = case.pop("seed")
    run_case(np.random.default_rng(seed), **case)


@pytest.mark.parametrize("k,n", [(768, 1536), (1408, 2816), (2048, 1408 * 2), (4096, 256)])
@pytest.mark.parametrize("m", [1, 33, 512])
def test_gemm_model_shapes(k, n, m):
    for bits in (4, 8):
        run_case(np.random.default_rng(k + n + m), e=8, m=m, a=2, k=k, n=n, bits=bits, group_size=128, sym=True,
                 act_order=False, dtype_name="float16", routed=True, kind="uniform")


@pytest.mark.parametrize("hopper", ["1", "0"])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("bits,sym,act_order,dtype_name", [
    (4, False, False, "float16"), (4, True, False, "bfloat16"), (8, False, False, "float16"),
    (8, True, False, "bfloat16"), (4, False, True, "float16")])
def test_gemm_prefill_kernels(block_m, bits, sym, act_order, dtype_name, hopper, monkeypatch):
    """The shared-memory (tc) kernel, both its wgmma (sm_90a) and mma.sync variants, and its act-order fallback:
    partial tiles in M and N, groups of 32 and 128, several experts, split-K (few CTAs, long K) and not, and an odd
    number of 32-k chunks (K = 1120: the 128-row tile's last 64-k stage is half zero-filled)."""
    monkeypatch.setenv("CUPY_MOE_HOPPER", hopper)  # "0": the mma.sync variant (the only one off Hopper)
    rng = np.random.default_rng(block_m + bits + 2 * sym + 4 * act_order)
    for e, m, a, k, n, gs in ((3, 200, 2, 1024, 160, 128), (8, 300, 2, 256, 288, 32), (2, 70, 1, 2048, 96, -1),
                              (3, 140, 2, 1120, 96, 32)):
        run_case(rng, e=e, m=m, a=a, k=k, n=n, bits=bits, group_size=gs, sym=sym, act_order=act_order,
                 dtype_name=dtype_name, routed=True, kind="uniform", block_m=block_m)


@pytest.mark.parametrize("bits,sym,act_order,dtype_name,gs", [
    (4, False, False, "float16", 128), (4, True, False, "bfloat16", 32), (8, False, False, "float16", 128),
    (8, True, True, "bfloat16", 64), (4, False, True, "float16", -1)])
def test_gemm_decode_ring_variants(bits, sym, act_order, dtype_name, gs):
    """The decode kernel's cp.async weight ring at 2 to 8 stages of 1 to 4 K chunks (8-bit: half the depth): long
    K (the ring wraps), split-K, a partial last stage and column tile, one or several experts; blocks of at most 8
    rows (the swapped-operand path) and one of 12 rows (the plain path)."""
    rng = np.random.default_rng(bits + 2 * sym + 4 * act_order)
    for stages, ku in ((2, 4), (5, 4), (8, 2), (4, 1)):
        cfg = replace(configs.DECODE, stages=stages, ku=ku)  # at the estimate's split (no warps along K: next test)
        for e, m, a, k, n in ((4, 3, 2, 2048, 160), (1, 1, 1, 1408, 288), (8, 9, 2, 768, 96), (1, 12, 1, 1408, 288)):
            run_case(rng, e=e, m=m, a=a, k=k, n=n, bits=bits, group_size=gs, sym=sym, act_order=act_order,
                     dtype_name=dtype_name, routed=True, kind="uniform", block_m=16, shape=cfg)


@pytest.mark.parametrize("bits,sym,act_order,dtype_name,gs", [
    (4, False, False, "float16", 128), (4, True, False, "bfloat16", 32), (8, False, False, "float16", 128),
    (8, True, True, "bfloat16", 64), (4, False, True, "float16", -1)])
def test_gemm_decode_warps_along_k(bits, sym, act_order, dtype_name, gs):
    """The 16-row decode shape with 4 warps along K (configs.SPLIT_WARPS_SHAPES), forced for every split: slices
    summed in shared memory alone (one CTA per column strip) and with split-K across CTAs on top (few experts, long
    K); a last CTA whose last warps have no chunks (K = 768, 1120); two ring shapes; bitwise the same on a rerun."""
    rng = np.random.default_rng(16 + bits + 2 * sym + 4 * act_order)
    for stages, ku in ((2, 4), (3, 2)):
        wk = replace(configs.DECODE_WK, stages=stages, ku=ku)
        # every 16-row split of DECODE becomes round(split / 4) CTAs of 4 warp slices (the heuristic keeps one CTA)
        shape = lambda split, wk=wk: replace(wk, split_k=max(1, round(split / wk.warps_k)))
        for e, m, a, k, n in ((4, 3, 2, 2048, 160), (1, 1, 1, 4096, 96), (8, 9, 2, 768, 96), (2, 5, 1, 1120, 288)):
            case = dict(e=e, m=m, a=a, k=k, n=n, bits=bits, group_size=gs, sym=sym, act_order=act_order,
                        dtype_name=dtype_name, routed=True, kind="uniform", block_m=16, shape=shape)
            seed = int(rng.integers(2**31))
            first = run_case(np.random.default_rng(seed), **case)
            assert np.array_equal(first, run_case(np.random.default_rng(seed), **case), equal_nan=True)


@pytest.mark.parametrize("block_m", [32, 48])
@pytest.mark.parametrize("hopper", ["1", "0"])
@pytest.mark.parametrize("bits,sym,act_order,dtype_name,gs", [
    (4, False, False, "float16", 128), (4, True, False, "bfloat16", 32), (8, False, False, "float16", 128),
    (4, False, True, "float16", 64)])
def test_gemm_block_32_48(block_m, bits, sym, act_order, dtype_name, gs, hopper, monkeypatch):
    """32- and 48-row blocks: on sm_90a the swapped-operand kernel (SWAPPED_32, SWAPPED_48), elsewhere (and with
    CUPY_MOE_HOPPER=0) the portable decode shapes with two or three m16 tiles per CTA: experts with 17-48 rows, and
    more than one block (m = 100, top-2 of 4), partial blocks, split-K, a partial last column tile."""
    monkeypatch.setenv("CUPY_MOE_HOPPER", hopper)
    rng = np.random.default_rng(block_m + bits + 2 * sym + 4 * act_order)
    for e, m, a, k, n in ((4, 40, 2, 2048, 160), (8, 64, 2, 1408, 288), (2, 9, 1, 768, 96), (4, 100, 2, 1120, 256)):
        run_case(rng, e=e, m=m, a=a, k=k, n=n, bits=bits, group_size=gs, sym=sym, act_order=act_order,
                 dtype_name=dtype_name, routed=True, kind="uniform", block_m=block_m)


@pytest.mark.parametrize("block_m,ng,stages,ku,bits,sym,act_order,dtype_name,gs", [
    (16, 1, 6, 2, 4, False, False, "float16", 128), (32, 2, 6, 1, 4, True, False, "bfloat16", 32),
    (32, 1, 4, 1, 8, False, False, "float16", 64), (64, 2, 4, 2, 8, True, False, "bfloat16", -1),
    (64, 1, 6, 1, 4, False, False, "bfloat16", 64), (128, 2, 4, 2, 4, False, False, "float16", 32),
    (64, 2, 4, 2, 4, False, True, "float16", 128), (48, 2, 6, 2, 4, False, False, "float16", 128),
    (48, 2, 6, 2, 8, True, False, "bfloat16", 32), (48, 1, 4, 1, 4, True, False, "float16", 64)])
def test_gemm_swapped_wgmma(block_m, ng, stages, ku, bits, sym, act_order, dtype_name, gs):
    """The sm_90a kernel with the weights as the wgmma M side (kind "swapped"; 32- and 48-row blocks use it by
    default, the other shapes are for tuning): 16-128 rows per block, 128 or 256 columns, partial column tiles,
    split-K and not, an odd number of 32-k chunks (K = 1120 with 64-k stages), and act-order (which runs the portable
    shape instead)."""
    if not configs.gpu_info().hopper:
        pytest.skip("the swapped-operand kernel needs sm_90a")
    cfg = configs.GemmConfig(mt=block_m // 16, warps_m=1, warps_n=8, ng=ng, ku=ku, stages=stages, kind="swapped")
    rng = np.random.default_rng(block_m + bits + 2 * sym + 4 * ng)
    for e, m, a, k, n in ((4, 40, 2, 2048, 160), (8, 300, 2, 1408, 288), (2, 9, 1, 768, 96), (3, 140, 2, 1120, 256)):
        run_case(rng, e=e, m=m, a=a, k=k, n=n, bits=bits, group_size=gs, sym=sym, act_order=act_order,
                 dtype_name=dtype_name, routed=True, kind="uniform", block_m=block_m,
                 shape=None if act_order else cfg)


@pytest.mark.parametrize("shape,split", [(configs.PREFILL_128, 1), (configs.PREFILL_128, 2), (configs.PREFILL, 1),
                                         (configs.SWAPPED_48, 1), (configs.SWAPPED_32, 3)])
def test_gemm_tile_order(shape, split, monkeypatch):
    """The tile order of the tc and swapped kernels (bands of column tiles) changes which CTA takes which tile, never
    a result: bands of 2 (the last one narrower), of 16 (all 5 column tiles in one band) and of 1 give the same bits,
    split-K included."""
    if shape.kind == "swapped" and not configs.gpu_info().hopper:
        pytest.skip("the swapped-operand kernel needs sm_90a")
    rng = np.random.default_rng(9)
    e, m, a, k, n = 5, 300, 2, 1024, 1280
    w = make_weight(rng, e, k, n, 4, 128, False, False).to_device()
    x = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
    ids = cp.asarray(route(rng, m, e, a, "uniform"))
    tw = cp.asarray(rng.uniform(0.1, 1.0, size=(m, a)).astype(np.float32))
    cfg = configs.fallback(replace(shape, split_k=split), act_order=False, hopper=configs.gpu_info().hopper)
    lists = moe_align_block_size(ids, cfg.block_m, e)
    outs = []
    for band in (1, 2, 16):
        monkeypatch.setattr(configs, "COLUMN_BAND", band)
        outs.append(fused_moe_gemm(x, w, *lists, a, tw, config=cfg).view(cp.uint16))
    assert all(cp.array_equal(outs[0], o) for o in outs[1:])


def test_gemm_deterministic_prefill():
    rng = np.random.default_rng(5)
    e, m, a, k, n = 2, 130, 1, 4096, 128  # tc kernel, few CTAs: split-K active
    w = make_weight(rng, e, k, n, 4, 128, False, False).to_device()
    x = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
    ids = cp.asarray(route(rng, m, e, a, "uniform"))
    cfg = configs.choose_config(m, e, a, k, n, 4, 128, block_m=128)  # (the rules would take 16-row blocks)
    assert cfg.kind == "tc" and cfg.split_k > 1
    s, eids, post = moe_align_block_size(ids, cfg.block_m, e)
    first = fused_moe_gemm(x, w, s, eids, post, a, config=cfg)
    for _ in range(10):
        again = fused_moe_gemm(x, w, s, eids, post, a, config=cfg)
        assert cp.array_equal(first.view(cp.uint16), again.view(cp.uint16))


def test_gemm_deterministic():
    """Split-K results are bitwise the same on every call, with the cached workspace or a SplitKWorkspace sized by
    SplitKWorkspace.size; a smaller workspace and a plan of another block size are refused before the launch."""
    rng = np.random.default_rng(1)
    e, m, a, k, n = 4, 9, 2, 2048, 256  # few experts, long K: split-K active
    w = make_weight(rng, e, k, n, 4, 128, False, False).to_device()
    x = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
    ids = cp.asarray(route(rng, m, e, a, "uniform"))
    cfg = configs.choose_config(m, e, a, k, n, 4, 128)
    assert cfg.split_k > 1
    s, eids, post = moe_align_block_size(ids, cfg.block_m, e)
    first = fused_moe_gemm(x, w, s, eids, post, a)
    ws = SplitKWorkspace.for_launches([SplitKWorkspace.size(cfg, k, n, m * a, e)])
    for i in range(20):
        again = fused_moe_gemm(x, w, s, eids, post, a, config=cfg, workspace=ws if i % 2 else None)
        assert cp.array_equal(first.view(cp.uint16), again.view(cp.uint16))
    with pytest.raises(ValueError, match=r"workspace: expected at least \d+ partials"):
        fused_moe_gemm(x, w, s, eids, post, a, config=cfg, workspace=SplitKWorkspace(16, 16))
    other = configs.choose_config(m, e, a, k, n, 4, 128, 64)
    with pytest.raises(ValueError, match=f"config: expected block_m = {cfg.block_m}"):
        fused_moe_gemm(x, w, s, eids, post, a, config=other)


@pytest.mark.parametrize("block_m,bits,act_order,dtype_name,one_pair", [
    (16, 4, False, "float16", False), (16, 4, False, "float16", True), (16, 8, False, "bfloat16", False),
    (16, 4, True, "float16", False), (16, 4, False, "bfloat16", True), (128, 4, False, "float16", False),
    (128, 8, False, "bfloat16", False), (64, 4, False, "bfloat16", False), (64, 8, False, "float16", False)])
def test_gemm_split_in_cluster(block_m, bits, act_order, dtype_name, one_pair, monkeypatch):
    """2 split-K slices add their partial tiles inside a thread-block cluster where the GPU has clusters
    (split_k.cuh; 16-row blocks, and the tc tiles on sm_90a), with no workspace: bitwise the same as through one
    (the cluster turned off), and the reference's product, in pair order too, with padding rows, one pair per block
    and a partial last column tile (N = 160)."""
    from cupy_moe import gemm
    rng = np.random.default_rng(bits + 2 * act_order)
    dt = _dtype(dtype_name)
    # 160 columns: the last column tile is partial; 130 tokens put 64-127 rows on most experts of a tc tile
    e, m, a, k, n = 5, 1 if one_pair else 6 if block_m == 16 else 130, 3, 2048, 160
    w_host = make_weight(rng, e, k, n, bits, 128, False, act_order)
    w = w_host.to_device()
    x = rng.standard_normal((m, k)).astype(np.float32).astype(dt)
    ids = route(rng, m, e, a, "uniform")
    lists = (None, cp.asarray(ids), None) if one_pair else moe_align_block_size(cp.asarray(ids), block_m, e)
    hopper = configs.gpu_info().hopper
    cfg = configs.fallback(replace(configs.KERNEL_SHAPES[block_m], split_k=2), act_order=act_order, hopper=hopper)
    size = SplitKWorkspace.size(cfg, k, n, m * a, e, one_pair=one_pair)
    if int(cp.cuda.Device().compute_capability) >= 90 and (block_m == 16 or hopper):
        assert gemm._cluster_size(cfg, 2) == 2
        assert size == (0, 0)  # the cluster never touches a workspace, so the launch asks for none
    ws = SplitKWorkspace.for_launches([size])
    tw = cp.asarray(rng.uniform(0.1, 1.0, size=(m, a)).astype(np.float32))
    pairs = (False, True) if bits == 4 and not act_order else (False,)
    for pair in pairs:
        xd = cp.asarray(reference.to_pair_order(x) if pair else x)
        got = fused_moe_gemm(xd, w, *lists, a, tw, config=cfg, a_pair_order=pair, workspace=ws)
        with monkeypatch.context() as mp:
            mp.setattr(gemm, "_cluster_size", lambda config, split: 1)
            want = fused_moe_gemm(xd, w, *lists, a, tw, config=cfg, a_pair_order=pair)
        assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))
        host_lists = [None if v is None else cp.asnumpy(v) for v in lists]
        ref = reference.fused_moe_gemm(x.astype(np.float32), w_host, *host_lists, a, cp.asnumpy(tw))
        got = cp.asnumpy(got).astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= REL_L2[dtype_name]


def test_graph_capture_align_and_gemm():
    rng = np.random.default_rng(2)
    e, m, a, k, n = 16, 5, 4, 512, 128
    w = make_weight(rng, e, k, n, 4, 64, True, False).to_device()
    x = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
    ids = cp.asarray(route(rng, m, e, a, "uniform"))
    block = configs.choose_config(m, e, a, k, n, 4, 64).block_m
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        def step():
            s, eids, post = moe_align_block_size(ids, block, e)
            return fused_moe_gemm(x, w, s, eids, post, a)
        eager = step()
        del_me = step()  # a second eager call leaves pool blocks of every size the capture will ask for
        del del_me
        stream.synchronize()
        stream.begin_capture()
        captured = step()
        graph = stream.end_capture()
        captured.fill(np.nan)
        graph.launch(stream)
        graph.launch(stream)
        stream.synchronize()
    assert cp.array_equal(eager.view(cp.uint16), captured.view(cp.uint16))


@pytest.mark.parametrize("bits,sym,act_order,dtype_name,gs", [
    (4, False, False, "float16", 128), (4, True, True, "bfloat16", 64), (8, False, False, "float16", -1)])
def test_gemm_one_pair_per_block(bits, sym, act_order, dtype_name, gs):
    """sorted_token_ids and num_tokens_post_padded None (M = 1 without the align): bitwise the aligned call of the
    same configuration (the one choose_config(one_pair=True) gives, which the call picks, and the warps-along-K
    shape of one pair per block), for the gate/up form (one row, top_k A) and the down form (a row per pair,
    routing weights), with repeated ids. An id outside [0, E) leaves its row untouched, in this layout and in an
    aligned list."""
    rng = np.random.default_rng(9)
    e, k, n, a = 16, 1024, 256, 4
    dt = _dtype(dtype_name)
    w_host = make_weight(rng, e, k, n, bits, gs, sym, act_order)
    w = w_host.to_device()
    for ids_list in ([[3, 9, 0, 15]], [[5, 5, 2, 5]]):
        ids = cp.asarray(np.array(ids_list, np.int32))
        aligned = moe_align_block_size(ids, 16, e)
        tw = cp.asarray(rng.uniform(0.1, 1.0, size=(1, a)).astype(np.float32))
        for rows, top_k, weights in ((1, a, None), (a, 1, tw)):
            x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float32).astype(dt))
            chosen = configs.choose_config(rows, e, top_k, k, n, bits, gs, 16, act_order=act_order, one_pair=True)
            ref = reference.fused_moe_gemm(cp.asnumpy(x).astype(np.float32), w_host, None, cp.asnumpy(ids), None,
                                           top_k, None if weights is None else cp.asnumpy(weights))
            for cfg in (chosen, replace(configs.DECODE_WK_ONE_PAIR, split_k=1)):
                want = fused_moe_gemm(x, w, *aligned, top_k, weights, config=cfg)
                got = fused_moe_gemm(x, w, None, ids, None, top_k, weights, config=cfg)
                assert cp.array_equal(want.view(cp.uint16), got.view(cp.uint16))
                err = np.linalg.norm(cp.asnumpy(got).astype(np.float64) - ref) / np.linalg.norm(ref)
                assert err <= REL_L2[dtype_name]
            picked = fused_moe_gemm(x, w, None, ids, None, top_k, weights)
            assert cp.array_equal(picked.view(cp.uint16), fused_moe_gemm(x, w, None, ids, None, top_k, weights,
                                                                         config=chosen).view(cp.uint16))
    x = cp.asarray(rng.standard_normal((1, k)).astype(np.float32).astype(dt))
    ids = cp.asarray(np.array([[2, -1, e, 7]], np.int32))
    cfg = configs.choose_config(1, e, a, k, n, bits, gs, 16, act_order=act_order, one_pair=True)
    good = fused_moe_gemm(x, w, None, cp.asarray(np.array([[2, 2, 7, 7]], np.int32)), None, a, config=cfg)
    out = cp.asarray(np.full((a, n), np.nan, dtype=dt))
    fused_moe_gemm(x, w, None, ids, None, a, out=out, config=cfg)
    s, eids, post = moe_align_block_size(cp.asarray(np.array([[2, 3, 4, 7]], np.int32)), 16, e)
    eids[1:3] = cp.asarray(np.array([e, 1 << 30], np.int32))  # experts 3 and 4 -> ids past E
    out2 = cp.asarray(np.full((a, n), np.nan, dtype=dt))
    fused_moe_gemm(x, w, s, eids, post, a, out=out2, config=cfg)
    for o in (out, out2):
        o = cp.asnumpy(o).astype(np.float32)
        assert np.isnan(o[1:3]).all()
        np.testing.assert_array_equal(o[[0, 3]], cp.asnumpy(good[[0, 3]]).astype(np.float32))
    with pytest.raises(ValueError, match=r"expert_ids: expected M\*top_k = 4 expert ids \(one pair per block\)"):
        fused_moe_gemm(x, w, None, ids[:, :3].copy(), None, a)
    with pytest.raises(TypeError, match="both arrays, or both None"):
        fused_moe_gemm(x, w, s, eids, None, a)


@pytest.mark.parametrize("hopper", ["1", "0"])
@pytest.mark.parametrize("block_m,act_order,dtype_name", [
    (16, False, "float16"), (16, True, "bfloat16"), (32, False, "bfloat16"), (64, False, "float16"),
    (128, False, "bfloat16"), (128, True, "float16")])
def test_gemm_pair_order(block_m, act_order, dtype_name, hopper, monkeypatch):
    """a_pair_order: the activations' 8-column runs in pair order (moe_gemm_decode.cu, kPairA) give the reference's result
    on every kernel that takes them (the decode kernel, the tc kernel; a 32-row block falls back from the ws kernel
    to the decode kernel), with split-K and warps along K; 8-bit weights are rejected."""
    from cupy_moe.reference import to_pair_order
    monkeypatch.setenv("CUPY_MOE_HOPPER", hopper)
    rng = np.random.default_rng(block_m + act_order)
    dt = _dtype(dtype_name)
    e, m, a, n = 6, {16: 3, 32: 20, 64: 40, 128: 150}[block_m], 2, 160
    for k in (1024, 4096):  # 4096 with few CTAs: split-K (and warps along K for 16-row blocks)
        w_host = make_weight(rng, e, k, n, 4, 128, False, act_order)
        w = w_host.to_device()
        x = rng.standard_normal((m, k)).astype(np.float32).astype(dt)
        ids = route(rng, m, e, a, "uniform")
        s, eids, post = moe_align_block_size(cp.asarray(ids), block_m, e)
        got = fused_moe_gemm(to_pair_order(cp.asarray(x)), w, s, eids, post, a, a_pair_order=True)
        ref = reference.fused_moe_gemm(x.astype(np.float32), w_host, *(cp.asnumpy(v) for v in (s, eids, post)), a)
        got = cp.asnumpy(got).astype(np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= REL_L2[dtype_name]
    w8 = make_weight(rng, e, 256, n, 8, 128, False, False).to_device()
    with pytest.raises(ValueError, match="a_pair_order: expected False with 8-bit weights"):
        fused_moe_gemm(cp.zeros((m, 256), cp.float16), w8, s, eids, post, a, a_pair_order=True)


def test_gemm_many_blocks_per_expert():
    """Mixtral-8x7B's down phase at M = 4096 (E = 8, 8192 pairs, so 64 blocks of 16 rows per expert; K = 14336):
    the 16-row decode kernel, unsplit and in pair order as fused_moe runs it, and the 128-row kernel give the same
    product (within the two roundings each). The tests above have at most a few blocks per expert."""
    from cupy_moe.reference import to_pair_order
    e, m, a, k, n = 8, 4096, 2, 14336, 4096
    rng = np.random.default_rng(4096)
    w = StackedGptqWeight.random(e, k, n, bits=4, group_size=128, seed=1)
    x = cp.asarray(rng.standard_normal((m * a, k)).astype(np.float16))
    ids = cp.asarray(route(rng, m, e, a, "uniform"))
    outs = []
    for block_m in (16, 128):
        pair = configs.down_pair_order(4, block_m)
        cfg = configs.choose_config(m * a, e, 1, k, n, 4, 128, block_m, pair_a=pair, split_k=1)
        al = moe_align_block_size(ids, block_m, e)
        outs.append(fused_moe_gemm(to_pair_order(x) if pair else x, w, *al, 1, a_pair_order=pair, config=cfg)
                    .astype(cp.float32))
    small, large = outs
    scale = float(cp.linalg.norm(large))
    assert scale > 0 and not bool(cp.isnan(small).any())
    assert float(cp.linalg.norm(small - large)) / scale <= 2 * REL_L2["float16"]


def test_rejects_bad_shapes_before_launch():
    rng = np.random.default_rng(4)
    w = make_weight(rng, 2, 64, 32, 4, 32, True, False).to_device()
    x = cp.asarray(rng.standard_normal((3, 64)).astype(np.float16))
    s, eids, post = moe_align_block_size(cp.asarray(np.array([[0], [1], [0]], np.int32)), 16, 2)
    with pytest.raises(ValueError, match="K = 64"):
        fused_moe_gemm(x[:, :32].copy(), w, s, eids, post, 1)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        fused_moe_gemm(x.astype(cp.float32), w, s, eids, post, 1)
    s8, e8, p8 = moe_align_block_size(cp.asarray(np.array([[0], [1], [0]], np.int32)), 8, 2)
    with pytest.raises(ValueError, match="block size B"):
        fused_moe_gemm(x, w, s8, e8, p8, 1)
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 32\)"):
        fused_moe_gemm(x, w, s, eids, post, 1, out=cp.zeros((3, 16), cp.float16))
    odd = StackedGptqWeight(  # G = 48 is not a multiple of 32
        cp.zeros((2, 12, 32), cp.int32), cp.zeros((2, 2, 32), cp.float16), None, None,
                            bits=4, group_size=48)
    with pytest.raises(ValueError, match="group_size"):
        fused_moe_gemm(cp.zeros((3, 96), cp.float16), odd, s, eids, post, 1)
