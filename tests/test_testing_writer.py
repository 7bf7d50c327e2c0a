"""The checkpoint writer (cupy_moe.testing): valid safetensors, genuine GPTQ conventions, reproducible.

Loading round trips live in test_checkpoint.py; this file checks the files themselves with safetensors'
own reader and the constants of docs/gptq_layout.md, independently of cupy_moe.checkpoint.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from cupy_moe import reference as R
from cupy_moe import testing as T
from cupy_moe.checkpoint.safetensors import bf16_to_f32
from cupy_moe.testing import FAMILIES, edit_checkpoint, write_checkpoint


def all_tensors(folder):
    """{name: (dtype, shape, array or None for BF16)} over every file, read with safetensors."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "numpy") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()),
                             None if sl.get_dtype() == "BF16" else f.get_tensor(name))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_files_are_valid_safetensors_with_family_names(tmp_path, family):
    write_checkpoint(tmp_path, family=family, num_layers=2, num_shards=3)
    tensors = all_tensors(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, _, a in tensors.values())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["quantization_config"]["checkpoint_format"] == "gptq"
    assert json.loads((tmp_path / "quantize_config.json").read_text()) == cfg["quantization_config"]
    moe_layer = 1 if family.startswith("deepseek") else 0
    expert = {"mixtral": f"model.layers.{moe_layer}.block_sparse_moe.experts.3.w2"}.get(
        family, f"model.layers.{moe_layer}.mlp.experts.3.down_proj")
    assert tensors[expert + ".qweight"][:2] == ("I32", (16, 64))  # [I*4/32, H]
    assert tensors[expert + ".qzeros"][:2] == ("I32", (4, 8))  # [I/G, H*4/32]
    assert tensors[expert + ".scales"][:2] == ("F16", (4, 64))
    assert tensors[expert + ".g_idx"][:2] == ("I32", (128,))
    router = ("model.layers.{}.block_sparse_moe.gate.weight" if family == "mixtral"
              else "model.layers.{}.mlp.gate.weight")
    assert tensors[router.format(moe_layer)][:2] == ("F16", (4, 64))
    if family.startswith("deepseek"):  # dense first layer, quantized like the experts
        assert tensors["model.layers.0.mlp.down_proj.qweight"][:2] == ("I32", (32, 64))
        assert cfg["first_k_dense_replace"] == 1
    if family == "deepseek_v3":
        assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"][:2] == ("F32", (4,))
    if family == "qwen2_moe":
        assert tensors["model.layers.0.mlp.shared_expert_gate.weight"][:2] == ("F16", (1, 64))
        assert tensors["model.layers.0.mlp.shared_expert.up_proj.qweight"][:2] == ("I32", (8, 256))


@pytest.mark.parametrize("bits, fmt, word", [(4, "gptq", 0x77777777), (4, "gptq_v2", 0x88888888),
                                             (8, "gptq", 0x7F7F7F7F), (2, "gptq", 0x55555555)])
def test_sym_qzeros_constants(tmp_path, bits, fmt, word):
    """docs/gptq_layout.md: every sym qzeros word is one constant (v1 stores zero - 1)."""
    write_checkpoint(tmp_path, bits=bits, checkpoint_format=fmt)
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        qz = f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.qzeros")
    assert (qz.view(np.uint32) == word).all()


def test_returned_floats_are_what_was_quantized(tmp_path):
    w = write_checkpoint(tmp_path, desc_act=True)
    name = "model.layers.0.block_sparse_moe.experts.1.w3"
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        t = {s: f.get_tensor(f"{name}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")}
        gate_g = f.get_tensor(name.replace("w3", "w1") + ".g_idx")
    q = R.quantize(w[name], bits=4, group_size=32, sym=True, g_idx=t["g_idx"])
    for key in ("qweight", "qzeros", "scales"):
        np.testing.assert_array_equal(getattr(q, key), t[key])
    np.testing.assert_array_equal(gate_g, t["g_idx"])  # gate and up share act-order groups
    assert not np.all(np.diff(t["g_idx"]) >= 0)  # act-order: non-monotone
    assert np.bincount(t["g_idx"]).tolist() == [32, 32]  # each group has G members


def test_column_chunked_quantize_is_bit_identical():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 3 * T._QUANT_CHUNK + 64), dtype=np.float32)
    g = R.act_order_g_idx(64, 32, rng)
    a, b = T._quantize(w, 4, 32, False, g), R.quantize(w, bits=4, group_size=32, sym=False, g_idx=g)
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key))


def test_reproducible_from_seed(tmp_path):
    a = write_checkpoint(tmp_path / "a", family="qwen2_moe", num_shards=2, seed=7)
    b = write_checkpoint(tmp_path / "b", family="qwen2_moe", num_shards=2, seed=7)
    write_checkpoint(tmp_path / "c", family="qwen2_moe", num_shards=2, seed=8)
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
        assert (tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_bf16_written_as_bits(tmp_path):
    w = write_checkpoint(tmp_path, scales_dtype="bfloat16", dense_dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = all_tensors(tmp_path)
    assert tensors["model.layers.0.block_sparse_moe.experts.0.w1.scales"][0] == "BF16"
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"][0] == "BF16"
    # round to nearest even: halfway cases go to the even 7-bit mantissa
    x = np.array([1.0, -2.5, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, 65504.0], np.float32)
    np.testing.assert_array_equal(bf16_to_f32(T._to_bf16_bits(x)),
                                  [1.0, -2.5, 1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7, 65536.0])
    # router values returned are exactly the stored bf16 values
    r = w["model.layers.0.block_sparse_moe.gate"]
    np.testing.assert_array_equal(bf16_to_f32(T._to_bf16_bits(r)), r)


def test_dynamic_exclusion_and_override_written(tmp_path):
    write_checkpoint(tmp_path, num_layers=2, dynamic={r"-:.*experts\.0\.w2": {},
                                                      r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 64}})
    tensors = all_tensors(tmp_path)
    assert tensors["model.layers.0.block_sparse_moe.experts.0.w2.weight"][:2] == ("F16", (64, 128))  # [N, K]
    assert "model.layers.0.block_sparse_moe.experts.0.w2.qweight" not in tensors
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in tensors  # first match wins: excluded too
    assert tensors["model.layers.1.block_sparse_moe.experts.1.w2.qweight"][:2] == ("I32", (32, 64))  # 8-bit
    assert tensors["model.layers.1.block_sparse_moe.experts.1.w2.scales"][:2] == ("F16", (2, 64))  # G=64


def test_awq_layout(tmp_path):
    w = write_checkpoint(tmp_path, quant_method="awq", sym=False)
    name = "model.layers.0.block_sparse_moe.experts.0.w1"
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        qw, qz, sc = (f.get_tensor(f"{name}.{s}") for s in ("qweight", "qzeros", "scales"))
        assert f"{name}.g_idx" not in f.keys()
    # Unpack AWQ by its definition (nibble i of word c = column 8c + order[i]) and dequantize.
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def unpack(words):
        u = words.view(np.uint32)
        out = np.empty((u.shape[0], u.shape[1] * 8), np.int64)
        for c in range(u.shape[1]):
            for i in range(8):
                out[:, 8 * c + order[i]] = (u[:, c] >> (4 * i)) & 15
        return out
    codes, zeros = unpack(qw), unpack(qz)
    deq = sc.astype(np.float32)[np.arange(64) // 32] * (codes - zeros[np.arange(64) // 32])
    assert np.abs(deq - w[name]).max() <= 0.51 * sc.astype(np.float32).max()
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": None}


def test_edit_checkpoint(tmp_path):
    write_checkpoint(tmp_path, num_shards=2)
    name = "model.layers.0.block_sparse_moe.experts.0.w1.qweight"
    edit_checkpoint(tmp_path, replace={name: np.ones((8, 96), np.int32), "extra.tensor": np.zeros(3, np.float16)},
                    remove=["model.layers.0.block_sparse_moe.gate.weight"])
    tensors = all_tensors(tmp_path)
    assert tensors[name][1] == (8, 96) and (tensors[name][2] == 1).all()
    assert "extra.tensor" in tensors and "model.layers.0.block_sparse_moe.gate.weight" not in tensors
    assert set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == set(tensors)


@pytest.mark.parametrize("kwargs, match", [
    ({"family": "llama"}, r"family: expected one of"),
    ({"quant_method": "awq", "bits": 8}, r"quant_method='awq': expected bits=4 and desc_act=False"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format: expected 'gptq' or 'gptq_v2', got 'marlin'"),
    ({"scales_dtype": "int8"}, r"scales_dtype: expected 'float16', 'bfloat16' or 'float32'"),
    ({"num_shards": 0}, r"num_shards: expected >= 1, got 0"),
    ({"first_k_dense_replace": 1}, r"first_k_dense_replace: only the deepseek families"),
    ({"family": "deepseek_v2", "shared_intermediate": 100}, r"shared_intermediate: expected a multiple of"),
])
def test_writer_argument_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_checkpoint(tmp_path, **kwargs)
