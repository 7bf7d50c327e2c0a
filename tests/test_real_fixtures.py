"""The checkpoints written by real quantization tools (tests/data/real) are complete and self-consistent.

Each fixture's io.npz holds the tool's own output y of one MoE block for an input x, the tool's routing and its
dequantized weights; recomputing y from those in NumPy must agree with the tool's y. This checks the fixtures
themselves (made by tools/make_fixtures.py), not the loader.
"""
import functools
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "tests" / "data" / "real"
FIXTURES = sorted(p for p in REAL.iterdir() if (p / "io.npz").exists()) if REAL.is_dir() else []


@functools.cache
def _make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", REPO / "tools" / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _tensor(folder: Path, name: str):
    """One tensor of a (possibly sharded) checkpoint as a NumPy array, or None."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shard = json.loads(index.read_text())["weight_map"].get(name)
        files = [folder / shard] if shard else []
    else:
        files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(f, framework="numpy") as st:
            if name in st.keys():
                return st.get_tensor(name)
    return None


def test_every_fixture_the_script_makes_is_committed():
    names = {fx.name for fx in _make_fixtures().FIXTURES}
    assert names == {p.name for p in FIXTURES}


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_fixture_is_complete(folder):
    cfg = json.loads((folder / "config.json").read_text())
    info = json.loads((folder / "versions.json").read_text())
    io = np.load(folder / "io.npz")
    h = cfg["hidden_size"]
    assert io["x"].ndim == 2 and io["x"].shape[1] == h
    assert io["y"].shape == io["x"].shape
    assert np.abs(io["y"].astype(np.float32)).max() > 0
    assert 0 <= int(io["layer"]) < cfg["num_hidden_layers"]
    assert io["topk_ids"].shape == (io["x"].shape[0], cfg["num_experts_per_tok"])
    assert info["fixture"]["name"] == folder.name and info["versions"][info["fixture"]["tool"]]
    if info["fixture"]["shard_kb"]:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) >= 2 and all((folder / s).exists() for s in shards)
    else:
        assert (folder / "model.safetensors").exists()


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_dequantized_weights_reproduce_the_tools_output(folder):
    io = dict(np.load(folder / "io.npz"))
    layer = int(io["layer"])
    e = io["experts.gate_proj"].shape[0]
    assert io["experts.gate_proj"].shape[1] == io["x"].shape[1]
    assert io["experts.down_proj"].shape == (e, io["experts.gate_proj"].shape[2], io["x"].shape[1])
    gate = _tensor(folder, f"model.layers.{layer}.mlp.shared_expert_gate.weight")
    err = _make_fixtures().check_dequantized(io["x"], io, gate)
    assert err < 2e-2, f"{folder.name}: y recomputed from the dequantized weights is off by {err:.2e}"
    # The check is sensitive: dropping the shared expert or one routed expert's weight breaks it.
    broken = dict(io, topk_weights=io["topk_weights"] * np.array([1.0, 0.0], np.float32)[:io["topk_ids"].shape[1]])
    assert _make_fixtures().check_dequantized(io["x"], broken, gate) > 5e-2


@pytest.mark.parametrize("folder", [p for p in FIXTURES if "actorder" in p.name], ids=lambda p: p.name)
def test_act_order_fixture_has_a_permuting_g_idx(folder):
    """GPTQModel's g_idx and llm-compressor's weight_g_idx (actorder "group") put G columns in each group, not in
    the order of K."""
    info = json.loads((folder / "versions.json").read_text())
    layer, g = int(np.load(folder / "io.npz")["layer"]), info["fixture"]["group_size"]
    name = "g_idx" if info["fixture"]["tool"] == "gptqmodel" else "weight_g_idx"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        g_idx = _tensor(folder, f"model.layers.{layer}.mlp.experts.0.{proj}.{name}")
        assert not np.array_equal(g_idx, np.arange(len(g_idx)) // g), proj
        assert np.array_equal(np.bincount(g_idx), np.full(len(g_idx) // g, g)), proj  # G columns per group
