"""Checkpoints written by real quantization tools (tests/data/real) load and run as the tools run them.

Each fixture folder is what GPTQModel or llm-compressor saved for a tiny random MoE model, plus io.npz: an input x
of one MoE block, the tool's own output y of that block, its routing (topk_ids, topk_weights) and its dequantized
weights. We load the folder with `cupy_moe.load_moe_layer` and check, per fixture:

- the dequantized expert (and shared expert) weights equal the tool's bit for bit: a float16 scale times a small
  integer, rounded once to float16; for a bfloat16 model the tool rounds the float16 scales to bfloat16 first and
  the product to bfloat16, and so do we before comparing;
- the routing picks the tool's experts, with its weights;
- the layer's output matches the tool's y within twice the bar of tests/tolerances.py: both are computations of
  the same exact result, each rounded at the same few points (expert GEMM outputs, activations, the sum) in the
  model's dtype, so each is within REL_L2[dtype] of it and they are within twice that of each other.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cupy_moe
from cupy_moe import reference
from cupy_moe.checkpoint import inspect_checkpoint
from tolerances import REL_L2

REAL = Path(__file__).resolve().parent / "data" / "real"
FIXTURES = sorted(p for p in REAL.iterdir() if (p / "io.npz").exists()) if REAL.is_dir() else []


def _fixture(folder: Path):
    io = dict(np.load(folder / "io.npz"))
    info = json.loads((folder / "versions.json").read_text())
    return io, info["fixture"]["dtype"], info


def _input(io: dict, dtype: str):
    """x in the model's dtype (bfloat16 from ml_dtypes; the file holds it as exact float32)."""
    if dtype == "bfloat16":
        import ml_dtypes
        return io["x"].astype(ml_dtypes.bfloat16)
    return io["x"].astype(np.float16)


def _rel_l2(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _dequant(weight, e: int, dtype: str = "float16") -> np.ndarray:
    """Expert e of a loaded stack dequantized as a tool does in `dtype`: scale (rounded to dtype) times (q - z),
    rounded to dtype; returned as float16 (what io.npz holds), or float32 from "float32"."""
    scales = weight.scales[e]
    if dtype == "bfloat16":
        import ml_dtypes
        scales = scales.astype(ml_dtypes.bfloat16)
    w = reference.dequantize(weight.qweight[e], scales, None if weight.qzeros is None else weight.qzeros[e],
                             None if weight.g_idx is None else weight.g_idx[e], bits=weight.bits,
                             group_size=weight.group_size, checkpoint_format="gptq_v2")  # exact in float32
    return w if dtype == "float32" else w.astype(scales.dtype).astype(np.float16)


def test_fixtures_are_present():
    """The fixture folders are committed (a missing data folder must not silently skip everything)."""
    assert len(FIXTURES) >= 7 and {"gptqmodel", "llmcompressor"} <= {
        json.loads((f / "versions.json").read_text())["fixture"]["tool"] for f in FIXTURES}


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_weights_match_the_tools_dequantization(folder):
    """Bit for bit: the tool's float16 weights, or its bfloat16 ones (float16 scales rounded to bfloat16 first)."""
    io, dtype, _ = _fixture(folder)
    w = cupy_moe.load_moe_layer(folder, int(io["layer"]), device=False).weights
    i = w.intermediate_size
    for e in range(w.num_experts):
        w13, w2 = _dequant(w.w13, e, dtype), _dequant(w.w2, e, dtype)
        np.testing.assert_array_equal(w13[:, :i], io["experts.gate_proj"][e], f"expert {e} gate")
        np.testing.assert_array_equal(w13[:, i:], io["experts.up_proj"][e], f"expert {e} up")
        np.testing.assert_array_equal(w2, io["experts.down_proj"][e], f"expert {e} down")
    shared = [k for k in io if k.startswith("shared_expert") and k.endswith("down_proj")]
    assert (w.shared is not None) == bool(shared)
    if shared:
        prefix = shared[0].rsplit(".", 1)[0]
        i_s = w.shared.intermediate_size
        gu = _dequant(w.shared.gate_up, 0, dtype)
        np.testing.assert_array_equal(gu[:, :i_s], io[f"{prefix}.gate_proj"], "shared gate")
        np.testing.assert_array_equal(gu[:, i_s:], io[f"{prefix}.up_proj"], "shared up")
        np.testing.assert_array_equal(_dequant(w.shared.down, 0, dtype), io[f"{prefix}.down_proj"], "shared down")


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_routing_and_output_match_the_tool(folder):
    io, dtype, _ = _fixture(folder)
    layer = cupy_moe.load_moe_layer(folder, int(io["layer"]), device=False)
    x = _input(io, dtype)
    weights, ids = layer.route(x)
    order = np.argsort(ids, axis=1)
    tool_order = np.argsort(io["topk_ids"], axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1),
                                  np.take_along_axis(io["topk_ids"], tool_order, 1))
    # The tool's router runs in the model's dtype where we run float32: weights agree to its rounding.
    np.testing.assert_allclose(np.take_along_axis(weights, order, 1),
                               np.take_along_axis(io["topk_weights"], tool_order, 1), rtol=1e-2, atol=1e-3)
    y = layer(x)
    err = _rel_l2(y, io["y"])
    assert err <= 2 * REL_L2[dtype], f"{folder.name}: relative L2 error {err:.2e} vs the tool's output"


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_inspect_describes_the_fixture(folder):
    io, _, info = _fixture(folder)
    got = inspect_checkpoint(folder)
    assert got["problems"] == [] and got["family"] == info["fixture"]["family"]
    assert got["quantization"]["bits"] == info["fixture"]["bits"]
    assert got["num_experts"] == io["experts.down_proj"].shape[0]
    assert int(io["layer"]) in got["moe_layers"]


@pytest.mark.gpu
@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_gpu_output_matches_the_tool(folder):
    import cupy
    io, dtype, _ = _fixture(folder)
    layer = cupy_moe.load_moe_layer(folder, int(io["layer"]), device=True)
    x = _input(io, dtype)
    _, ids = layer.route(cupy.asarray(x))
    np.testing.assert_array_equal(np.sort(cupy.asnumpy(ids), 1), np.sort(io["topk_ids"], 1))
    y = cupy.asnumpy(layer(cupy.asarray(x))).astype(np.float32)
    err = _rel_l2(y, io["y"])
    assert err <= 2 * REL_L2[dtype], f"{folder.name}: relative L2 error {err:.2e} vs the tool's output"
