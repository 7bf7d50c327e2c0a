"""compressed-tensors (llm-compressor) `pack-quantized` checkpoints: written by cupy_moe.testing with the reference
quantizer, loaded into the same StackedGptqWeight layout as GPTQ, run on the NumPy path; every refused scheme.

The writer quantizes exactly as for GPTQ (same seed, same values), so a compressed-tensors checkpoint must load
into stacks identical to the gptq_v2 checkpoint of the same arguments: weight_packed [N, K*bits/32] holds
GPTQ's words transposed, weight_zero_point [N*bits/32, R] GPTQ's real-zero words transposed (compressed-tensors
stores signed values + 2**(bits-1), the same unsigned codes).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import cupy_moe
from cupy_moe import _packing
from cupy_moe.checkpoint import inspect_checkpoint, load_layer_weights
from cupy_moe.checkpoint.safetensors import SafetensorsFile
from cupy_moe.testing import FAMILIES, dense_layer_output, edit_checkpoint, write_checkpoint

from tolerances import REL_L2

CT = "compressed-tensors"


def _both(tmp_path, **kw):
    """(gptq_v2 layer, compressed-tensors layer) written from the same floats."""
    write_checkpoint(tmp_path / "gptq", checkpoint_format="gptq_v2", **kw)
    write_checkpoint(tmp_path / "ct", quant_method=CT, **kw)
    layer = kw.get("num_layers", 1) - 1
    return (load_layer_weights(tmp_path / "gptq", layer, device=False),
            load_layer_weights(tmp_path / "ct", layer, device=False))


def _assert_same_stacks(a, b):
    pairs = [("w13", a.w13, b.w13), ("w2", a.w2, b.w2)]
    if a.shared is not None:
        pairs += [("shared gate_up", a.shared.gate_up, b.shared.gate_up), ("shared down", a.shared.down, b.shared.down)]
    for what, x, y in pairs:
        assert (x.bits, x.group_size) == (y.bits, y.group_size), what
        for field in ("qweight", "scales", "qzeros", "g_idx"):
            u, v = getattr(x, field), getattr(y, field)
            assert (u is None) == (v is None), f"{what}.{field}"
            if u is not None:
                np.testing.assert_array_equal(u, v, f"{what}.{field}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits,sym,desc_act,group_size", [(4, True, False, 32), (4, False, True, 32),
                                                          (8, False, False, -1), (8, True, True, 32)])
def test_loads_like_the_same_gptq_checkpoint(tmp_path, family, bits, sym, desc_act, group_size):
    a, b = _both(tmp_path, family=family, num_layers=2, bits=bits, sym=sym, desc_act=desc_act,
                 group_size=group_size, scales_dtype="bfloat16", return_weights=False)
    _assert_same_stacks(a, b)
    assert (b.w13.qzeros is None) == sym and (b.w13.g_idx is not None) == (desc_act and group_size != -1)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_runs_against_the_reference(tmp_path, family):
    write_checkpoint(tmp_path, family=family, quant_method=CT, hidden=128, intermediate=192, num_experts=8,
                     sym=False, desc_act=True, group_size=64, num_shards=3, return_weights=False)
    layer = cupy_moe.load_moe_layer(tmp_path, 0, device=False)
    x = np.random.default_rng(0).standard_normal((7, 128)).astype(np.float16)
    y = layer(x)
    err = np.linalg.norm(y.astype(np.float64) - dense_layer_output(layer, x)) / np.linalg.norm(
        dense_layer_output(layer, x))
    assert err <= REL_L2["float16"]


def test_file_layout_is_compressed_tensors(tmp_path):
    """The written tensors decode with compressed-tensors' own rule: signed value + 8 packed lowest first."""
    w = write_checkpoint(tmp_path, family="qwen3_moe", quant_method=CT, sym=False, group_size=32)
    m = "model.layers.0.mlp.experts.1.down_proj"
    f = SafetensorsFile(tmp_path / "model.safetensors")
    get = lambda s: f.read(f.tensors[f"{m}.{s}"])  # noqa: E731
    packed, scale, zp = get("weight_packed"), get("weight_scale"), get("weight_zero_point")
    assert packed.shape == (64, 128 // 8) and scale.shape == (64, 4) and zp.shape == (64 // 8, 4)
    assert list(get("weight_shape")) == [64, 128]
    shifts = np.arange(8) * 4
    q = ((packed.view(np.uint32)[:, :, None] >> shifts) & 15).reshape(64, 128).astype(np.int32) - 8  # [N, K]
    z = ((zp.view(np.uint32).T[:, :, None] >> shifts) & 15).reshape(4, 64).astype(np.int32) - 8  # [R, N]
    deq = (q - z.T.repeat(32, axis=1)) * scale.astype(np.float32).repeat(32, axis=1)  # [N, K]
    err = np.abs(deq.T - w[m])
    assert err.max() <= 0.51 * scale.astype(np.float32).max()
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and not (tmp_path / "quantize_config.json").exists()
    info = inspect_checkpoint(tmp_path)
    assert info["quantization"]["method"] == CT and info["layers"][0]["experts"] == CT
    assert info["quantization"]["config_groups"] == ["group_0"] and info["problems"] == []


def test_unpacked_int8_zero_points(tmp_path):
    """Older compressed-tensors files keep zero points unpacked: int8 [N, R], signed."""
    write_checkpoint(tmp_path, family="mixtral", quant_method=CT, sym=False, group_size=32)
    before = load_layer_weights(tmp_path, 0, device=False)
    f = SafetensorsFile(tmp_path / "model.safetensors")
    names = [n for n in f.tensors if n.endswith(".weight_zero_point")]
    replace = {n: (_packing.unpack(np.ascontiguousarray(f.read(f.tensors[n]).T), 4).T.astype(np.int16) - 8)
               .astype(np.int8) for n in names}
    f.close()
    edit_checkpoint(tmp_path, replace=replace)
    _assert_same_stacks(before, load_layer_weights(tmp_path, 0, device=False))


def test_config_groups_by_regex_and_ignore(tmp_path):
    """Groups target module-name regexes; ignored modules and modules no group targets stay dense."""
    write_checkpoint(tmp_path, family="qwen3_moe", quant_method=CT, quantize_shared=False,
                     extra_quant_config={"config_groups": {"experts": {
                         "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], "format": "pack-quantized",
                         "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                     "group_size": 32}}}})
    layer = load_layer_weights(tmp_path, 0, device=False)
    assert layer.w13.bits == 4
    info = inspect_checkpoint(tmp_path)
    assert info["quantization"]["config_groups"] == ["experts"] and info["problems"] == []
    write_checkpoint(tmp_path, family="qwen3_moe", quant_method=CT,
                     extra_quant_config={"ignore": [r"re:.*experts\.2\..*"]})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.2\.gate_proj\.weight_packed' exists, "
                                         r"but ignore entry 're:\.\*experts\\\.2\\\.\.\*' in "
                                         r"config\.json\['quantization_config'\] says module .* is not quantized"):
        load_layer_weights(tmp_path, 0, device=False)


GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                            "group_size": 32}, "format": "pack-quantized"}


def _group(**changes):
    g = json.loads(json.dumps(GROUP))
    for key, val in changes.items():
        if key in g["weights"] or key in ("type", "dynamic", "actorder", "num_bits", "strategy"):
            g["weights"][key] = val
        else:
            g[key] = val
    return {"group_0": g}


@pytest.mark.parametrize("extra,match", [
    ({"format": "float-quantized", "config_groups": _group(format="float-quantized", type="float", num_bits=8)},
     r"config_groups\['group_0'\] format='float-quantized' is not supported: FP8 weights"),
    ({"config_groups": _group(input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                                 "dynamic": True})},
     r"config_groups\['group_0'\] input_activations=.* is not supported: quantized activations \(W8A8"),
    ({"format": "int-quantized", "config_groups": _group(format="int-quantized")},
     r"format='int-quantized' is not supported: int8 weights with int8 activations"),
    ({"format": "naive-quantized", "config_groups": _group(format="naive-quantized")},
     r"format='naive-quantized' is not supported: unpacked int8 weights"),
    ({"format": "marlin-24", "config_groups": _group(format="marlin-24")},
     r"format='marlin-24' is not supported: 2:4-sparse Marlin weights"),
    ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}},
     r"sparsity_config format='sparse-24-bitmask' is not supported: sparse \(2:4\) weights"),
    ({"config_groups": _group(type="float")}, r"weights\.type='float' is not supported"),
    ({"config_groups": _group(strategy="tensor")}, r"weights\.strategy='tensor' is not supported"),
    ({"config_groups": _group(num_bits=2)}, r"weights\.num_bits=2 is not supported"),
    ({"config_groups": _group(dynamic=True)}, r"weights\.dynamic=True is not supported"),
    ({"config_groups": _group(targets=["MixtralSparseMoeBlock"])},
     r"config_groups\['group_0'\] targets 'MixtralSparseMoeBlock': cannot be mapped to tensor names"),
    ({"config_groups": {"a": GROUP, "b": GROUP}}, r"config_groups\['b'\] targets 'Linear', as another group does"),
    ({"quantization_status": "frozen"}, r"quantization_status='frozen' is not supported"),
    ({"transform_config": {"config_groups": {"u": {}}}}, r"transform_config is not supported"),
])
def test_refused_schemes(tmp_path, extra, match):
    write_checkpoint(tmp_path, family="mixtral", quant_method=CT, extra_quant_config=extra)
    with pytest.raises(ValueError, match=match) as exc:
        load_layer_weights(tmp_path, 0, device=False)
    assert str(exc.value).startswith("config.json['quantization_config']: ")
    with pytest.raises(ValueError, match=match):
        inspect_checkpoint(tmp_path)


@pytest.mark.parametrize("extra,error,match", [
    ({"ignore": ["lm_head", "re:[oops"]}, ValueError,
     r"ignore entry 're:\[oops' is not a valid regular expression \(unterminated character set"),
    ({"config_groups": _group(targets=["re:(.*experts"])}, ValueError,
     r"config_groups\['group_0'\] target 're:\(\.\*experts' is not a valid regular expression"),
    ({"config_groups": _group(targets="Linear")}, TypeError,
     r"config_groups\['group_0'\] targets: expected a list of strings, got 'Linear'"),
    ({"ignore": "lm_head"}, TypeError, r"ignore: expected a list of strings, got 'lm_head'"),
    ({"ignore": [["lm_head"]]}, TypeError, r"ignore: expected a list of strings, got \[\['lm_head'\]\]"),
    ({"format": ["pack-quantized"], "config_groups": _group(format=None)}, TypeError,
     r"config_groups\['group_0'\] format: expected a string such as 'pack-quantized', got \['pack-quantized'\]"),
])
def test_patterns_and_lists_checked_when_parsed(tmp_path, extra, error, match):
    write_checkpoint(tmp_path, family="mixtral", quant_method=CT, extra_quant_config=extra)
    with pytest.raises(error, match=r"config\.json\['quantization_config'\]: " + match):
        load_layer_weights(tmp_path, 0, device=False)
    with pytest.raises(error, match=match):
        inspect_checkpoint(tmp_path)


def test_actorder_group_needs_every_g_idx(tmp_path):
    write_checkpoint(tmp_path, family="qwen3_moe", quant_method=CT, desc_act=True)
    g_idx = [n for n in SafetensorsFile(tmp_path / "model.safetensors").tensors if n.endswith(".weight_g_idx")]
    edit_checkpoint(tmp_path, remove=g_idx[:1])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight_g_idx' is "
                                         r"missing: .*desc_act=true .*needs it"):
        load_layer_weights(tmp_path, 0, device=False)
    edit_checkpoint(tmp_path, remove=g_idx[1:])
    with pytest.raises(ValueError, match=r"weight_g_idx' is missing: .*desc_act=true .*needs it"):
        load_layer_weights(tmp_path, 0, device=False)


def test_tensor_errors_name_the_compressed_tensors_layout(tmp_path):
    write_checkpoint(tmp_path, family="mixtral", quant_method=CT, sym=False, group_size=32)
    m = "model.layers.0.block_sparse_moe.experts.1.w3"
    edit_checkpoint(tmp_path, replace={f"{m}.weight_scale": np.ones((4, 128), np.float16)})
    with pytest.raises(ValueError, match=rf"tensor '{m}\.weight_scale': expected shape \[128, 2\] \(\[N, ceil\(K/G\)\]"):
        load_layer_weights(tmp_path, 0, device=False)
    write_checkpoint(tmp_path, family="mixtral", quant_method=CT)
    edit_checkpoint(tmp_path, replace={f"{m}.weight_shape": np.array([128, 32], np.int64)})
    with pytest.raises(ValueError, match=rf"tensor '{m}\.weight_shape' says \[128, 32\], but the packed tensors hold "
                                         r"\[N, K\] = \[128, 64\]"):
        load_layer_weights(tmp_path, 0, device=False)
