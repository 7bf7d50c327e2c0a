"""Regenerate the real-tool checkpoint fixtures under tests/data/real/.

Each fixture is a tiny random-weight MoE model built with transformers, quantized by a real tool (GPTQModel, or
llm-compressor for compressed-tensors) on a few random calibration sequences and saved by that tool, next to:

    io.npz         x [M, H] (the input of one MoE block), y [M, H] (the tool's own output of that whole block:
                   router, routed experts, shared experts), router_logits / topk_ids / topk_weights (what the
                   tool's router chose for x) and, per quantized projection of the block, the tool's dequantized
                   weight [E, K, N] ("experts.gate_proj", ...) or [K, N] ("shared_expert.down_proj", ...);
                   plus "layer" (the decoder layer the block belongs to)
    versions.json  python/torch/transformers/tool versions, the model config and the exact quantize config

The tools cannot share one environment, so each run makes the fixtures of the tools importable in the running
interpreter (or the ones named with --only):

    python tools/make_fixtures.py                 # every fixture whose tool is installed here
    python tools/make_fixtures.py --only qwen3_moe_gptq_w8_g128 --keep-work

Needs torch, transformers 5, tokenizers and gptqmodel (GPTQModel fixtures) or llmcompressor (compressed-tensors
fixtures); CPU only, no downloads. GPTQModel writes a logs/ folder into the working directory: run from a
scratch directory, e.g. `cd /tmp && python <repo>/tools/make_fixtures.py`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "real"

VOCAB = 256  # tiny WordLevel vocabulary: 4 special tokens, then "t4" .. "t255"
SEED = 1234
CALIB_SEQUENCES, CALIB_LENGTH = 48, 32
M_TOKENS = 6


@dataclass(frozen=True)
class Fixture:
    """One fixture: a family's tiny config, how the tool quantizes it, and the MoE layer io.npz covers."""
    name: str
    tool: str  # "gptqmodel" or "llmcompressor"
    family: str  # transformers model_type
    bits: int
    group_size: int
    sym: bool = True
    desc_act: bool = False  # GPTQModel act-order (with act_group_aware=False: a real permuting g_idx)
    actorder: str | None = None  # llm-compressor GPTQModifier actorder: "weight", None (its "static" default) or
    # "group", the one that saves a weight_g_idx: only llm-compressor 0.13 and older make it (0.14 removed it)
    intermediate: int = 64  # expert intermediate size I
    shard_kb: int | None = None  # save with this max shard size (KB): several safetensors files + index
    layer: int = 1  # the decoder layer whose MoE block io.npz covers
    dtype: str = "float16"  # the model's float dtype (bfloat16: x and y are stored as exact float32)
    extra: dict = field(default_factory=dict)  # config overrides
    dynamic: dict | None = None  # GPTQModel per-module overrides ("+:regex": {...}, "-:regex": {} = skip)


HIDDEN = 128

FIXTURES = [
    Fixture("mixtral_gptq_w4_g64_actorder", "gptqmodel", "mixtral", 4, 64, desc_act=True, intermediate=128),
    Fixture("qwen2_moe_gptq_w4_g128_asym", "gptqmodel", "qwen2_moe", 4, 128, sym=False, intermediate=128),
    Fixture("qwen3_moe_gptq_w8_g128", "gptqmodel", "qwen3_moe", 8, 128, intermediate=128),
    Fixture("deepseek_v2_gptq_w4_g64_grouped", "gptqmodel", "deepseek_v2", 4, 64, layer=2),
    Fixture("deepseek_v3_gptq_w4_g128_sharded", "gptqmodel", "deepseek_v3", 4, 128, intermediate=128,
            shard_kb=200, layer=2, dtype="bfloat16"),
    Fixture("deepseek_v2_gptq_w4_g128_dynamic", "gptqmodel", "deepseek_v2", 4, 128, intermediate=128, layer=2,
            dynamic={r"+:.*\.shared_experts\..*": {"bits": 8}, r"-:.*\.self_attn\..*": {}},
            extra={"topk_method": "greedy", "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0}),
    Fixture("qwen3_moe_ct_w4a16_g128_sym", "llmcompressor", "qwen3_moe", 4, 128, intermediate=128),
    Fixture("mixtral_ct_w4a16_g64_asym", "llmcompressor", "mixtral", 4, 64, sym=False, actorder="weight"),
    Fixture("qwen3_moe_ct_w4a16_g32_actorder", "llmcompressor", "qwen3_moe", 4, 32, actorder="group",
            intermediate=128),
]


def can_make(fx: Fixture) -> str | None:
    """Why the tool installed here cannot make `fx`, or None when it can."""
    if fx.tool == "llmcompressor" and fx.actorder == "group":
        from importlib.metadata import version
        installed = version("llmcompressor")
        if tuple(int(v) for v in installed.split(".")[:2]) >= (0, 14):
            return f"actorder 'group' needs llm-compressor 0.13 or older (installed: {installed})"
    return None


# --------------------------------------------------------------------------- tiny models


def model_config(fx: Fixture) -> dict:
    """config.json keys of the tiny model (transformers 5 names)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                  tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.02)
    e, i = 8, fx.intermediate
    if fx.family == "mixtral":
        cfg = dict(common, model_type="mixtral", num_hidden_layers=2, intermediate_size=i, num_local_experts=e,
                   num_experts_per_tok=2, head_dim=32)
    elif fx.family == "qwen2_moe":
        cfg = dict(common, model_type="qwen2_moe", num_hidden_layers=2, intermediate_size=2 * i,
                   moe_intermediate_size=i, shared_expert_intermediate_size=i, num_experts=e,
                   num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    elif fx.family == "qwen3_moe":
        cfg = dict(common, model_type="qwen3_moe", num_hidden_layers=2, intermediate_size=2 * i,
                   moe_intermediate_size=i, num_experts=e, num_experts_per_tok=2, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], head_dim=32)
    elif fx.family in ("deepseek_v2", "deepseek_v3"):
        cfg = dict(common, model_type=fx.family, num_hidden_layers=3, first_k_dense_replace=1,
                   intermediate_size=2 * i, moe_intermediate_size=i, n_routed_experts=e, n_shared_experts=1,
                   num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=64, q_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_key_value_heads=4)
        if fx.family == "deepseek_v2":
            cfg.update(topk_method="group_limited_greedy", routed_scaling_factor=1.5, norm_topk_prob=False)
        else:
            cfg.update(topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
                       norm_topk_prob=True)
    else:
        raise ValueError(f"family: unknown {fx.family!r}")
    cfg.update(fx.extra)
    return cfg


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: n for n, tok in enumerate(specials + [f"t{n}" for n in range(len(specials), VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(folder)


def moe_blocks(model, cfg: dict):
    """{layer: MoE block module} of a transformers model (the decoder layer's `.mlp`)."""
    layers = model.model.layers
    first_dense = cfg.get("first_k_dense_replace", 0)
    return {n: layer.mlp for n, layer in enumerate(layers) if n >= first_dense}


def build_model(fx: Fixture, folder: Path):
    """Save a tiny random float16 model (and tokenizer) of fx's family into `folder`; return its config dict."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = model_config(fx)
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, fx.dtype))
    gen = torch.Generator().manual_seed(SEED + 1)
    dtype = getattr(torch, fx.dtype)
    with torch.no_grad():
        for block in moe_blocks(model, cfg).values():
            # Routers with well separated logits (std ~2), so that a re-implementation picks the same experts.
            # Values exact in the model dtype: DeepSeek keeps its router in float32 on disk while the tools run
            # it in the model dtype, and a rounded router could flip a near tie between the two.
            w = block.gate.weight
            w.copy_((torch.randn(w.shape, generator=gen) * (2.0 / HIDDEN ** 0.5)).to(dtype).to(w.dtype))
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:  # DeepSeek-V3: a non-zero score correction bias, so its use is tested
                bias.copy_((torch.rand(bias.shape, generator=gen) * 0.2).to(dtype).to(bias.dtype))
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return cfg


def calibration(n: int = CALIB_SEQUENCES, length: int = CALIB_LENGTH):
    rng = np.random.default_rng(SEED + 2)
    ids = rng.integers(4, VOCAB, size=(n, length))
    return [{"input_ids": row.tolist(), "attention_mask": [1] * length} for row in ids]


def block_input(fx: Fixture):
    import torch
    rng = np.random.default_rng(SEED + 3)
    return torch.from_numpy(rng.standard_normal((M_TOKENS, HIDDEN)).astype(np.float32)).to(getattr(torch, fx.dtype))


def to_numpy(t):
    """float16 stays float16; bfloat16 (which NumPy lacks) becomes float32, exactly."""
    import torch
    return t.numpy() if t.dtype == torch.float16 else t.float().numpy()


# --------------------------------------------------------------------------- running one MoE block


def run_block(block, x):
    """The block's output [M, H] for x [M, H], plus what its router chose (as float32/int64 NumPy)."""
    import torch
    with torch.no_grad():
        y = block(x[None])
        if isinstance(y, tuple):
            y = y[0]
        gate_out = block.gate(x)
    out = {"y": to_numpy(y.reshape(x.shape))}
    if isinstance(gate_out, tuple):  # transformers 5 routers: (logits, topk weights, topk ids)
        logits, weights, ids = gate_out[:3]
        out.update(router_logits=logits.float().numpy(), topk_weights=weights.float().numpy(),
                   topk_ids=ids.numpy().astype(np.int64))
    else:  # a plain linear router: logits only
        out["router_logits"] = gate_out.float().numpy()
    return out


def _versions(tool: str) -> dict:
    import torch
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "numpy": np.__version__}
    from importlib.metadata import version, PackageNotFoundError
    for pkg in ("gptqmodel", "defuser", "llmcompressor", "compressed-tensors", "safetensors", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    out["tool"] = tool
    return out


def write_sidecars(fx: Fixture, folder: Path, x, result: dict, dequant: dict, quant_config: dict, cfg: dict,
                   notes: list):
    arrays = {"x": to_numpy(x), "layer": np.int64(fx.layer), **result}
    arrays.update({k: v.astype(np.float16) for k, v in dequant.items()})
    np.savez_compressed(folder / "io.npz", **arrays)
    info = {"fixture": dataclasses.asdict(fx), "versions": _versions(fx.tool), "model_config": cfg,
            "quantize_config": quant_config, "seed": SEED,
            "calibration": {"sequences": CALIB_SEQUENCES, "length": CALIB_LENGTH, "tokens": "uniform random ids"},
            "io_npz": {k: [str(v.dtype), list(np.shape(v))] for k, v in arrays.items()}, "notes": notes}
    (folder / "versions.json").write_text(json.dumps(info, indent=1, default=str) + "\n")


def dequantized_weights(block) -> dict:
    """GPTQModel's dequantized weights of one MoE block: {"experts.{proj}": [E, K, N], "<module>": [K, N]}."""
    import torch
    out = {}
    with torch.no_grad():
        for name, mod in block.named_modules():
            if hasattr(mod, "qweight") and hasattr(mod, "dequantize_weight"):
                w = mod.dequantize_weight().float().numpy()
                out[name] = w if w.shape == (mod.in_features, mod.out_features) else w.T
            elif isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in ("gate_proj", "up_proj", "down_proj"):
                out[name] = mod.weight.float().numpy().T  # a projection the quantize config left dense
    return _stack(out)


def check_dequantized(x, io: dict, shared_gate=None) -> float:
    """Relative error of io["y"] recomputed in float32 from the dequantized weights and the tool's routing.

    A self-check of a fixture (NumPy only): the saved weights, routing and y must agree up to the tool's half
    precision arithmetic. x [M, H]; io: the io.npz arrays; shared_gate: the Qwen2-MoE shared expert gate [1, H]
    or None. Returns max|y - y_check| / max|y|.
    """
    xf = np.asarray(x, np.float32)
    silu = lambda v: v / (1.0 + np.exp(-v))
    dq = {k: np.asarray(v, np.float32) for k, v in io.items() if k.endswith("_proj")}
    y = np.zeros_like(xf)
    for m in range(xf.shape[0]):
        for e, w in zip(io["topk_ids"][m], io["topk_weights"][m]):
            h = silu(xf[m] @ dq["experts.gate_proj"][e]) * (xf[m] @ dq["experts.up_proj"][e])
            y[m] += w * (h @ dq["experts.down_proj"][e])
    for prefix in ("shared_expert", "shared_experts"):
        if f"{prefix}.down_proj" in dq:
            shared = (silu(xf @ dq[f"{prefix}.gate_proj"]) * (xf @ dq[f"{prefix}.up_proj"])) @ dq[f"{prefix}.down_proj"]
            if shared_gate is not None:
                shared = shared / (1.0 + np.exp(-(xf @ np.asarray(shared_gate, np.float32).T)))
            y += shared
    ref = np.asarray(io["y"], np.float32)
    return float(np.abs(ref - y).max() / np.abs(ref).max())


def _self_check(x, result: dict, dequant: dict, block) -> float:
    sgate = getattr(block, "shared_expert_gate", None)
    return check_dequantized(to_numpy(x), {**result, **dequant},
                             None if sgate is None else sgate.weight.detach().float().numpy())


def _stack(per_expert: dict) -> dict:
    """{"experts.{e}.{proj}": [K, N]} -> {"experts.{proj}": [E, K, N]} (others unchanged)."""
    out, grouped = {}, {}
    for name, w in per_expert.items():
        parts = name.split(".")
        if parts[0] == "experts" and len(parts) == 3 and parts[1].isdigit():
            grouped.setdefault(parts[2], {})[int(parts[1])] = w
        else:
            out[name] = w
    for proj, d in grouped.items():
        out[f"experts.{proj}"] = np.stack([d[e] for e in sorted(d)])
    return out


# --------------------------------------------------------------------------- GPTQModel


def make_gptqmodel(fx: Fixture, work: Path, dest: Path):
    import torch
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(2, os.cpu_count() or 1)))
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    src = work / "float"
    cfg = build_model(fx, src)
    # offload_to_disk=False: nothing to offload in a tiny model, and the saved config names no temporary folder
    kw = dict(bits=fx.bits, group_size=fx.group_size, sym=fx.sym, desc_act=fx.desc_act, offload_to_disk=False)
    if fx.dynamic:
        kw["dynamic"] = fx.dynamic
    if fx.desc_act:
        kw["act_group_aware"] = False  # otherwise GPTQModel writes a group-ordered g_idx, not a permutation
    qcfg = QuantizeConfig(**kw)
    torch.manual_seed(SEED)
    dtype = getattr(torch, fx.dtype)
    model = GPTQModel.load(str(src), qcfg, device="cpu", dtype=dtype)
    model.quantize(calibration(), batch_size=4)
    save_kw = {"max_shard_size": f"{fx.shard_kb}KB"} if fx.shard_kb else {}
    model.save(str(dest), **save_kw)
    del model

    qmodel = GPTQModel.load(str(dest), device="cpu", backend=BACKEND.TORCH, dtype=dtype)
    hf = qmodel.model
    block = moe_blocks(hf, cfg)[fx.layer]
    x = block_input(fx)
    result = run_block(block, x)
    dequant = dequantized_weights(block)
    err = _self_check(x, result, dequant, block)
    with open(dest / "quantize_config.json") as fh:
        saved_qcfg = json.load(fh)
    notes = [f"y = model.model.layers[{fx.layer}].mlp(x[None]) of GPTQModel.load(..., backend=BACKEND.TORCH)",
             f"y recomputed in float32 from the dequantized weights and topk_ids/topk_weights: max rel err {err:.2e}"]
    write_sidecars(fx, dest, x, result, dequant, {"QuantizeConfig(...)": kw, "saved": saved_qcfg}, cfg, notes)
    return err


# --------------------------------------------------------------------------- llm-compressor


def _unpack_int32(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 [..., W] -> [..., W*32/bits] unsigned fields, lowest bits first (bits 4 or 8)."""
    u = words.view(np.uint32).astype(np.uint64)
    per = 32 // bits
    fields = [(u >> np.uint64(bits * j)) & np.uint64((1 << bits) - 1) for j in range(per)]
    return np.stack(fields, -1).reshape(*words.shape[:-1], -1).astype(np.int32)


def decode_pack_quantized(tensors: dict, prefix: str, bits: int) -> np.ndarray:
    """Dequantize one compressed-tensors `pack-quantized` module from its saved tensors, as float32 [K, N].

    weight_packed int32 [N, K*bits/32] holds q + 2**(bits-1) packed along K (lowest bits first);
    weight_zero_point int32 [N*bits/32, K/G] (asymmetric only) holds z + 2**(bits-1) packed along N;
    weight_scale [N, K/G]; weight_shape [N, K]; weight_g_idx int32 [K] (actorder "group" only): the group of each
    column, else column k is in group k // G; w = (q - z) * scale.
    """
    offset = 1 << (bits - 1)
    q = _unpack_int32(tensors[prefix + ".weight_packed"], bits) - offset
    n, k = (int(v) for v in tensors[prefix + ".weight_shape"])
    q = q[:, :k]
    scale = np.asarray(tensors[prefix + ".weight_scale"], np.float32)
    g_idx = tensors.get(prefix + ".weight_g_idx")
    group = np.arange(k) // (k // scale.shape[1]) if g_idx is None else np.asarray(g_idx, np.int64)
    zp = tensors.get(prefix + ".weight_zero_point")
    z = 0 if zp is None else (_unpack_int32(np.ascontiguousarray(zp.T), bits).T[:n] - offset)[:, group]
    return ((q - z) * scale[:, group]).T


def make_llmcompressor(fx: Fixture, work: Path, dest: Path):
    """Quantize with llm-compressor's GPTQModifier; y comes from the quantized model in memory (fake-quantized
    weights, exactly what the compressed checkpoint decodes to, which the script checks)."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = work / "float"
    cfg = build_model(fx, src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, fx.dtype))
    scheme = {
        "targets": ["Linear"],
        "weights": {"num_bits": fx.bits, "type": "int", "symmetric": fx.sym, "strategy": "group",
                    "group_size": fx.group_size, "actorder": fx.actorder},
    }
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$",
                                                                      "re:.*shared_expert_gate$"])
    ds = Dataset.from_list(calibration())
    torch.manual_seed(SEED)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=CALIB_SEQUENCES,
            max_seq_length=CALIB_LENGTH, output_dir=None)

    block = moe_blocks(model, cfg)[fx.layer]
    x = block_input(fx)
    result = run_block(block, x)
    dequant = {}
    with torch.no_grad():
        for name, mod in block.named_modules():
            qs = getattr(mod, "quantization_scheme", None)
            if isinstance(mod, torch.nn.Linear) and qs is not None and qs.weights is not None:
                w = fake_quantize(mod.weight, mod.weight_scale, getattr(mod, "weight_zero_point", None), qs.weights,
                                  g_idx=getattr(mod, "weight_g_idx", None))
                dequant[name] = w.float().numpy().T
    dequant = _stack(dequant)
    err = _self_check(x, result, dequant, block)

    model.save_pretrained(dest, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    del model
    # The saved tensors must decode (independently of the tool) to the weights that produced y.
    index = dest / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    tensors = {}
    for fname in files:
        with safe_open(dest / fname, framework="pt") as st:
            for key in st.keys():
                if f".layers.{fx.layer}." in key and ".weight_" in key:
                    tensors[key] = st.get_tensor(key).numpy()
    prefixes = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")})
    worst = 0.0
    for name, w in dequant.items():
        for e, we in (enumerate(w) if w.ndim == 3 else [(None, w)]):
            proj = name.split(".")[-1]
            mod = f"{name.rsplit('.', 1)[0]}.{e}.{proj}" if e is not None else name
            match = [p for p in prefixes if p.endswith(".mlp." + mod) or p.endswith(".block_sparse_moe." + mod)]
            if len(match) != 1:
                raise SystemExit(f"{fx.name}: no single saved module for {mod} (found {match})")
            got = decode_pack_quantized(tensors, match[0], fx.bits)
            worst = max(worst, float(np.abs(got - we).max() / np.abs(we).max()))
    if worst > 1e-2:
        raise SystemExit(f"{fx.name}: the saved checkpoint decodes to weights {worst:.2e} off the ones behind y")

    # Does transformers read the checkpoint back? (It decompresses on load; recorded, not required.)
    reloaded = AutoModelForCausalLM.from_pretrained(dest, dtype=getattr(torch, fx.dtype))
    y2 = run_block(moe_blocks(reloaded, cfg)[fx.layer], x)["y"].astype(np.float32)
    y = result["y"].astype(np.float32)
    reload_err = float(np.abs(y2 - y).max() / np.abs(y).max())
    import transformers
    saved = json.loads((dest / "config.json").read_text()).get("quantization_config")
    notes = [f"y = model.model.layers[{fx.layer}].mlp(x[None]) of the model llmcompressor.oneshot quantized, in memory "
             f"(fake-quantized weights)",
             f"y recomputed in float32 from the dequantized weights and topk_ids/topk_weights: max rel err {err:.2e}",
             f"the saved pack-quantized tensors decode to those dequantized weights: max rel err {worst:.1e}",
             f"transformers {transformers.__version__} AutoModelForCausalLM.from_pretrained(folder) gives y with max "
             f"rel err {reload_err:.2e}"
             + ("" if reload_err < 2e-2 else " (it does not read these expert tensors back: they stay randomly "
                                              "initialized)")]
    write_sidecars(fx, dest, x, result, dequant, {"GPTQModifier.config_groups": scheme, "saved": saved}, cfg, notes)
    print("   " + "\n   ".join(notes[1:]))
    return err


MAKERS = {"gptqmodel": make_gptqmodel, "llmcompressor": make_llmcompressor}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="fixture names (default: every fixture whose tool is installed)")
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    p.add_argument("--keep-work", action="store_true", help="keep the float model and scratch files")
    p.add_argument("--list", action="store_true", help="list the fixtures and exit")
    args = p.parse_args(argv)
    if args.list:
        for fx in FIXTURES:
            print(f"{fx.name:45s} {fx.tool}")
        return 0
    known = {fx.name: fx for fx in FIXTURES}
    if args.only:
        bad = [n for n in args.only if n not in known]
        if bad:
            p.error(f"--only: unknown fixture(s) {bad}; known: {list(known)}")
        todo = [known[n] for n in args.only]
        refused = [f"{fx.name}: {can_make(fx)}" for fx in todo if can_make(fx)]
        if refused:
            p.error("; ".join(refused))
    else:
        todo = [fx for fx in FIXTURES if importlib.util.find_spec(fx.tool) is not None]
        if not todo:
            p.error("neither gptqmodel nor llmcompressor is importable here")
        for fx in [fx for fx in todo if can_make(fx)]:
            print(f"== {fx.name}: skipped, {can_make(fx)}", flush=True)
            todo.remove(fx)
    for fx in todo:
        dest = args.out / fx.name
        if dest.exists():
            shutil.rmtree(dest)
        work = Path(tempfile.mkdtemp(prefix=f"fixture-{fx.name}-"))
        print(f"== {fx.name} ({fx.tool}) -> {dest}", flush=True)
        try:
            err = MAKERS[fx.tool](fx, work, dest)
        finally:
            if not args.keep_work:
                shutil.rmtree(work, ignore_errors=True)
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
        print(f"   {size / 1e6:.2f} MB, self-check rel err {err:.2e}: {sorted(f.name for f in dest.iterdir())}",
              flush=True)
        if not err < 2e-2:
            raise SystemExit(f"{fx.name}: y recomputed from the dequantized weights differs from the tool's y by "
                             f"{err:.2e} (relative to max|y|); the fixture is inconsistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
