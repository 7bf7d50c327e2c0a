"""Every tensor naming real checkpoints use, recognised from the tensors; routing settings read from config.json
with each family's transformers defaults when a key is absent, and the key spellings transformers 5 writes."""
from __future__ import annotations

import numpy as np
import pytest

import cupy_moe
from cupy_moe.checkpoint import NAMINGS, SCHEMES, inspect_checkpoint, load_layer_weights
from cupy_moe.testing import write_checkpoint

H, I, E = 64, 128, 8


def _stacks_equal(a, b):
    for proj in ("w13", "w2"):
        for field in ("qweight", "scales", "qzeros", "g_idx"):
            x, y = getattr(getattr(a, proj), field), getattr(getattr(b, proj), field)
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.router_weight, b.router_weight)


@pytest.mark.parametrize("naming", [n for n in NAMINGS if n.family == "mixtral"], ids=lambda n: n.naming)
def test_every_mixtral_naming_loads(tmp_path, naming):
    write_checkpoint(tmp_path / "default", family="mixtral", desc_act=True, return_weights=False)
    write_checkpoint(tmp_path / "this", family="mixtral", naming=naming.naming, desc_act=True, return_weights=False)
    got = load_layer_weights(tmp_path / "this", 0, device=False)
    assert got.family == "mixtral" and got.renormalize
    _stacks_equal(got, load_layer_weights(tmp_path / "default", 0, device=False))
    info = inspect_checkpoint(tmp_path / "this")
    assert (info["family"], info["naming"], info["problems"]) == ("mixtral", naming.naming, [])


@pytest.mark.parametrize("naming", NAMINGS, ids=lambda n: f"{n.family}-{n.naming}")
def test_naming_recognised_from_the_tensors_alone(tmp_path, naming):
    write_checkpoint(tmp_path, family=naming.family, naming=naming.naming or None, num_layers=2,
                     quant_config_files="quantize_config", return_weights=False)
    (tmp_path / "config.json").unlink()
    info = inspect_checkpoint(tmp_path)
    if naming.naming == "mlp.gate_proj":  # the same tensors as a Qwen3-MoE: only config.json tells them apart
        assert info["family"] == "qwen3_moe"
    else:
        assert (info["family"], info["naming"]) == (naming.family, naming.naming)


def test_qwen3_naming_under_a_mixtral_config_is_mixtral(tmp_path):
    """GPTQModel 7 on transformers 5 writes Mixtral experts under mlp: config.json says mixtral, so it is."""
    write_checkpoint(tmp_path, family="qwen3_moe", extra_config={"model_type": "mixtral",
                                                                 "architectures": ["MixtralForCausalLM"],
                                                                 "num_local_experts": 4, "intermediate_size": 128},
                     return_weights=False)
    w = load_layer_weights(tmp_path, 0, device=False)
    assert (w.family, w.renormalize, w.num_experts) == ("mixtral", True, 4)


def test_transformers_5_expert_count_key(tmp_path):
    write_checkpoint(tmp_path, family="qwen3_moe", num_experts=E,
                     extra_config={"num_experts": None, "num_local_experts": E, "norm_topk_prob": None},
                     return_weights=False)
    assert load_layer_weights(tmp_path, 0, device=False).num_experts == E
    info = inspect_checkpoint(tmp_path)
    assert (info["num_experts"], info["num_experts_key"]) == (E, "num_local_experts")
    assert info["routing"]["renormalize"] == {"value": False,
                                              "source": "default for qwen3_moe (config.json has no norm_topk_prob)"}


def _route(folder, x):
    layer = cupy_moe.load_moe_layer(folder, 0, device=False)
    return layer, layer.route(x)


def test_deepseek_v3_without_topk_method_is_group_limited(tmp_path):
    """transformers 5 writes no topk_method/scoring_func for DeepSeek-V3; its router is always noaux_tc."""
    common = dict(family="deepseek_v3", hidden=H, intermediate=I, num_experts=E, top_k=2, return_weights=False)
    write_checkpoint(tmp_path / "t5", **common, extra_config=dict(topk_method=None, scoring_func=None, n_group=4,
                                                                  topk_group=1))
    write_checkpoint(tmp_path / "explicit", **common, extra_config=dict(n_group=4, topk_group=1))
    write_checkpoint(tmp_path / "greedy", **common, extra_config=dict(topk_method="greedy", n_group=4, topk_group=1))
    x = np.random.default_rng(3).standard_normal((64, H)).astype(np.float16)
    layer, (w5, i5) = _route(tmp_path / "t5", x)
    assert (layer.weights.topk_method, layer.weights.scoring_func) == ("noaux_tc", "sigmoid")
    _, (we, ie) = _route(tmp_path / "explicit", x)
    np.testing.assert_array_equal(i5, ie)
    np.testing.assert_array_equal(w5, we)
    _, (_, ig) = _route(tmp_path / "greedy", x)
    assert (np.sort(ig, 1) != np.sort(i5, 1)).any()  # the group limit changes the choice for some token
    kept = i5 // 2  # 4 groups of 2 experts, one group kept: both experts of a token share it
    assert (kept[:, 0] == kept[:, 1]).all()


def test_deepseek_v3_defaults_follow_transformers(tmp_path):
    write_checkpoint(tmp_path, family="deepseek_v3", num_experts=2 * E, extra_config=dict(  # n_group 8: 2 a group
        topk_method=None, scoring_func=None, norm_topk_prob=None, routed_scaling_factor=None, n_group=None,
        topk_group=None), return_weights=False)
    w = load_layer_weights(tmp_path, 0, device=False)
    assert (w.topk_method, w.scoring_func, w.renormalize, w.routed_scaling_factor, w.n_group, w.topk_group) == (
        "noaux_tc", "sigmoid", True, 2.5, 8, 4)
    routing = inspect_checkpoint(tmp_path)["routing"]
    assert {k: v["source"].split(" (")[0] for k, v in routing.items()} == {
        "top_k": "config.json num_experts_per_tok", "renormalize": "default for deepseek_v3",
        "scoring_func": "default for deepseek_v3", "topk_method": "default for deepseek_v3",
        "routed_scaling_factor": "default for deepseek_v3", "n_group": "default for deepseek_v3",
        "topk_group": "default for deepseek_v3", "hidden_act": "config.json hidden_act"}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2"])
def test_softmax_families_without_routing_keys(tmp_path, family):
    write_checkpoint(tmp_path, family=family, extra_config=dict(norm_topk_prob=None, scoring_func=None,
                                                                topk_method=None, routed_scaling_factor=None,
                                                                n_group=None, topk_group=None),
                     return_weights=False)
    w = load_layer_weights(tmp_path, 0, device=False)
    assert (w.scoring_func, w.topk_method, w.routed_scaling_factor) == ("softmax", "greedy", 1.0)
    assert w.renormalize == (family == "mixtral")


@pytest.mark.parametrize("family,extra,match", [
    ("deepseek_v3", dict(n_group=3, topk_group=1), r"config\.json n_group=3: expected a divisor of the E=4 experts"),
    ("deepseek_v3", dict(n_group=2, topk_group=3), r"config\.json topk_group=3: expected at most n_group=2"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=None, topk_group=None),
     r"n_group=None, the default for deepseek_v2 \(config\.json has no n_group\): expected a positive int"),
    ("deepseek_v2", dict(topk_method="sinkhorn"), r"config\.json topk_method='sinkhorn': expected "
                                                  r"'greedy' or 'group_limited_greedy' or 'noaux_tc'"),
    ("qwen3_moe", dict(num_experts_per_tok=5), r"config\.json num_experts_per_tok=5: expected at most E=4 experts"),
    ("qwen2_moe", dict(scoring_func="sparsemax"), r"scoring_func='sparsemax': expected 'softmax' or 'sigmoid'"),
    ("deepseek_v3", dict(n_group=4, topk_group=2), r"config\.json n_group=4: expected at most E/2 = 2 \(topk_method "
                                                   r"'noaux_tc' scores a group by the sum of its two best experts"),
    ("mixtral", dict(hidden_act="gelu"), r"config\.json hidden_act='gelu': expected 'silu' \(the expert kernels "
                                         r"compute SiLU\(gate\) \* up\)"),
    ("deepseek_v2", dict(routed_scaling_factor=1e300), r"config\.json routed_scaling_factor=1e\+300: expected a "
                                                       r"positive finite number, at most 65504 \(the largest float16"),
    ("deepseek_v2", dict(routed_scaling_factor=1e30), r"routed_scaling_factor=1e\+30: expected a positive finite"),
    ("deepseek_v2", dict(routed_scaling_factor=float("inf")), r"routed_scaling_factor=inf: expected a positive finite"),
    ("deepseek_v3", dict(num_experts_per_tok=3, n_group=2, topk_group=1),
     r"config\.json num_experts_per_tok=3: expected at most topk_group \* E / n_group = 2 \(only the experts of the "
     r"topk_group=1 kept groups can be chosen\)"),
])
def test_routing_errors_name_the_setting_and_its_source(tmp_path, family, extra, match):
    write_checkpoint(tmp_path, family=family, extra_config=extra, return_weights=False)
    with pytest.raises(ValueError, match=match):
        load_layer_weights(tmp_path, 0, device=False)
    assert inspect_checkpoint(tmp_path)["routing_error"] is not None


@pytest.mark.parametrize("extra,match", [
    (dict(model_type=["mixtral"]), r"config\.json model_type: expected a string, got \['mixtral'\]"),
    (dict(model_type=None, architectures="MixtralForCausalLM"),
     r"config\.json architectures: expected a list of strings, got 'MixtralForCausalLM'"),
    (dict(model_type=None, architectures=[["MixtralForCausalLM"]]),
     r"config\.json architectures: expected a list of strings, got \[\['MixtralForCausalLM'\]\]"),
])
def test_family_labels_of_the_wrong_type(tmp_path, extra, match):
    write_checkpoint(tmp_path, extra_config=extra, return_weights=False)
    with pytest.raises(TypeError, match=match):
        load_layer_weights(tmp_path, 0, device=False)
    with pytest.raises(TypeError, match=match):
        inspect_checkpoint(tmp_path)


def test_schemes_are_the_first_naming_of_each_family():
    assert list(SCHEMES) == ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
    assert SCHEMES["mixtral"].naming == "block_sparse_moe.w1"
