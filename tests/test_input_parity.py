"""The public functions accept and reject the same inputs on the NumPy path and on the GPU path, with the same
error, so a script prototyped on NumPy moves to CuPy unchanged. The CuPy cases run where a GPU is present."""
import numpy as np
import pytest

import cupy_moe
from cupy_moe._xp import gpu_available
from cupy_moe.testing import write_checkpoint

E, H, I, A, M = 4, 64, 64, 2, 3

XPS = [pytest.param("numpy", id="numpy"), pytest.param("cupy", id="cupy", marks=pytest.mark.gpu)]


def _xp(name):
    if name == "numpy":
        return np
    import cupy
    return cupy


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity")
    write_checkpoint(path, family="mixtral", hidden=H, intermediate=I, num_experts=E, top_k=A, group_size=32,
                     return_weights=False)
    return path


@pytest.fixture(scope="module")
def host_layer(folder):
    return cupy_moe.load_moe_layer(folder, 0, device=False)


def _inputs(xp, layer):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, H)).astype(np.float16)
    ids = np.array([[0, 1], [2, 3], [1, 0]], np.int32)
    tw = np.full((M, A), 0.5, np.float32)
    w = layer.weights
    if xp is np:
        return x, ids, tw, w.w13, w.w2
    return xp.asarray(x), xp.asarray(ids), xp.asarray(tw), w.w13.to_device(), w.w2.to_device()


BAD = [  # (what to change, the error it must raise, a pattern of its message)
    ("x float32", TypeError, r"hidden_states: expected dtype float16 or bfloat16, got float32"),
    ("x float64", TypeError, r"hidden_states: expected dtype float16 or bfloat16, got float64"),
    ("x list", TypeError, r"hidden_states: expected a NumPy or CuPy array \[M, H\], got list"),
    ("x 1-D", ValueError, r"hidden_states: expected a 2-D array \[M, H\], got shape \(64,\)"),
    ("weights float16", TypeError, r"topk_weights: expected dtype float32, got float16"),
    ("ids float32", TypeError, r"topk_ids: expected dtype int32 or int64, got float32"),
]


def _spoil(case, xp, x, ids, tw):
    if case == "x float32":
        return x.astype(xp.float32), ids, tw
    if case == "x float64":
        return x.astype(xp.float64), ids, tw
    if case == "x list":
        return x.tolist(), ids, tw
    if case == "x 1-D":
        return x[0], ids, tw
    if case == "weights float16":
        return x, ids, tw.astype(xp.float16)
    return x, ids.astype(xp.float32), tw


@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("case,exc,pattern", BAD)
def test_fused_moe_rejects_the_same_inputs(host_layer, xp_name, case, exc, pattern):
    xp = _xp(xp_name)
    x, ids, tw, w13, w2 = _inputs(xp, host_layer)
    x, ids, tw = _spoil(case, xp, x, ids, tw)
    with pytest.raises(exc, match=pattern):
        cupy_moe.fused_moe(x, w13, w2, tw, ids)


@pytest.mark.parametrize("xp_name", XPS)
def test_fused_moe_gemm_and_align_reject_the_same_inputs(host_layer, xp_name):
    xp = _xp(xp_name)
    x, ids, tw, w13, _ = _inputs(xp, host_layer)
    with pytest.raises(TypeError, match=r"topk_ids: expected dtype int32 or int64, got float64"):
        cupy_moe.moe_align_block_size(ids.astype(xp.float64), 16, E)
    with pytest.raises(TypeError, match=r"topk_ids: expected a NumPy or CuPy array \[M, A\], got list"):
        cupy_moe.moe_align_block_size(ids.tolist(), 16, E)
    # the align kernels' limits hold on the NumPy path too
    with pytest.raises(ValueError, match=r"block_size: expected an int in \[1, 1024\], got 2048"):
        cupy_moe.moe_align_block_size(ids, 2048, E)
    with pytest.raises(ValueError, match=r"num_experts: expected an int in \[1, 1024\], got 1025"):
        cupy_moe.moe_align_block_size(ids, 16, 1025)
    with pytest.raises(TypeError, match=r"block_size: expected an int, got bool"):
        cupy_moe.moe_align_block_size(ids, True, E)
    aligned = cupy_moe.moe_align_block_size(ids, 16, E)
    with pytest.raises(TypeError, match=r"a: expected dtype float16 or bfloat16, got float32"):
        cupy_moe.fused_moe_gemm(x.astype(xp.float32), w13, *aligned, A)
    # what the kernels need of a call, on the NumPy path too
    with pytest.raises(ValueError, match=r"block size B = sorted_token_ids.size // expert_ids.size: expected one of "
                                         r"\(16, 32, 48, 64, 128\)"):
        cupy_moe.fused_moe_gemm(x, w13, *cupy_moe.moe_align_block_size(ids, 8, E), A)
    with pytest.raises(TypeError, match=r"sorted_token_ids: expected int32, got int64"):
        cupy_moe.fused_moe_gemm(x, w13, aligned[0].astype(xp.int64), *aligned[1:], A)
    with pytest.raises(ValueError, match=r"a: expected a C-contiguous array, got a strided view"):
        cupy_moe.fused_moe_gemm(xp.concatenate([x, x], axis=1)[:, ::2], w13, *aligned, A)
    with pytest.raises(TypeError, match=r"out: expected float16, got float32"):
        cupy_moe.fused_moe_gemm(x, w13, *aligned, A, out=xp.zeros((M * A, 2 * I), xp.float32))
    with pytest.raises(TypeError, match=r"workspace: expected a SplitKWorkspace or None, got str"):
        cupy_moe.fused_moe_gemm(x, w13, *aligned, A, workspace="x")
    with pytest.raises(TypeError, match=r"weight: expected a StackedGptqWeight, got ndarray"):
        cupy_moe.fused_moe_gemm(x, xp.zeros((E, H, 2 * I), xp.float16), *aligned, A)
    with pytest.raises(TypeError, match=r"topk_weights: expected dtype float32, got float16"):
        cupy_moe.fused_moe_gemm(x, w13, *aligned, A, topk_weights=tw.astype(xp.float16))
    with pytest.raises(TypeError, match=r"router_logits: expected dtype float16 or bfloat16 or float32, got int64"):
        cupy_moe.select_experts(xp.zeros((M, E), xp.int64), A)
    # the routing kernel's limits hold on the NumPy path too
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, min\(E, 32\)\] = \[1, 32\], got 40"):
        cupy_moe.select_experts(xp.zeros((M, 64), xp.float32), 40)
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, min\(E, 32\)\] = \[1, 4\], got 2.0"):
        cupy_moe.select_experts(xp.zeros((M, E), xp.float32), 2.0)
    with pytest.raises(ValueError, match=r"router_logits: expected 1 <= E <= 1024 experts, got E=2000"):
        cupy_moe.select_experts(xp.zeros((M, 2000), xp.float32), 2)


@pytest.mark.parametrize("xp_name", XPS)
def test_layer_rejects_float32_hidden_states(folder, xp_name):
    xp = _xp(xp_name)
    layer = cupy_moe.load_moe_layer(folder, 0, device=xp is not np)
    x = xp.zeros((M, H), xp.float32)
    with pytest.raises(TypeError, match=r"hidden_states: expected dtype float16 or bfloat16, got float32"):
        layer(x)


def test_mixed_host_and_device_inputs_are_refused(host_layer):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU to make a device array")
    import cupy
    x, ids, tw, w13, w2 = _inputs(np, host_layer)
    with pytest.raises(TypeError, match=r"topk_ids: expected NumPy arrays, as hidden_states, got CuPy ones"):
        cupy_moe.fused_moe(x, w13, w2, tw, cupy.asarray(ids))


def test_numpy_path_accepts_what_the_gpu_path_accepts(host_layer):
    x, ids, tw, w13, w2 = _inputs(np, host_layer)
    out = cupy_moe.fused_moe(x, w13, w2, tw, ids.astype(np.int64))
    assert out.dtype == np.float16 and out.shape == (M, H)


def test_arrays_on_another_gpu_are_refused_before_any_launch(monkeypatch):
    """A CuPy array of another device than the current one is a ValueError naming both devices (a kernel handed
    another GPU's pointer would fault). Stand-ins for CuPy: no GPU is needed."""
    import types

    from cupy_moe import _xp

    class OtherGpuArray:  # what a cupy.ndarray made under `with cupy.cuda.Device(1):` looks like here
        device, dtype, ndim, shape = types.SimpleNamespace(id=1), np.dtype(np.int32), 2, (3, 2)

    monkeypatch.setattr(_xp, "cupy", types.SimpleNamespace(
        ndarray=OtherGpuArray, cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))))
    with pytest.raises(ValueError, match=r"topk_ids: expected an array on the current device 0, got one on device 1 "
                                         r"\(make it current with `with cupy.cuda.Device\(1\):`\)"):
        cupy_moe.moe_align_block_size(OtherGpuArray(), 16, 4)
    ids = OtherGpuArray()
    ids.dtype = np.dtype(np.float32)
    with pytest.raises(ValueError, match="router_logits: expected an array on the current device 0"):
        cupy_moe.select_experts(ids, 2)
