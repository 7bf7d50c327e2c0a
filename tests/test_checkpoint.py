"""Checkpoint loading (cupy_moe.checkpoint): write with cupy_moe.testing, load, compare; every quirk, every error.

All tests run on the host (device=False) except the one marked gpu. Shapes are small on purpose:
H=64, I=128, E=4, G=32 unless a quirk needs others (partial last group, 3-bit multiples of 32).
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from cupy_moe import _peak_rss
from cupy_moe import reference as R
from cupy_moe import checkpoint as C
from cupy_moe.checkpoint.loading import _real_zeros
from cupy_moe.checkpoint.quant_config import Quant, parse_quant_config
from cupy_moe.checkpoint.safetensors import SafetensorsFile
from cupy_moe.checkpoint import (NamingScheme, inspect_checkpoint, load_layer_weights, load_model_weights,
                                 load_stacked)
from cupy_moe.testing import FAMILIES, edit_checkpoint, write_checkpoint
from cupy_moe.weights import StackedGptqWeight

from gptqmodel_v1 import gptqmodel_v1

NAMES = {  # family -> (experts prefix of layer L, gate, up, down, router module)
    "mixtral": ("model.layers.{L}.block_sparse_moe.experts", "w1", "w3", "w2",
                "model.layers.{L}.block_sparse_moe.gate"),
    "qwen2_moe": ("model.layers.{L}.mlp.experts", "gate_proj", "up_proj", "down_proj", "model.layers.{L}.mlp.gate"),
    "qwen3_moe": ("model.layers.{L}.mlp.experts", "gate_proj", "up_proj", "down_proj", "model.layers.{L}.mlp.gate"),
    "deepseek_v2": ("model.layers.{L}.mlp.experts", "gate_proj", "up_proj", "down_proj", "model.layers.{L}.mlp.gate"),
    "deepseek_v3": ("model.layers.{L}.mlp.experts", "gate_proj", "up_proj", "down_proj", "model.layers.{L}.mlp.gate"),
}
SHARED = {"qwen2_moe": "model.layers.{L}.mlp.shared_expert", "deepseek_v2": "model.layers.{L}.mlp.shared_experts",
          "deepseek_v3": "model.layers.{L}.mlp.shared_experts"}


# --------------------------------------------------------------------------- helpers


def expert_modules(family, layer, e):
    pre, g, u, d, _ = NAMES[family]
    base = pre.format(L=layer) + f".{e}."
    return base + g, base + u, base + d


def dequant(weight: StackedGptqWeight, e: int) -> np.ndarray:
    """float32 [K, N] of expert e (the loader stores real zeros: gptq_v2 semantics)."""
    return R.dequantize(weight.qweight[e], weight.scales[e], None if weight.qzeros is None else weight.qzeros[e],
                        None if weight.g_idx is None else weight.g_idx[e], bits=weight.bits,
                        group_size=weight.group_size, checkpoint_format="gptq_v2")


def assert_within_half_step(weight: StackedGptqWeight, e: int, w: np.ndarray, scale_eps: float = 2.0 ** -11):
    """|dequant - w| <= scale * (1/2 + 2**bits * scale_eps) per element.

    1/2 step: round to nearest (the sym clamp at maxq also lands exactly at half a step). The second term covers
    the stored scale's own rounding, times |q - z| <= 2**bits: float16 rounding (2**-11) for every file, plus
    bfloat16's (2**-9) when scales are stored bf16.
    """
    deq = dequant(weight, e)
    k = weight.k
    groups = (np.arange(k) // weight.group_len) if weight.g_idx is None else weight.g_idx[e]
    s = weight.scales[e].astype(np.float32)[groups]  # [K, N]
    bound = s * (0.5 + (1 << weight.bits) * scale_eps) + 1e-7
    err = np.abs(deq - w)
    assert err.shape == w.shape
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"expert {e}: error {err[worst]} > bound {bound[worst]} at {worst}"


def check_layer(layer: C.MoELayerWeights, weights: dict, family: str, scale_eps: float = 2.0 ** -11):
    """Every expert of w13/w2 within half a step of the floats the writer quantized."""
    for e in range(layer.num_experts):
        g, u, d = expert_modules(family, layer.layer, e)
        assert_within_half_step(layer.w13, e, np.concatenate([weights[g], weights[u]], axis=1), scale_eps)
        assert_within_half_step(layer.w2, e, weights[d], scale_eps)


def file_tensor(folder: Path, name: str) -> np.ndarray:
    """One tensor read with safetensors itself (an independent reader)."""
    index = folder / "model.safetensors.index.json"
    fname = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    with safe_open(str(folder / fname), "numpy") as f:
        return f.get_tensor(name)


def assert_exact_vs_file(folder: Path, weight: StackedGptqWeight, modules_per_expert, bits, group_size, fmt):
    """The loaded stack dequantizes exactly like reference.dequantize on the file's own tensors."""
    for e, mods in enumerate(modules_per_expert):
        parts = []
        for m in mods:
            parts.append(R.dequantize(file_tensor(folder, m + ".qweight"), file_tensor(folder, m + ".scales"),
                                      file_tensor(folder, m + ".qzeros"), file_tensor(folder, m + ".g_idx"),
                                      bits=bits, group_size=group_size, checkpoint_format=fmt))
        np.testing.assert_array_equal(dequant(weight, e), np.concatenate(parts, axis=1))


@pytest.fixture
def ckpt(tmp_path):
    """write_checkpoint into a fresh folder: ckpt(**kwargs) -> (folder, weights)."""
    count = [0]

    def make(**kwargs):
        count[0] += 1
        folder = tmp_path / f"ckpt{count[0]}"
        return folder, write_checkpoint(folder, **kwargs)
    return make


# --------------------------------------------------------------------------- families


@pytest.mark.parametrize("family", FAMILIES)
def test_family_roundtrip(ckpt, family):
    deepseek = family.startswith("deepseek")
    folder, w = ckpt(family=family, num_layers=2, num_experts=4, top_k=2)
    layer = load_layer_weights(folder, 1, device=False)
    assert (layer.family, layer.layer, layer.hidden_size, layer.intermediate_size, layer.num_experts) == \
        (family, 1, 64, 128, 4)
    assert isinstance(layer.w13, StackedGptqWeight) and (layer.w13.k, layer.w13.n) == (64, 256)
    assert (layer.w2.k, layer.w2.n, layer.w2.bits, layer.w2.group_size) == (128, 64, 4, 32)
    assert layer.w13.qzeros is None and layer.w13.g_idx is None  # sym, no act-order: the kernels' fast path
    check_layer(layer, w, family)
    router = NAMES[family][4].format(L=1)
    assert layer.router_weight.dtype == np.float16
    np.testing.assert_array_equal(layer.router_weight.astype(np.float32), w[router].T)  # [E, H] as stored
    assert layer.top_k == 2
    assert layer.renormalize == {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "deepseek_v2": False,
                                 "deepseek_v3": True}[family]
    assert layer.scoring_func == ("sigmoid" if family == "deepseek_v3" else "softmax")
    assert layer.routed_scaling_factor == (2.5 if family == "deepseek_v3" else 1.0)
    assert layer.w13_bias is None and layer.w2_bias is None
    if family in SHARED:
        sh = SHARED[family].format(L=1)
        i_s = 256 if family == "qwen2_moe" else (2 if family == "deepseek_v2" else 1) * 128
        assert layer.shared.intermediate_size == i_s
        assert (layer.shared.gate_up.num_experts, layer.shared.gate_up.k, layer.shared.gate_up.n) == (1, 64, 2 * i_s)
        gate, up, down = NAMES[family][1:4]
        assert_within_half_step(layer.shared.gate_up, 0, np.concatenate([w[f"{sh}.{gate}"], w[f"{sh}.{up}"]], 1))
        assert_within_half_step(layer.shared.down, 0, w[f"{sh}.{down}"])
    else:
        assert layer.shared is None
    if family == "qwen2_moe":
        np.testing.assert_array_equal(layer.shared_gate_weight.astype(np.float32),
                                      w["model.layers.1.mlp.shared_expert_gate"].T)
    else:
        assert layer.shared_gate_weight is None
    if family == "deepseek_v3":
        np.testing.assert_array_equal(layer.e_score_correction_bias,
                                      w["model.layers.1.mlp.gate.e_score_correction_bias"])
    else:
        assert layer.e_score_correction_bias is None
    if not deepseek:  # layer 0 is an MoE layer too
        check_layer(load_layer_weights(folder, 0, device=False), w, family)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_load_stacked_and_from_safetensors(ckpt, family):
    folder, w = ckpt(family=family, desc_act=True)
    layer = load_layer_weights(folder, 0, device=False)
    for proj, attr in (("w13", "w13"), ("w2", "w2")):
        a = load_stacked(folder, 0, proj, device=False)
        b = StackedGptqWeight.from_safetensors(folder, 0, proj, device=False)
        for x in (a, b):
            for field in ("qweight", "scales", "g_idx"):
                np.testing.assert_array_equal(getattr(x, field), getattr(getattr(layer, attr), field))
    with pytest.raises(ValueError, match=r"proj: expected 'w13' \(gate and up\) or 'w2' \(down\), got 'w1'"):
        load_stacked(folder, 0, "w1", device=False)


# --------------------------------------------------------------------------- quantization quirks

QUIRKS = [  # bits, sym, checkpoint_format, desc_act, group_size, hidden, intermediate
    pytest.param(4, True, "gptq", False, 32, 64, 128, id="4bit-sym-v1"),
    pytest.param(4, True, "gptq_v2", False, 32, 64, 128, id="4bit-sym-v2"),
    pytest.param(4, False, "gptq_v2", False, 32, 64, 128, id="4bit-asym-v2"),
    pytest.param(4, False, "gptq", False, 32, 64, 128, id="4bit-asym-v1-gptqmodel"),
    pytest.param(4, True, "gptq", True, 32, 64, 128, id="4bit-act-order"),
    pytest.param(4, False, "gptq_v2", True, 32, 64, 128, id="4bit-asym-act-order"),
    pytest.param(4, True, "gptq", False, -1, 64, 128, id="4bit-group-1"),
    pytest.param(4, True, "gptq", True, 64, 96, 160, id="4bit-partial-last-group"),
    pytest.param(4, True, "gptq", False, 128, 64, 128, id="4bit-group-larger-than-K"),
    pytest.param(8, True, "gptq", False, 32, 64, 128, id="8bit-sym-v1"),
    pytest.param(8, False, "gptq", True, 32, 64, 128, id="8bit-asym-v1-act-order"),
    pytest.param(2, True, "gptq", False, 32, 64, 128, id="2bit-sym"),
    pytest.param(2, False, "gptq", False, 32, 64, 128, id="2bit-asym-v1"),
    pytest.param(3, True, "gptq", True, 32, 64, 128, id="3bit-sym-act-order"),
    pytest.param(3, False, "gptq", False, 32, 64, 128, id="3bit-asym-v1"),
    pytest.param(3, False, "gptq_v2", False, -1, 64, 128, id="3bit-asym-v2-group-1"),
]


@pytest.mark.parametrize("bits, sym, fmt, desc_act, group_size, hidden, intermediate", QUIRKS)
def test_quantization_quirks(ckpt, bits, sym, fmt, desc_act, group_size, hidden, intermediate):
    folder, w = ckpt(family="mixtral", bits=bits, sym=sym, checkpoint_format=fmt, desc_act=desc_act,
                     group_size=group_size, hidden=hidden, intermediate=intermediate, num_shards=2)
    layer = load_layer_weights(folder, 0, device=False)
    assert layer.w13.bits == bits and layer.w13.group_size == group_size
    assert (layer.w13.qzeros is None) == sym  # sym drops the zeros; asym keeps real ones
    assert (layer.w13.g_idx is not None) == (desc_act and group_size != -1)
    if desc_act and group_size != -1:
        assert not np.all(np.diff(layer.w13.g_idx[0]) >= 0)  # act-order: non-monotone groups survive loading
    check_layer(layer, w, "mixtral")
    mods = [expert_modules("mixtral", 0, e) for e in range(4)]
    assert_exact_vs_file(folder, layer.w13, [m[:2] for m in mods], bits, group_size, fmt)
    assert_exact_vs_file(folder, layer.w2, [m[2:] for m in mods], bits, group_size, fmt)


@pytest.mark.parametrize("scales_dtype, eps", [("bfloat16", 2.0 ** -11 + 2.0 ** -9), ("float32", 2.0 ** -11)])
def test_bf16_and_fp32_scales_and_dense(ckpt, scales_dtype, eps):
    folder, w = ckpt(family="qwen2_moe", scales_dtype=scales_dtype, dense_dtype=scales_dtype, quantize_shared=False)
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:  # the file really holds BF16/F32
        want = {"bfloat16": "BF16", "float32": "F32"}[scales_dtype]
        assert f.get_slice("model.layers.0.mlp.experts.0.gate_proj.scales").get_dtype() == want
    layer = load_layer_weights(folder, 0, device=False)
    assert layer.w13.scales.dtype == np.float16
    check_layer(layer, w, "qwen2_moe", scale_eps=eps)
    # dense tensors: bf16 widened exactly to float32, float32 kept
    assert layer.router_weight.dtype == np.float32
    np.testing.assert_array_equal(layer.router_weight, w["model.layers.0.mlp.gate"].T)
    np.testing.assert_array_equal(layer.shared.gate_up[0], np.concatenate(
        [w["model.layers.0.mlp.shared_expert.gate_proj"], w["model.layers.0.mlp.shared_expert.up_proj"]], 1))
    np.testing.assert_array_equal(layer.shared.down[0], w["model.layers.0.mlp.shared_expert.down_proj"])


def test_scales_that_become_float16_subnormals_warn_once(ckpt):
    """float32 scales below 2**-14 lose bits in the float16 stacked layout: one warning per file, naming the
    smallest scale and a tensor."""
    folder, _ = ckpt(family="mixtral", scales_dtype="float32")
    name = "model.layers.0.block_sparse_moe.experts.1.w1.scales"
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        scales = f.get_tensor(name).copy()
    scales[0, :3] = [3e-6, 5e-7, 1e-9]
    edit_checkpoint(folder, replace={name: scales})
    with pytest.warns(UserWarning, match=r"model\.safetensors: scales below 2\*\*-14 \(the smallest 1e-09, in "
                                         r"tensor '.*experts\.1\.w1\.scales'\) keep fewer bits as float16 subnormals"):
        layer = load_layer_weights(folder, 0, device=False)
    assert layer.w13.scales[1, 0, 0] == np.float16(3e-6) and layer.w13.scales[1, 0, 2] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same file again: no second warning
        load_layer_weights(folder, 0, device=False)


def test_zero_bias_ignored_and_nonzero_bias_kept(ckpt):
    folder, w = ckpt(family="mixtral", zero_bias=True)
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.bias" in f.keys()
    layer = load_layer_weights(folder, 0, device=False)
    assert layer.w13_bias is None and layer.w2_bias is None
    check_layer(layer, w, "mixtral")
    assert load_stacked(folder, 0, "w13", device=False).n == 256

    folder, w = ckpt(family="mixtral", bias=True)
    layer = load_layer_weights(folder, 0, device=False)
    g, u, d = expert_modules("mixtral", 0, 2)
    np.testing.assert_array_equal(layer.w13_bias[2], np.concatenate([w[g + ".bias"], w[u + ".bias"]]))
    np.testing.assert_array_equal(layer.w2_bias[2], w[d + ".bias"])
    assert layer.w13_bias.shape == (4, 256) and layer.w2_bias.shape == (4, 64)
    with pytest.raises(ValueError, match=r"non-zero '\.bias' tensors .* use load_moe_layer"):
        load_stacked(folder, 0, "w2", device=False)


def test_shards_split_modules_and_match_single_file(ckpt):
    one, _ = ckpt(family="qwen3_moe", desc_act=True, sym=False)
    three, _ = ckpt(family="qwen3_moe", desc_act=True, sym=False, num_shards=3)
    wmap = json.loads((three / "model.safetensors.index.json").read_text())["weight_map"]
    mod = "model.layers.0.mlp.experts.1.up_proj"
    assert len({wmap[mod + s] for s in (".qweight", ".qzeros", ".scales", ".g_idx")}) == 3  # one module, 3 files
    a, b = load_layer_weights(one, 0, device=False), load_layer_weights(three, 0, device=False)
    for proj in ("w13", "w2"):
        for field in ("qweight", "scales", "qzeros", "g_idx"):
            np.testing.assert_array_equal(getattr(getattr(a, proj), field), getattr(getattr(b, proj), field))


def test_single_file_autogptq_name(ckpt):
    folder, w = ckpt(family="mixtral", file_name="gptq_model-4bit-32g.safetensors")
    assert not (folder / "model.safetensors").exists()
    check_layer(load_layer_weights(folder, 0, device=False), w, "mixtral")


@pytest.mark.parametrize("where", ["quantize_config", "quant_config", "config"])
def test_quant_config_locations(ckpt, where):
    folder, w = ckpt(family="mixtral", bits=8, quant_config_files=where)
    assert (folder / "quantize_config.json").exists() == (where == "quantize_config")
    layer = load_layer_weights(folder, 0, device=False)
    assert layer.w13.bits == 8
    check_layer(layer, w, "mixtral")


def test_quantize_config_json_wins_over_config_json(ckpt):
    folder, w = ckpt(family="mixtral")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8  # contradicts the tensors, but quantize_config.json is read first
    (folder / "config.json").write_text(json.dumps(cfg))
    check_layer(load_layer_weights(folder, 0, device=False), w, "mixtral")
    assert inspect_checkpoint(folder)["quantization"]["source"] == "quantize_config.json"


@pytest.mark.parametrize("extra, fmt", [({"checkpoint_format": None, "format": "gptq_v2"}, "gptq_v2"),
                                        ({"checkpoint_format": None}, "gptq")])
def test_format_key_and_default_v1(ckpt, extra, fmt):
    folder, w = ckpt(family="mixtral", sym=False, checkpoint_format=fmt, extra_quant_config=extra)
    check_layer(load_layer_weights(folder, 0, device=False), w, "mixtral")
    assert inspect_checkpoint(folder)["quantization"]["checkpoint_format"] == fmt


def test_dynamic_override_bits_per_layer(ckpt):
    folder, w = ckpt(family="qwen3_moe", num_layers=2, dynamic={r"+:model\.layers\.1\..*": {"bits": 8}})
    l0, l1 = load_layer_weights(folder, 0, device=False), load_layer_weights(folder, 1, device=False)
    assert (l0.w13.bits, l1.w13.bits, l1.w2.bits) == (4, 8, 8)
    check_layer(l0, w, "qwen3_moe")
    check_layer(l1, w, "qwen3_moe")


def test_dynamic_exclusions(ckpt):
    # Shared experts excluded: dense arrays [1, K, N]; routed experts stay GPTQ.
    folder, w = ckpt(family="deepseek_v2", num_layers=2, dynamic={r"-:.*shared_experts.*": {}})
    layer = load_layer_weights(folder, 1, device=False)
    assert isinstance(layer.w13, StackedGptqWeight)
    sh = "model.layers.1.mlp.shared_experts"
    np.testing.assert_array_equal(layer.shared.down[0], w[sh + ".down_proj"])
    assert layer.shared.gate_up.shape == (1, 64, 512)

    # Every expert of layer 1 excluded: dense stacked arrays; load_stacked refuses.
    folder, w = ckpt(family="mixtral", num_layers=2, dynamic={r"-:model\.layers\.1\.block_sparse_moe\.experts": {}})
    layer = load_layer_weights(folder, 1, device=False)
    assert layer.w13.shape == (4, 64, 256) and layer.w13.dtype == np.float16
    g, u, d = expert_modules("mixtral", 1, 3)
    np.testing.assert_array_equal(layer.w13[3], np.concatenate([w[g], w[u]], 1))
    np.testing.assert_array_equal(layer.w2[3], w[d])
    assert isinstance(load_layer_weights(folder, 0, device=False).w13, StackedGptqWeight)
    with pytest.raises(ValueError, match=r"layer 1 w2: every expert is dense"):
        load_stacked(folder, 1, "w2", device=False)

    # One expert excluded: it cannot stack with GPTQ experts.
    folder, _ = ckpt(family="mixtral", dynamic={r"-:.*experts\.2\.w3": {}})
    with pytest.raises(ValueError, match=r"model\.safetensors: module 'model\.layers\.0\.block_sparse_moe\.experts"
                                         r"\.2\.w3' is dense \(dynamic rule '-:\.\*experts\\\.2\\\.w3' in "
                                         r"quantize_config\.json\), but the other experts of layer 0 w13 are "
                                         r"quantized .* cannot mix dense and GPTQ experts"):
        load_layer_weights(folder, 0, device=False)


def test_dynamic_rule_semantics():
    """GPTQModel: re.match (anchored at the start), first match wins, '-:' excludes, '+:' and plain override."""
    qc = parse_quant_config({"bits": 4, "group_size": 128, "dynamic": {
        r"-:model\.layers\.0\.mlp\.experts\.1\.": {}, r"+:model\.layers\.0\.": {"bits": 8, "group_size": 32},
        r"model\.layers\.1\.": {"sym": False}, r"layers\.2\.": {"bits": 2}}}, "test")
    block = "model.layers.{}"
    assert qc.module("model.layers.0.mlp.experts.1.up_proj", block.format(0))[0] is None
    q = qc.module("model.layers.0.mlp.experts.2.up_proj", block.format(0))[0]
    assert (q.bits, q.group_size, q.sym) == (8, 32, True)
    q = qc.module("model.layers.1.mlp.experts.0.up_proj", block.format(1))[0]
    assert (q.bits, q.sym) == (4, False)
    q, rule = qc.module("model.layers.2.mlp.experts.0.up_proj", block.format(2))  # not matched at the start
    assert (q.bits, rule) == (4, None)


def test_modules_in_block_to_quantize(ckpt):
    folder, w = ckpt(family="qwen2_moe", modules_in_block_to_quantize=True)
    cfg = json.loads((folder / "quantize_config.json").read_text())
    listed = cfg["modules_in_block_to_quantize"][0]
    assert "mlp.experts.0.gate_proj" in listed and "mlp.gate" not in listed
    check_layer(load_layer_weights(folder, 0, device=False), w, "qwen2_moe")
    # A list that leaves out a module which is quantized in the file contradicts the tensors.
    listed.remove("mlp.experts.1.down_proj")
    (folder / "quantize_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.1\.down_proj\.qweight' exists, "
                                         r"but modules_in_block_to_quantize .*the config contradicts the tensors"):
        load_layer_weights(folder, 0, device=False)


def test_dense_shared_expert_decided_by_tensors(ckpt):
    folder, w = ckpt(family="qwen2_moe", quantize_shared=False)  # the config says nothing about it
    layer = load_layer_weights(folder, 0, device=False)
    assert layer.shared.gate_up.dtype == np.float16 and layer.shared.gate_up.shape == (1, 64, 512)
    np.testing.assert_array_equal(layer.shared.down[0], w["model.layers.0.mlp.shared_expert.down_proj"])


@pytest.mark.parametrize("where", ["both", "quant_config"])
def test_awq_gemm_repacked(ckpt, where):
    folder, w = ckpt(family="mixtral", quant_method="awq", sym=False, quant_config_files=where)
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.0.w1.qweight").get_shape() == [64, 16]  # [K, N/8]
    layer = load_layer_weights(folder, 0, device=False)
    assert layer.w13.qweight.shape == (4, 8, 256) and layer.w13.qzeros is not None and layer.w13.g_idx is None
    check_layer(layer, w, "mixtral")


def test_awq_worked_example():
    """The AWQ nibble order 0, 2, 4, 6, 1, 3, 5, 7 (docs/gptq_layout.md): columns 0..7 =
    [10, 11, 12, 13, 14, 15, 1, 2] pack to 0x2FDB1ECA."""
    word = np.array([[np.uint32(0x2FDB1ECA).view(np.int32)]])
    zeros = _real_zeros(word, Quant(4, 128, False, False, "awq"))
    assert zeros.tolist() == [[10, 11, 12, 13, 14, 15, 1, 2]]


@given(st.sampled_from([2, 3, 4, 8]), st.integers(1, 3), st.integers(1, 3), st.randoms(use_true_random=False))
def test_v1_zeros_decode_inverts_gptqmodel_export(bits, rows, units, rnd):
    """Real zeros (0 included) -> GPTQModel's word-level v1 export -> loader decode gives them back exactly."""
    from cupy_moe.testing import _zeros_to_format
    n = units * (32 // np.gcd(32, bits))
    rng = np.random.default_rng(rnd.randrange(2 ** 32))
    real = rng.integers(0, 1 << bits, size=(rows, n))
    real[0, 0] = 0  # the value AutoGPTQ's v1 cannot hold
    q = R.QuantizedLinear(None, R.pack_cols(real, bits), None, None, "gptq_v2")
    v1 = _zeros_to_format(q, bits, "gptq")
    np.testing.assert_array_equal(v1, gptqmodel_v1(real, bits))  # the writer exports as GPTQModel does
    got = _real_zeros(v1, Quant(bits, 32, False, False, "gptq"))
    np.testing.assert_array_equal(got, real)
    np.testing.assert_array_equal(_real_zeros(q.qzeros, Quant(bits, 32, False, False, "gptq_v2")), real)


# --------------------------------------------------------------------------- refused settings


@pytest.mark.parametrize("extra, match", [
    ({"checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
    ({"checkpoint_format": None, "format": "bitblas"}, r"format='bitblas' is not supported"),
    ({"checkpoint_format": "gptq_p"}, r"checkpoint_format='gptq_p' is not supported"),
    ({"is_marlin_format": True}, r"is_marlin_format=true is not supported"),
    ({"pack_dtype": "int16"}, r"pack_dtype='int16' is not supported"),
    ({"rotation": "hadamard"}, r"rotation='hadamard' is not supported"),
    ({"bits": 5}, r"bits=5 is not supported: .* gptq_p"),
    ({"group_size": 0}, r"group_size: expected -1 or a positive int, got 0"),
    ({"quant_method": "fp8"}, r"quant_method='fp8' is not supported"),
    ({"dynamic": {r"+:.*": {"pack_dtype": "int8"}}}, r"dynamic rule '\+:\.\*' pack_dtype='int8' is not supported"),
    ({"dynamic": {r"-:(": {}}}, r"dynamic rule '-:\(' is not a valid regular expression"),
])
def test_refused_settings(ckpt, extra, match):
    folder, _ = ckpt(family="mixtral", extra_quant_config=extra, quant_config_files="quantize_config")
    with pytest.raises(ValueError, match=r"quantize_config\.json: " + match):
        load_layer_weights(folder, 0, device=False)
    with pytest.raises(ValueError, match=match):
        inspect_checkpoint(folder)


def test_refused_awq_variants(ckpt):
    folder, _ = ckpt(family="mixtral", quant_method="awq", extra_quant_config={"version": "gemv"})
    with pytest.raises(ValueError, match=r"AWQ version='gemv' is not supported: only AWQ GEMM"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = ckpt(family="mixtral", quant_method="awq", extra_quant_config={"zero_point": False})
    with pytest.raises(ValueError, match=r"AWQ zero_point=false is not supported"):
        load_layer_weights(folder, 0, device=False)


@pytest.mark.parametrize("bits", [2, 3])
def test_device_refuses_2_and_3_bits_before_reading(ckpt, bits):
    folder, _ = ckpt(family="mixtral", bits=bits)
    with pytest.raises(ValueError, match=rf"device: layer 0 w13 has bits={bits}, which loads on the host only"):
        load_layer_weights(folder, 0, device=True)
    with pytest.raises(ValueError, match=rf"bits={bits}, which loads on the host only"):
        load_stacked(folder, 0, "w2", device=True)


# --------------------------------------------------------------------------- layers that are not MoE / do not exist


def test_dense_and_missing_layers(ckpt):
    folder, _ = ckpt(family="deepseek_v2", num_layers=3)
    with pytest.raises(ValueError, match=r"layer 0 is dense \(first_k_dense_replace=1\)"):
        load_layer_weights(folder, 0, device=False)
    with pytest.raises(ValueError, match=r"layer 3 does not exist: config\.json has num_hidden_layers=3 "
                                         r"\(layers 0\.\.2\)"):
        load_layer_weights(folder, 3, device=False)
    with pytest.raises(ValueError, match=r"layer -1 does not exist"):
        load_stacked(folder, -1, "w13", device=False)
    with pytest.raises(TypeError, match=r"layer: expected an int, got str"):
        load_layer_weights(folder, "1", device=False)
    folder, _ = ckpt(family="qwen3_moe", num_layers=2, extra_config={"mlp_only_layers": [1]})
    with pytest.raises(ValueError, match=r"layer 1 is dense \(mlp_only_layers=\[1\]\)"):
        load_layer_weights(folder, 1, device=False)


# --------------------------------------------------------------------------- bad input: one clear error each


def _mixtral(ckpt, **kw):
    return ckpt(family="mixtral", **kw)


def test_missing_tensor(ckpt):
    folder, _ = _mixtral(ckpt, num_shards=2)
    edit_checkpoint(folder, remove=["model.layers.0.block_sparse_moe.experts.2.w2.scales"])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.2\.w2\.scales' is "
                                         r"missing: expected F16 \[4, 64\] \(\[ceil\(K/G\), N\], bits=4, "
                                         r"group_size=32, K=128, N=64 from config\.json .*\); it is in none of "
                                         r"model\.safetensors\.index\.json"):
        load_layer_weights(folder, 0, device=False)
    edit_checkpoint(folder, remove=[f"model.layers.0.block_sparse_moe.experts.1.w1.{s}"
                                    for s in ("qweight", "qzeros", "scales", "g_idx")])
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.block_sparse_moe\.experts\.1\.w1': neither "
                                         r"'.*\.qweight' \(quantized\) nor '.*\.weight' \(dense\)"):
        load_stacked(folder, 0, "w13", device=False)


def test_wrong_shape_and_dtype(ckpt):
    folder, _ = _mixtral(ckpt)
    name = "model.layers.0.block_sparse_moe.experts.1.w3.qweight"
    edit_checkpoint(folder, replace={name: np.zeros((8, 96), np.int32)})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.block_sparse_moe\.experts"
                                         r"\.1\.w3\.qweight': expected shape \[8, 128\] \(\[K\*bits/32, N\], bits=4, "
                                         r"group_size=32, K=64, N=128 from config\.json hidden_size=64, "
                                         r"intermediate_size=128\), got \[8, 96\]"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt)
    name = "model.layers.0.block_sparse_moe.experts.3.w2.scales"
    edit_checkpoint(folder, replace={name: np.zeros((4, 64), np.int32)})
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.3\.w2\.scales': "
                                         r"expected dtype F16 or BF16 or F32 .*, got I32"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt)
    edit_checkpoint(folder, replace={"model.layers.0.block_sparse_moe.gate.weight": np.zeros((3, 64), np.float16)})
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight': expected "
                                         r"shape \[4, 64\] \(router \[E, H\], E=4, H=64\), got \[3, 64\]"):
        load_layer_weights(folder, 0, device=False)


def test_experts_of_different_shapes(ckpt):
    folder, _ = _mixtral(ckpt)
    other, _ = ckpt(family="mixtral", intermediate=96)  # expert 2's w1 taken from a model with I=96
    mod = "model.layers.0.block_sparse_moe.experts.2.w1"
    repl = {mod + s: file_tensor(other, mod + s) for s in (".qweight", ".qzeros", ".scales", ".g_idx")}
    edit_checkpoint(folder, replace=repl)
    with pytest.raises(ValueError, match=r"experts\.2\.w1\.qweight': expected shape \[8, 128\] .*, got \[8, 96\]"):
        load_layer_weights(folder, 0, device=False)
    # Without sizes in config.json the experts are checked against expert 0.
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size"):
        cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"experts\.2\.w1\.qweight': expected shape \[8, 128\] \(\[K\*bits/32, N\], "
                                         r"bits=4, group_size=32, K=64, N=128 like expert 0's "
                                         r"'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1'\), got \[8, 96\]"):
        load_stacked(folder, 0, "w13", device=False)


def test_truncated_and_corrupt_files(ckpt):
    folder, _ = _mixtral(ckpt, num_shards=2)
    shard = folder / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"model-00002-of-00002\.safetensors: truncated safetensors file: tensor "
                                         rf"'.*' ends at byte {size}, but the file has only {size - 100} bytes"):
        load_layer_weights(folder, 0, device=False)

    folder, _ = _mixtral(ckpt)
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[9:14] = b"#####"  # inside the JSON header
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt safetensors header \(not valid JSON"):
        load_layer_weights(folder, 0, device=False)

    path.write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file: 2 bytes"):
        load_layer_weights(folder, 0, device=False)
    path.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"corrupt or truncated safetensors file: the header claims 1000000000000 "
                                         r"bytes but the file has 10 bytes"):
        load_layer_weights(folder, 0, device=False)


def test_missing_files(ckpt, tmp_path):
    folder, _ = _mixtral(ckpt, num_shards=2)
    (folder / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00001-of-00002\.safetensors: safetensors shard not found "
                                                r"\(it holds tensor '.*' per model\.safetensors\.index\.json\)"):
        load_layer_weights(folder, 0, device=False)
    with pytest.raises(FileNotFoundError, match=r"checkpoint folder not found"):
        load_layer_weights(tmp_path / "nope", 0, device=False)
    folder, _ = _mixtral(ckpt)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt)
    (folder / "config.json").unlink()
    assert load_stacked(folder, 0, "w2", device=False).n == 64  # sizes from the tensors
    with pytest.raises(FileNotFoundError, match=r"config\.json: not found; load_moe_layer reads the routing "
                                                r"settings \(num_experts_per_tok, norm_topk_prob\)"):
        load_layer_weights(folder, 0, device=False)
    (folder / "quantize_config.json").unlink()
    with pytest.raises(ValueError, match=r"no quantization config \(looked for quantize_config\.json, "
                                         r"quant_config\.json and config\.json\['quantization_config'\]\)"):
        load_stacked(folder, 0, "w2", device=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_detected_from_tensor_names_alone(ckpt, family):
    folder, _ = ckpt(family=family, num_layers=2)
    (folder / "config.json").unlink()
    assert inspect_checkpoint(folder)["family"] == family


def test_index_pointing_at_wrong_file(ckpt):
    folder, _ = _mixtral(ckpt, num_shards=2)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = "model.layers.0.block_sparse_moe.experts.0.w1.qweight"
    data["weight_map"][name] = "model-00002-of-00002.safetensors" if data["weight_map"][name].startswith(
        "model-00001") else "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json maps tensor '{name}' to this file, "
                                         rf"but its header has no such tensor"):
        load_layer_weights(folder, 0, device=False)


@pytest.mark.parametrize("extra, match", [
    ({"num_local_experts": 3}, r"config\.json num_local_experts=3, but the checkpoint has tensors of expert 3"),
    ({"hidden_size": 96}, r"expected shape \[12, 128\] .* hidden_size=96"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
     r"config\.json says model_type 'qwen3_moe', whose experts are named like "
     r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj', but the checkpoint's tensors follow the mixtral naming"),
])
def test_config_contradicting_tensors(ckpt, extra, match):
    folder, _ = _mixtral(ckpt, extra_config=extra)
    with pytest.raises(ValueError, match=match):
        load_layer_weights(folder, 0, device=False)


def test_bits_in_config_contradicting_tensors(ckpt):
    folder, _ = _mixtral(ckpt)
    q = json.loads((folder / "quantize_config.json").read_text())
    q["bits"] = 8
    (folder / "quantize_config.json").write_text(json.dumps(q))
    with pytest.raises(ValueError, match=r"qweight': expected shape \[16, 128\] \(\[K\*bits/32, N\], bits=8, "
                                         r".*got \[8, 128\]"):
        load_layer_weights(folder, 0, device=False)


@pytest.mark.parametrize("written, labeled, stored", [("gptq_v2", "gptq", 8), ("gptq", "gptq_v2", 7)])
def test_sym_format_mislabeled(ckpt, written, labeled, stored):
    folder, _ = _mixtral(ckpt, checkpoint_format=written)
    q = json.loads((folder / "quantize_config.json").read_text())
    q["checkpoint_format"] = labeled
    (folder / "quantize_config.json").write_text(json.dumps(q))
    with pytest.raises(ValueError, match=rf"qzeros': sym=true with checkpoint_format '{labeled}'.* every stored zero "
                                         rf"is {stored}: .*the config contradicts the tensors"):
        load_layer_weights(folder, 0, device=False)


def test_dense_module_where_config_says_quantized(ckpt):
    folder, _ = _mixtral(ckpt, dynamic={r"-:.*experts\.0\.w2": {}})
    q = json.loads((folder / "quantize_config.json").read_text())
    q["dynamic"] = {r"+:.*experts\.0\.w2": {"bits": 4}}  # now the config claims it is quantized
    (folder / "quantize_config.json").write_text(json.dumps(q))
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w2' is stored "
                                         r"dense .* but dynamic rule .* quantizes it"):
        load_layer_weights(folder, 0, device=False)


def test_g_idx_errors(ckpt):
    folder, _ = _mixtral(ckpt, desc_act=True)
    name = "model.layers.0.block_sparse_moe.experts.1.w2.g_idx"
    edit_checkpoint(folder, replace={name: np.full(128, 4, np.int32)})
    with pytest.raises(ValueError, match=rf"tensor '{name}': expected group indices in \[0, 3\] \(ceil\(K/G\) = 4\), "
                                         rf"got range \[4, 4\]"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt, desc_act=True, same_gate_up_g_idx=False)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w3\.g_idx' differs "
                                         r"from '.*experts\.0\.w1\.g_idx': layer 0 w13 stacks both along N"):
        load_layer_weights(folder, 0, device=False)


def test_errors_come_before_any_tensor_data_is_read(ckpt, monkeypatch):
    """Shapes of every tensor are checked from the headers first: nothing is read (or half-built) on error."""
    folder, _ = _mixtral(ckpt)
    edit_checkpoint(folder, replace={"model.layers.0.block_sparse_moe.experts.3.w2.qweight":
                                     np.zeros((15, 64), np.int32)})
    reads = []
    monkeypatch.setattr(SafetensorsFile, "read_into", lambda self, info, out: reads.append(info.name))
    with pytest.raises(ValueError, match=r"experts\.3\.w2\.qweight': expected shape \[16, 64\]"):
        load_layer_weights(folder, 0, device=False)
    assert reads == []


# --------------------------------------------------------------------------- custom families


def test_custom_naming_scheme(ckpt):
    folder, w = ckpt(family="qwen3_moe", num_layers=2)
    edit_checkpoint(folder, rename=lambda n: n.replace("model.layers.", "transformer.h.").replace(".mlp.", ".moe."))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="my_moe", architectures=["MyMoeForCausalLM"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown MoE family \(config\.json model_type 'my_moe'.*pass "
                                         r"scheme=NamingScheme"):
        load_layer_weights(folder, 0, device=False)
    scheme = NamingScheme(family="my_moe", experts="transformer.h.{layer}.moe.experts.{expert}.{proj}",
                          router="transformer.h.{layer}.moe.gate", block="transformer.h.{layer}",
                          renormalize=True)
    layer = load_layer_weights(folder, 1, device=False, scheme=scheme)
    assert layer.family == "my_moe" and layer.renormalize
    renamed = {k.replace("model.layers.", "transformer.h.").replace(".mlp.", ".moe."): v for k, v in w.items()}
    for e in range(4):
        base = f"transformer.h.1.moe.experts.{e}."
        assert_within_half_step(layer.w13, e, np.concatenate([renamed[base + "gate_proj"],
                                                              renamed[base + "up_proj"]], 1))
        assert_within_half_step(layer.w2, e, renamed[base + "down_proj"])
    assert sorted(load_model_weights(folder, device=False, scheme=scheme)) == [0, 1]
    with pytest.raises(ValueError, match=r"NamingScheme\.experts: expected a format string using exactly "
                                         r"\{layer\}, \{expert\} and \{proj\}"):
        NamingScheme(family="x", experts="h.{layer}.experts.{proj}", router="h.{layer}.gate")


# --------------------------------------------------------------------------- whole model, inspection


def test_load_moe_model_progress(ckpt, capsys):
    folder, w = ckpt(family="deepseek_v3", num_layers=3)
    seen = []
    layers = load_model_weights(folder, device=False, progress=lambda done, total, layer: seen.append((done, total,
                                                                                                  layer)))
    assert sorted(layers) == [1, 2] and seen == [(1, 2, 1), (2, 2, 2)]  # layer 0 is dense
    check_layer(layers[2], w, "deepseek_v3")
    load_model_weights(folder, device=False, progress=True)
    err = capsys.readouterr().err
    assert "loading MoE layers" in err and "2/2" in err and "layer 2" in err  # a tqdm bar, forced on
    load_model_weights(folder, device=False)  # stderr is not a terminal under pytest: quiet
    assert capsys.readouterr().err == ""
    assert sorted(load_model_weights(folder, device=False, layers=[2])) == [2]


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_reads_headers_only(ckpt, family, monkeypatch):
    folder, _ = ckpt(family=family, num_layers=2, num_shards=2, desc_act=True)
    monkeypatch.setattr(SafetensorsFile, "read_into", lambda *a: pytest.fail("inspect read tensor data"))
    info = inspect_checkpoint(folder)
    json.dumps(info)  # JSON-serializable for the CLI
    assert info["family"] == family and info["quantization"]["bits"] == 4 and info["quantization"]["desc_act"]
    assert info["moe_layers"] == ([1] if family.startswith("deepseek") else [0, 1])
    assert info["dense_layers"] == ({0: "first_k_dense_replace=1"} if family.startswith("deepseek") else {})
    assert [f["name"] for f in info["files"]] == ["model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"]
    assert info["total_bytes"] == sum(f["bytes"] for f in info["files"])
    lay = info["layers"][-1]
    assert lay["experts_found"] == 4 and lay["experts"] == "gptq" and lay["expert_bytes"] > 0
    n_shared = {"qwen2_moe": 1, "deepseek_v2": 2, "deepseek_v3": 1}.get(family, 0)
    assert lay["shared_experts"] == n_shared and lay["shared_storage"] == ("gptq" if n_shared else None)
    assert [row["layer"] for row in info["layers"]] == [0, 1]  # dense layers listed among the MoE ones
    assert info["layers"][0]["kind"] == ("dense" if family.startswith("deepseek") else "moe")
    assert info["num_experts"] == 4 and info["problems"] == []
    t = info["tensors"]
    assert t["experts"]["I32"]["count"] == 2 * 4 * 3 * 3 // (2 if family.startswith("deepseek") else 1)
    assert sum(d["bytes"] for role in t.values() for d in role.values()) == sum(
        i.nbytes for f in info["files"] for i in SafetensorsFile(folder / f["name"]).tensors.values())
    assert t["router"]["F16"]["count"] == (1 if family.startswith("deepseek") else 2)
    assert bool(t["shared"]) == (n_shared > 0)
    assert info["routing"]["top_k"] == {"value": 2, "source": "config.json num_experts_per_tok"}


def test_inspect_reports_problems(ckpt):
    folder, _ = _mixtral(ckpt, num_shards=2, dynamic={r"-:.*experts\.1\.": {}})
    edit_checkpoint(folder, remove=[f"model.layers.0.block_sparse_moe.experts.3.w2.{s}"
                                    for s in ("qweight", "qzeros", "scales", "g_idx")])
    info = inspect_checkpoint(folder)
    assert info["layers"][0]["experts"] == "mixed"
    assert info["problems"] == ["expert modules with neither '.qweight' nor '.weight' "
                                "(tensor 'model.layers.0.block_sparse_moe.experts.3.w2.qweight')"]
    (folder / "model-00002-of-00002.safetensors").unlink()
    problems = inspect_checkpoint(folder)["problems"]
    assert len(problems) == 2, problems  # one missing shard: one line, not one per tensor; the missing expert
    assert re.fullmatch(r".*model-00002-of-00002\.safetensors: safetensors shard not found: \d+ tensors of "
                        r"model\.safetensors\.index\.json are in it", problems[0])


def test_inspect_lists_a_truncated_file_and_missing_experts_once(ckpt):
    folder, _ = ckpt(family="qwen3_moe", num_layers=2)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-3000])
    info = inspect_checkpoint(folder)
    assert len(info["problems"]) == 1
    assert re.fullmatch(r"model\.safetensors: truncated safetensors file: tensors end past its \d+ bytes "
                        r"\(\d+ tensors, e\.g\. '.*'\)", info["problems"][0])
    with pytest.raises(ValueError, match="truncated safetensors file"):
        load_layer_weights(folder, 1, device=False)
    folder, _ = ckpt(family="qwen3_moe", num_layers=2)
    edit_checkpoint(folder, remove=[n for n in SafetensorsFile(folder / "model.safetensors").tensors
                                    if ".experts.3." in n])
    info = inspect_checkpoint(folder)
    assert info["problems"] == ["expert modules with neither '.qweight' nor '.weight' "
                                "(6 tensors, e.g. 'model.layers.0.mlp.experts.3.gate_proj.qweight')"]
    assert [row["experts_found"] for row in info["layers"]] == [3, 3]
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    info = inspect_checkpoint(folder)  # the config still names the family; the file is one problem
    assert info["family"] == "qwen3_moe" and len(info["problems"]) == 2
    assert info["problems"][0].startswith("model.safetensors: corrupt safetensors header (not valid JSON")


def test_inspect_routing_sources(ckpt):
    folder, _ = ckpt(family="deepseek_v3", num_layers=2, num_experts=8,
                     extra_config=dict(topk_method=None, scoring_func=None, n_group=None, topk_group=2))
    r = inspect_checkpoint(folder)["routing"]
    assert r["topk_method"] == {"value": "noaux_tc",
                                "source": "default for deepseek_v3 (config.json has no topk_method)"}
    assert r["scoring_func"]["value"] == "sigmoid" and r["topk_group"]["source"] == "config.json topk_group"
    assert r["n_group"] == {"value": 8, "source": "default for deepseek_v3 (config.json has no n_group)"}
    folder, _ = ckpt(family="mixtral", extra_config=dict(norm_topk_prob=False))
    info = inspect_checkpoint(folder)
    assert info["routing"]["renormalize"] == {"value": True, "source": "always for mixtral"}
    assert info["routing_error"] is None


def test_inspect_refuses_a_folder_it_cannot_describe(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere: checkpoint folder not found$"):
        inspect_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"checkpoint folder not found \('mistralai/Mixtral-8x7B' looks "
                                                r"like a Hugging Face repository id: download it first"):
        inspect_checkpoint("mistralai/Mixtral-8x7B")
    write_checkpoint(tmp_path / "ck", quant_config_files="quantize_config")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors' is a file: pass the folder that holds it"):
        inspect_checkpoint(tmp_path / "ck" / "model.safetensors")
    (tmp_path / "ck" / "quantize_config.json").unlink()
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'ck'))}: no quantization config"):
        inspect_checkpoint(tmp_path / "ck")


def _set_json(path: Path, **changes):
    """Set (or, with None, delete) top-level keys of a JSON file."""
    data = json.loads(path.read_text())
    for key, val in changes.items():
        if val is None:
            data.pop(key, None)
        else:
            data[key] = val
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("value", ["", ".", "..", "sub/model.safetensors", "/abs/model.safetensors",
                                   "../other/model.safetensors"])
def test_index_entries_must_name_files_in_the_folder(ckpt, value):
    folder, _ = _mixtral(ckpt, num_shards=2)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = "model.layers.0.block_sparse_moe.gate.weight"
    data["weight_map"][name] = value
    index.write_text(json.dumps(data))
    match = rf"model\.safetensors\.index\.json: weight_map\['{re.escape(name)}'\] = {re.escape(repr(value))}: " \
            r"expected the name of a file in the checkpoint folder"
    for call in (lambda: load_layer_weights(folder, 0, device=False), lambda: inspect_checkpoint(folder)):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("content, match", [
    (b'{"model_type": "\xff"}', r"config\.json: expected UTF-8 JSON text, got undecodable bytes"),
    (b"[" * 100000 + b"]" * 100000, r"config\.json: not valid JSON for this reader: nested too deeply"),
    (None, r"config\.json: expected a JSON file, got a directory"),
])
def test_unreadable_config_json(ckpt, content, match):
    folder, _ = _mixtral(ckpt, quant_config_files="quantize_config")
    if content is None:
        (folder / "config.json").unlink()
        (folder / "config.json").mkdir()
    else:
        (folder / "config.json").write_bytes(content)
    for call in (lambda: load_layer_weights(folder, 0, device=False), lambda: inspect_checkpoint(folder)):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("quant_method, key, value, expected", [
    ("gptq", "modules_in_block_to_quantize", [None], "a list of strings or of lists of strings"),
    ("gptq", "modules_in_block_to_quantize", 5, "a list of strings or of lists of strings"),
    ("gptq", "modules_in_block_to_quantize", [[1, 2]], "a list of strings or of lists of strings"),
    ("awq", "modules_to_not_convert", 7, "a list of strings"),
    ("awq", "modules_to_not_convert", "lm_head", "a list of strings"),
])
def test_quant_config_lists_of_the_wrong_type(ckpt, quant_method, key, value, expected):
    folder, _ = ckpt(family="mixtral", quant_method=quant_method, quant_config_files="quantize_config",
                     extra_quant_config={key: value})
    match = rf"quantize_config\.json: {key}: expected {expected}, got {re.escape(repr(value))}"
    for call in (lambda: load_layer_weights(folder, 0, device=False), lambda: inspect_checkpoint(folder)):
        with pytest.raises(TypeError, match=match):
            call()


@pytest.mark.parametrize("extra, match", [
    ({"hidden_size": 0}, r"layer \d w13: expected positive sizes, got K=0, N=128 \+ 128 \(from config\.json "
                         r"hidden_size=0"),
    ({"intermediate_size": 0}, r"layer \d w13: expected positive sizes, got K=64, N=0 \+ 0"),
    ({"num_local_experts": 0}, r"config\.json num_local_experts=0: expected 1 to 4096 experts"),
    ({"num_local_experts": -3}, r"config\.json num_local_experts=-3: expected 1 to 4096 experts"),
    ({"num_local_experts": 2 ** 40}, r"config\.json num_local_experts=1099511627776: expected 1 to 4096 experts"),
    ({"num_hidden_layers": 2 ** 40}, r"config\.json num_hidden_layers=1099511627776: expected 1 to 100000 layers"),
])
def test_sizes_and_counts_out_of_range(ckpt, extra, match):
    folder, _ = _mixtral(ckpt, group_size=-1, num_layers=2, extra_config=extra)
    for layer in (0, 1):
        with pytest.raises(ValueError, match=match):
            load_layer_weights(folder, layer, device=False)
    if "hidden_size" not in extra and "intermediate_size" not in extra:
        assert re.fullmatch(match, inspect_checkpoint(folder)["problems"][0])


def test_inspect_work_follows_the_tensors_present(ckpt):
    folder, _ = _mixtral(ckpt, num_layers=2, extra_config={"num_local_experts": 4097})
    assert inspect_checkpoint(folder)["problems"] == ["config.json num_local_experts=4097: expected 1 to 4096 experts"]
    _set_json(folder / "config.json", num_local_experts=4096)  # within the limit: the missing ones, in one line
    assert inspect_checkpoint(folder)["problems"] == [
        "expert modules with neither '.qweight' nor '.weight' (24552 tensors, e.g. "
        "'model.layers.0.block_sparse_moe.experts.4.w1.qweight')"]
    _set_json(folder / "config.json", num_local_experts=4, num_hidden_layers=100_001)
    info = inspect_checkpoint(folder)  # an absurd layer count: the layers the tensors have
    assert info["problems"] == ["config.json num_hidden_layers=100001: expected 1 to 100000 layers"]
    assert info["moe_layers"] == [0, 1] and info["num_layers"] is None
    _set_json(folder / "config.json", num_hidden_layers=1000)  # layers without tensors: one line
    info = inspect_checkpoint(folder)
    assert info["problems"] == ["MoE layers without any tensors (998 layers, e.g. 'model.layers.2.*')"]
    assert len(info["layers"]) == 1000


def test_stray_expert_or_layer_tensor(ckpt):
    folder, _ = _mixtral(ckpt, extra_config={"num_local_experts": None, "num_hidden_layers": None})
    stray = "model.layers.0.block_sparse_moe.experts.100000000.w1"
    edit_checkpoint(folder, rename=lambda n: n.replace(".experts.3.w1.", ".experts.100000000.w1."))
    match = (rf"tensor '{re.escape(stray)}\.\*' \(in model\.safetensors\) is of expert 100000000, beyond the limit "
             rf"of 4096 experts")
    with pytest.raises(ValueError, match=match):
        load_layer_weights(folder, 0, device=False)
    problems = inspect_checkpoint(folder)["problems"]
    assert re.fullmatch(match, problems[0]) and len(problems) == 2, problems  # + the stray expert's missing w3, w2
    _set_json(folder / "config.json", num_local_experts=4)
    with pytest.raises(ValueError, match=r"config\.json num_local_experts=4, but the checkpoint has tensors of "
                                         r"expert 100000000"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt, extra_config={"num_hidden_layers": None})
    edit_checkpoint(folder, rename=lambda n: n.replace("layers.0.input_layernorm", "layers.100000000.input_layernorm"))
    info = inspect_checkpoint(folder)
    assert info["problems"][0] == ("tensor 'model.layers.100000000.input_layernorm.weight' (in model.safetensors) is "
                                   "of layer 100000000, beyond the limit of 100000 layers (config.json has no "
                                   "num_hidden_layers)")
    assert info["moe_layers"] == [0, 100000000]
    with pytest.raises(ValueError, match=r"beyond the limit of 100000 layers"):
        load_model_weights(folder, device=False)
    assert load_layer_weights(folder, 0, device=False).num_experts == 4  # layer 0 itself is fine


@pytest.mark.parametrize("family, extra, error, match", [
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, ValueError,
     r"config\.json shared_expert_intermediate_size=-1: expected a positive int"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, ValueError,
     r"config\.json shared_expert_intermediate_size=0: expected a positive int"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 256.0}, TypeError,
     r"config\.json shared_expert_intermediate_size: expected a positive int, got 256\.0"),
    ("qwen2_moe", {"shared_expert_intermediate_size": "256"}, TypeError,
     r"config\.json shared_expert_intermediate_size: expected a positive int, got '256'"),
    ("deepseek_v2", {"n_shared_experts": -2}, ValueError, r"config\.json n_shared_experts=-2: expected a positive int"),
    ("deepseek_v2", {"n_shared_experts": 0}, ValueError, r"config\.json n_shared_experts=0: expected a positive int"),
])
def test_shared_expert_sizes(ckpt, family, extra, error, match):
    folder, _ = ckpt(family=family, extra_config=extra)
    with pytest.raises(error, match=match):
        load_layer_weights(folder, 0, device=False)
    assert any(re.match(match, p) for p in inspect_checkpoint(folder)["problems"])


def test_shared_expert_config_without_shared_tensors(ckpt):
    folder, _ = ckpt(family="deepseek_v2")
    edit_checkpoint(folder, remove=[n for n in SafetensorsFile(folder / "model.safetensors").tensors
                                    if ".shared_experts." in n])
    with pytest.raises(ValueError, match=r"config\.json n_shared_experts=2 describes a shared expert, but layer 0 "
                                         r"has none: neither '.*\.mlp\.shared_experts\.down_proj\.qweight'"):
        load_layer_weights(folder, 0, device=False)
    assert inspect_checkpoint(folder)["problems"] == [
        "config.json n_shared_experts=2 describes a shared expert, but a layer has none "
        "(tensor 'model.layers.0.mlp.shared_experts.down_proj.qweight')"]
    _set_json(folder / "config.json", n_shared_experts=None)  # the config agrees: no shared expert
    assert load_layer_weights(folder, 0, device=False).shared is None


def test_optional_tensors_all_or_none(ckpt):
    folder, _ = _mixtral(ckpt, desc_act=True)
    edit_checkpoint(folder, remove=[n for n in SafetensorsFile(folder / "model.safetensors").tensors
                                    if n.endswith(".g_idx")])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.g_idx' is "
                                         r"missing: expected I32 \[64\] .*desc_act=true in quantize_config\.json "
                                         r"\(act-order\) needs it"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt)  # no act-order, but one expert lacks the g_idx the others have
    edit_checkpoint(folder, remove=["model.layers.0.block_sparse_moe.experts.2.w3.g_idx"])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.2\.w3\.g_idx' is "
                                         r"missing, but '.*experts\.0\.w1\.g_idx' exists \(7 of the 8 modules of "
                                         r"layer 0 w13 have one\)"):
        load_layer_weights(folder, 0, device=False)
    folder, _ = _mixtral(ckpt, bias=True)
    edit_checkpoint(folder, remove=["model.layers.0.block_sparse_moe.experts.2.w2.bias"])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.2\.w2\.bias' is "
                                         r"missing, but '.*experts\.0\.w2\.bias' exists \(3 of the 4 modules of "
                                         r"layer 0 w2 have one\)"):
        load_layer_weights(folder, 0, device=False)


# --------------------------------------------------------------------------- memory


def test_peak_memory_within_twice_the_packed_layer(tmp_path):
    """Peak RSS while loading a ~6 MB layer stays within 2x its packed bytes (measured in a fresh process)."""
    if not _peak_rss.can_reset_peak():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS counter")
    write_checkpoint(tmp_path, family="mixtral", hidden=512, intermediate=1024, num_experts=8, group_size=128,
                     num_shards=2, return_weights=False)
    r = _peak_rss.measure("from cupy_moe.checkpoint import load_layer_weights",
                          "result_bytes = load_layer_weights(args[0], 0, device=False).nbytes", tmp_path)
    assert r["peak_reset"] and r["result_bytes"] > 6_000_000
    assert r["extra_peak_bytes"] <= 2 * r["result_bytes"], r


# --------------------------------------------------------------------------- device


@pytest.mark.gpu
def test_device_load_matches_host(ckpt):
    import cupy
    folder, _ = ckpt(family="qwen2_moe", desc_act=True, sym=False, bits=8)
    host, dev = load_layer_weights(folder, 0, device=False), load_layer_weights(folder, 0, device=True)
    assert dev.w13.is_device and isinstance(dev.router_weight, cupy.ndarray) and dev.shared.gate_up.is_device
    for proj in ("w13", "w2"):
        for field in ("qweight", "scales", "qzeros", "g_idx"):
            np.testing.assert_array_equal(cupy.asnumpy(getattr(getattr(dev, proj), field)),
                                          getattr(getattr(host, proj), field))
    w2 = StackedGptqWeight.from_safetensors(folder, 0, "w2")  # device=True by default
    assert w2.is_device
