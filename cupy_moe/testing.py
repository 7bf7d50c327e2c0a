"""Write genuine GPTQ (AWQ GEMM, compressed-tensors) Mixture-of-Experts checkpoints for tests, examples, demo.

No model is downloaded anywhere in cupy_moe: `write_checkpoint` makes random float weights, quantizes them with
the reference round-to-nearest quantizer (`cupy_moe.reference.quantize`) and saves them the
way AutoGPTQ / GPTQModel / AutoAWQ lay them out: each family's tensor names, config.json and
quantize_config.json, GPTQ v1 or gptq_v2 zero points, sym or asym, act-order g_idx, bf16 scales, all-zero
`.bias` tensors, shards that split one module's tensors across files, GPTQModel `dynamic` rules; or the way
llm-compressor saves compressed-tensors `pack-quantized` (W4A16/W8A16) checkpoints.
It returns the float weights it quantized, so tests can compare what a loader reads back.

    from cupy_moe.testing import write_checkpoint
    weights = write_checkpoint("/tmp/ckpt", family="qwen2_moe", num_layers=2, desc_act=True, num_shards=3)
    weights["model.layers.0.mlp.experts.1.up_proj"]  # float32 [K, N] = [H, I], the W of y = x @ W

Shape letters: H hidden size, I expert intermediate size, E experts, K in-features, N out-features,
G group size, R = ceil(K/G).
"""
from __future__ import annotations

import json
import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _packing, reference
from ._safetensors_writer import ShardWriter, edit_checkpoint
from .checkpoint.naming import NAMINGS, SCHEMES
from .checkpoint.safetensors import bf16_to_f32
from .weights import expert_shapes

__all__ = ["write_checkpoint", "edit_checkpoint", "FAMILIES"]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")

_ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
_QUANT_CHUNK = 512  # columns per reference.quantize call (a multiple of 32: whole qzeros words for any bits)


# --------------------------------------------------------------------------- small helpers


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> uint16 bfloat16 bit patterns, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _store_float(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(array to write, its values as float32) for a float tensor stored as float16/bfloat16/float32."""
    if dtype == "bfloat16":
        bits = _to_bf16_bits(x)
        return bits, bf16_to_f32(bits)
    stored = np.ascontiguousarray(x, dtype=dtype)
    return stored, stored.astype(np.float32)


def _match_dynamic(dynamic: dict | None, name: str):
    """GPTQModel `dynamic`: first matching rule wins; "-:re" -> "skip", "+:re"/"re" -> its overrides."""
    for pattern, overrides in (dynamic or {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return "skip"
        elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, name):
            return overrides or {}
    return None


def _quantize(w: np.ndarray, bits: int, group_size: int, sym: bool, g_idx) -> reference.QuantizedLinear:
    """reference.quantize over column chunks: columns quantize independently, so the result is bit-identical,
    and cache-sized chunks run several times faster than one call on a [4096, 14336] matrix."""
    n = w.shape[1]
    if n <= _QUANT_CHUNK:
        return reference.quantize(w, bits=bits, group_size=group_size, sym=sym, g_idx=g_idx)
    parts = [reference.quantize(np.ascontiguousarray(w[:, c:c + _QUANT_CHUNK]), bits=bits, group_size=group_size,
                                sym=sym, g_idx=g_idx) for c in range(0, n, _QUANT_CHUNK)]
    cat = lambda key: np.concatenate([getattr(p, key) for p in parts], axis=1)  # noqa: E731
    return reference.QuantizedLinear(cat("qweight"), cat("qzeros"), cat("scales"), parts[0].g_idx,
                                     parts[0].checkpoint_format)


def _zeros_to_format(q: reference.QuantizedLinear, bits: int, fmt: str) -> np.ndarray:
    """qzeros of `q` (v1 when sym, v2 when asym) re-expressed in checkpoint format `fmt`."""
    if q.checkpoint_format == fmt:
        return q.qzeros
    if fmt == "gptq_v2":  # v1 -> real zeros
        return _packing.v1_to_real(q.qzeros, bits)
    return _packing.real_to_v1(q.qzeros, bits)  # as GPTQModel exports it (word-level, borrows included)


def _awq_pack(values: np.ndarray) -> np.ndarray:
    """uint [X, N] 4-bit values -> AWQ GEMM int32 [X, N/8], packed along N in the AWQ nibble order."""
    return _packing.pack(_packing.awq_interleave(values), 4)


# --------------------------------------------------------------------------- the writer


def _apply(base: dict, extra: dict | None) -> dict:
    """base updated with extra; a None value in extra deletes the key."""
    out = dict(base)
    for key, val in (extra or {}).items():
        if val is None:
            out.pop(key, None)
        else:
            out[key] = val
    return out


def write_checkpoint(path, *, family: str = "mixtral", num_layers: int = 1, hidden: int = 64,
                     intermediate: int = 128, num_experts: int = 4, top_k: int = 2, bits: int = 4,
                     group_size: int = 32, sym: bool = True, desc_act: bool = False,
                     checkpoint_format: str | None = None, quant_method: str = "gptq", naming: str | None = None,
                     scales_dtype: str = "float16", dense_dtype: str = "float16", zero_bias: bool = False,
                     bias: bool = False, shared_intermediate: int | None = None, quantize_shared: bool = True,
                     first_k_dense_replace: int | None = None, dense_intermediate: int | None = None,
                     num_shards: int = 1, file_name: str = "model.safetensors", dynamic: dict | None = None,
                     modules_in_block_to_quantize: bool = False, quant_config_files: str = "both",
                     extra_config: dict | None = None, extra_quant_config: dict | None = None,
                     same_gate_up_g_idx: bool = True, return_weights: bool = True, seed: int = 0,
                     weight_std: float = 0.02) -> dict:
    """Write a GPTQ (or AWQ GEMM) MoE checkpoint folder and return the float weights it quantized.

    path: folder to create. If it exists, every *.json and *.safetensors file in it is deleted first (no stale
        shards or configs), whatever wrote it: pass a new or empty folder.
    family: "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2" or "deepseek_v3" (names and config keys).
    num_layers, hidden H, intermediate I (per expert), num_experts E, top_k A: model sizes.
    bits 2/3/4/8, group_size G or -1, sym, desc_act (act-order: a permuted, non-monotone g_idx per module).
    checkpoint_format: "gptq" (v1: stored zero - 1) or "gptq_v2" (real zeros); default "gptq" when sym,
        "gptq_v2" when asym. Asym v1 is written the way GPTQModel exports it (word-level subtract).
    quant_method: "gptq", "awq" (AWQ GEMM: qweight [K, N/8] packed along N, interleaved; 4-bit; no g_idx) or
        "compressed-tensors" (pack-quantized, bits 4/8: weight_packed [N, K*bits/32], weight_scale [N, R],
        weight_zero_point [N*bits/32, R] when asym, weight_g_idx with desc_act (actorder "group"),
        weight_shape; the config goes into config.json only, as llm-compressor writes it).
    naming: which of the family's namings (checkpoint.naming.NAMINGS) to write, e.g. "mlp.gate_proj" for Mixtral as
        GPTQModel on transformers 5 saves it; default the family's first.
    scales_dtype: "float16", "bfloat16" or "float32". dense_dtype: dtype of dense tensors (router, excluded
        modules): "float16", "bfloat16" or "float32".
    zero_bias: add an all-zero `.bias` [N] to every quantized module (AutoGPTQ <= 0.7.1 did).
    bias: add a random non-zero `.bias` [N] to every expert module instead.
    shared_intermediate: I_s of the shared expert (qwen2_moe, deepseek; default 2*I for qwen2_moe, and
        n_shared_experts*I with n_shared_experts = 2 (v2) / 1 (v3) for deepseek). quantize_shared: False
        stores the shared expert dense while the config stays silent about it.
    first_k_dense_replace: DeepSeek dense first layers (default 1 when num_layers > 1, else 0); their dense MLP
        (intermediate `dense_intermediate`, default 2*I) is quantized like the experts.
    num_shards: > 1 writes model-0000i-of-0000n.safetensors + model.safetensors.index.json, tensors assigned
        round-robin so every module's tensors are split across files. file_name: the single file's name.
    dynamic: GPTQModel rules written to the config and applied here: "-:regex" -> module stored dense,
        "+:regex"/"regex" -> {bits, group_size, sym, desc_act} overrides; first match wins.
    modules_in_block_to_quantize: write the optimum/transformers list of quantized modules (block-relative).
    quant_config_files: where the quantization config goes: "both" (config.json['quantization_config'] and
        quantize_config.json), "quantize_config", "quant_config" (AutoAWQ-style keys for awq) or "config".
    extra_config / extra_quant_config: keys merged into config.json / the quantization config (None deletes).
    same_gate_up_g_idx: with desc_act, gate and up of one expert get the same g_idx, as real GPTQ gives them
        (same inputs, same Hessian, same order); False draws separate ones (a broken file, for tests).
    return_weights: False returns {} (a Mixtral-8x7B layer is 5.6 GB of float32).
    seed: everything is reproducible from it. weight_std: std of the random normal weights.

    Returns {name: float32 array}: for every Linear module (quantized or dense) its W [K, N] (y = x @ W, the
    values that were quantized, or the stored values for dense ones); for every other tensor written (biases,
    e_score_correction_bias) its stored values as float32, keyed by tensor name.
    """
    scheme = _naming(family, naming)
    opt = _Options(family=family, scheme=scheme, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                   fmt=checkpoint_format or ("gptq" if sym else "gptq_v2"), quant_method=quant_method,
                   scales_dtype=scales_dtype, dense_dtype=dense_dtype, zero_bias=zero_bias, bias=bias,
                   quantize_shared=quantize_shared, dynamic=dynamic, return_weights=return_weights,
                   weight_std=weight_std)
    _check_options(opt, checkpoint_format, quant_config_files, num_shards)
    sizes = _sizes(family, num_layers, hidden, intermediate, num_experts, shared_intermediate,
                   first_k_dense_replace, dense_intermediate)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in list(folder.glob("*.safetensors")) + list(folder.glob("*.json")):
        old.unlink()  # a rewrite must not leave stale shards or configs behind

    modules, extras = _module_names(scheme, sizes)
    specs = [_quant_spec(opt, name, role) for name, _, _, role, _ in modules]
    plan = _tensor_plan(opt, modules, specs, extras)
    # Every module draws from its own generator: results do not depend on which thread ran what.
    seeds = np.random.SeedSequence(seed).spawn(len(modules) + 1)
    rng = np.random.default_rng(seeds[-1])
    g_idxs = _act_order_g_idxs(opt, modules, specs, rng, same_gate_up_g_idx)
    writer = ShardWriter(folder, plan, num_shards, file_name)
    try:
        out = _write_modules(opt, writer, modules, specs, g_idxs, seeds)
        for tname, kind, shape in extras:
            vals = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1) if kind == "score_bias"
                    else np.ones(shape, np.float32))
            stored, values = _store_float(vals, "float32" if kind == "score_bias" else dense_dtype)
            writer.write(tname, stored)
            if return_weights:
                out[tname] = values
    finally:
        writer.close(index=num_shards > 1)

    in_block = None
    if modules_in_block_to_quantize:
        in_block = [[name[len(scheme.block.format(layer=layer)) + 1:]
                     for (name, _, _, _, layer), spec in zip(modules, specs) if spec is not None]]
    _write_configs(folder, family=family, num_layers=num_layers, h=hidden, i=intermediate, e_count=num_experts,
                   top_k=top_k, shared_intermediate=sizes.shared_intermediate if sizes.has_shared else None,
                   n_shared=sizes.n_shared, first_k_dense_replace=sizes.first_k_dense_replace,
                   dense_intermediate=sizes.dense_intermediate, bits=bits, group_size=group_size, sym=sym,
                   desc_act=desc_act, fmt=opt.fmt, quant_method=quant_method, dynamic=dynamic,
                   dense_dtype=dense_dtype, in_block=in_block, quant_config_files=quant_config_files,
                   extra_config=extra_config, extra_quant_config=extra_quant_config)
    return out


@dataclass(frozen=True)
class _Options:
    """The write_checkpoint arguments that decide how each module is stored."""
    family: str
    scheme: object  # the NamingScheme written
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    fmt: str
    quant_method: str
    scales_dtype: str
    dense_dtype: str
    zero_bias: bool
    bias: bool
    quantize_shared: bool
    dynamic: dict | None
    return_weights: bool
    weight_std: float


def _check_options(opt: _Options, checkpoint_format, quant_config_files: str, num_shards: int):
    if opt.family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {opt.family!r}")
    if opt.quant_method not in ("gptq", "awq", "compressed-tensors"):
        raise ValueError(f"quant_method: expected 'gptq', 'awq' or 'compressed-tensors', got {opt.quant_method!r}")
    if opt.quant_method == "compressed-tensors" and (opt.bits not in (4, 8) or opt.dynamic):
        raise ValueError(f"quant_method='compressed-tensors': expected bits 4 or 8 and no dynamic rules, got "
                         f"bits={opt.bits}, dynamic={opt.dynamic!r}")
    if opt.fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format: expected 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    if opt.quant_method == "awq" and (opt.bits != 4 or opt.desc_act):
        raise ValueError(f"quant_method='awq': expected bits=4 and desc_act=False, got bits={opt.bits}, "
                         f"desc_act={opt.desc_act}")
    for name, val in (("scales_dtype", opt.scales_dtype), ("dense_dtype", opt.dense_dtype)):
        if val not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"{name}: expected 'float16', 'bfloat16' or 'float32', got {val!r}")
    if quant_config_files not in ("both", "quantize_config", "quant_config", "config"):
        raise ValueError(f"quant_config_files: expected 'both', 'quantize_config', 'quant_config' or 'config', "
                         f"got {quant_config_files!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards: expected >= 1, got {num_shards}")


@dataclass(frozen=True)
class _Sizes:
    num_layers: int
    h: int
    i: int
    e_count: int
    has_shared: bool
    shared_intermediate: int  # I_s
    n_shared: int  # DeepSeek n_shared_experts
    first_k_dense_replace: int
    dense_intermediate: int


def _sizes(family, num_layers, h, i, e_count, shared_intermediate, first_k_dense_replace,
           dense_intermediate) -> _Sizes:
    """The model sizes, with the defaults of the shared experts and DeepSeek's dense first layers resolved."""
    deepseek = family.startswith("deepseek")
    n_shared = 2 if family == "deepseek_v2" else 1
    if shared_intermediate is None:
        shared_intermediate = 2 * i if family == "qwen2_moe" else n_shared * i
    elif deepseek:
        if shared_intermediate % i:
            raise ValueError(f"shared_intermediate: expected a multiple of intermediate={i} for {family} "
                             f"(n_shared_experts * I), got {shared_intermediate}")
        n_shared = shared_intermediate // i
    if first_k_dense_replace is None:
        first_k_dense_replace = 1 if (deepseek and num_layers > 1) else 0
    if first_k_dense_replace and not deepseek:
        raise ValueError(f"first_k_dense_replace: only the deepseek families have dense first layers, got "
                         f"{first_k_dense_replace} for {family}")
    return _Sizes(num_layers, h, i, e_count, SCHEMES[family].shared_experts is not None, shared_intermediate,
                  n_shared, first_k_dense_replace, dense_intermediate or 2 * i)


def shared_intermediate_written(family: str, intermediate: int, shared_intermediate: int | None = None) -> int:
    """The shared experts' intermediate size I_s that write_checkpoint writes for these arguments (0: none)."""
    sizes = _sizes(family, 1, 1, intermediate, 1, shared_intermediate, None, None)
    return sizes.shared_intermediate if sizes.has_shared else 0


def _naming(family: str, naming: str | None):
    """The NamingScheme that write_checkpoint writes for `family` (its first naming unless `naming` names one)."""
    if naming is None:
        return SCHEMES.get(family)
    found = [n for n in NAMINGS if n.family == family and n.naming == naming]
    if not found:
        known = [n.naming for n in NAMINGS if n.family == family and n.naming]
        raise ValueError(f"naming: expected one of {known} for {family}, got {naming!r}")
    return found[0]


def _module_names(s, z: _Sizes) -> tuple[list, list]:
    """The family's tensor names, in write order.

    Returns (modules, extras): modules [(module name, K, N, role, layer)] with role "expert", "shared",
    "dense_mlp" (DeepSeek's dense first layers) or "dense" (router, shared expert gate: never quantized);
    extras [(tensor name, kind, shape)] for the other tensors (layer norms, DeepSeek-V3's score bias).
    """
    projs = (s.gate_proj, s.up_proj, s.down_proj)
    modules, extras = [], []
    for layer in range(z.num_layers):
        block = s.block.format(layer=layer)
        extras.append((f"{block}.input_layernorm.weight", "norm", (z.h,)))
        if layer < z.first_k_dense_replace:
            i_d = z.dense_intermediate
            for p, k, n in zip(projs, (z.h, z.h, i_d), (i_d, i_d, z.h)):
                modules.append((f"{block}.mlp.{p}", k, n, "dense_mlp", layer))
            continue
        for e in range(z.e_count):
            for p, k, n in zip(projs, (z.h, z.h, z.i), (z.i, z.i, z.h)):
                modules.append((s.expert_module(layer, e, p), k, n, "expert", layer))
        if z.has_shared:
            i_s = z.shared_intermediate
            for p, k, n in zip(projs, (z.h, z.h, i_s), (i_s, i_s, z.h)):
                modules.append((s.shared_experts.format(layer=layer, proj=p), k, n, "shared", layer))
        modules.append((s.router.format(layer=layer), z.h, z.e_count, "dense", layer))
        if s.shared_expert_gate:
            modules.append((s.shared_expert_gate.format(layer=layer), z.h, 1, "dense", layer))
        if s.score_bias:
            extras.append((s.score_bias.format(layer=layer), "score_bias", (z.e_count,)))
    return modules, extras


def _quant_spec(opt: _Options, name: str, role: str):
    """(bits, group_size, sym, desc_act) of module `name`, or None when it is stored dense."""
    if role == "dense" or (role == "shared" and not opt.quantize_shared):
        return None
    rule = _match_dynamic(opt.dynamic, name)
    if rule == "skip":
        return None
    rule = rule or {}
    return (int(rule.get("bits", opt.bits)), int(rule.get("group_size", opt.group_size)),
            bool(rule.get("sym", opt.sym)), bool(rule.get("desc_act", opt.desc_act)))


def _tensor_plan(opt: _Options, modules: list, specs: list, extras: list) -> list:
    """[(tensor name, dtype, shape)] of every tensor, in write order."""
    plan = []
    for (name, k, n, role, _), spec in zip(modules, specs):
        with_bias = opt.bias and role == "expert"
        if spec is None:
            plan.append((f"{name}.weight", opt.dense_dtype, (n, k)))
        else:
            b, g, sym, desc_act = spec
            shapes = expert_shapes(k, n, b, g)
            if opt.quant_method == "compressed-tensors":  # every tensor [N, ...]
                plan += _ct_plan(name, shapes, opt.scales_dtype, sym, desc_act and g != -1)
                plan += [(f"{name}.bias", "float16", (n,))] if with_bias else []
                continue
            if opt.quant_method == "awq":  # packed along N instead
                plan.append((f"{name}.qweight", "int32", (k, n * b // 32)))
            else:
                plan.append((f"{name}.qweight", "int32", shapes["qweight"]))
            plan.append((f"{name}.qzeros", "int32", shapes["qzeros"]))
            plan.append((f"{name}.scales", opt.scales_dtype, shapes["scales"]))
            if opt.quant_method == "gptq":
                plan.append((f"{name}.g_idx", "int32", shapes["g_idx"]))
            with_bias = with_bias or opt.zero_bias
        if with_bias:
            plan.append((f"{name}.bias", "float16", (n,)))
    for tname, kind, shape in extras:
        plan.append((tname, "float32" if kind == "score_bias" else opt.dense_dtype, shape))
    return plan


def _act_order_g_idxs(opt: _Options, modules: list, specs: list, rng, same_gate_up_g_idx: bool) -> list:
    """The act-order g_idx of each module (None without desc_act). Gate and up of one MLP share their inputs,
    hence their act-order g_idx (unless same_gate_up_g_idx is False)."""
    s = opt.scheme
    g_idxs, act_orders = [], {}
    for (name, k, _, _, _), spec in zip(modules, specs):
        g_idx = None
        if spec is not None and spec[3] and spec[1] != -1 and opt.quant_method != "awq":  # desc_act, groups
            shared_key = name.rsplit(".", 1)[1] in (s.gate_proj, s.up_proj) and same_gate_up_g_idx
            key = (name.rsplit(".", 1)[0], k, spec[1]) if shared_key else name
            if key not in act_orders:
                act_orders[key] = reference.act_order_g_idx(k, spec[1], rng)
            g_idx = act_orders[key]
        g_idxs.append(g_idx)
    return g_idxs


def _write_modules(opt: _Options, writer: "ShardWriter", modules: list, specs: list, g_idxs: list,
                   seeds: list) -> dict:
    """Draw, quantize and write every module on worker threads, in plan order; returns {name: float32 values}."""

    def make(j):
        """The tensors of module j in plan order, and its float values (runs on a worker thread)."""
        name, k, n, role, _ = modules[j]
        spec, mrng = specs[j], np.random.default_rng(seeds[j])
        w = mrng.standard_normal((k, n), dtype=np.float32) * np.float32(opt.weight_std)  # [K, N]
        values = {}
        if spec is None:
            stored, dense_values = _store_float(w.T, opt.dense_dtype)  # nn.Linear.weight [N, K]
            tensors = {f"{name}.weight": stored}
            values[name] = np.ascontiguousarray(dense_values.T)
        else:
            tensors = _quantized_tensors(name, w, spec, opt.fmt, opt.quant_method, opt.scales_dtype, g_idxs[j])
            values[name] = w
        if f"{name}.bias" in writer.where:
            b = (mrng.standard_normal(n, dtype=np.float32) * np.float32(0.1) if (opt.bias and role == "expert")
                 else np.zeros(n, np.float32)).astype(np.float16)
            tensors[f"{name}.bias"] = b
            values[f"{name}.bias"] = b.astype(np.float32)
        return tensors, values if opt.return_weights else {}

    out = {}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(8, cpus))  # each in-flight module holds its float W
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # At most `workers` modules in flight (memory), written strictly in plan order.
        pending = deque(pool.submit(make, j) for j in range(min(workers, len(modules))))
        upcoming = len(pending)
        while pending:
            tensors, values = pending.popleft().result()
            if upcoming < len(modules):
                pending.append(pool.submit(make, upcoming))
                upcoming += 1
            for tname, array in tensors.items():
                writer.write(tname, array)
            out.update(values)
    return out


def _quantized_tensors(name: str, w: np.ndarray, spec: tuple, fmt: str, quant_method: str, scales_dtype: str,
                       g_idx: np.ndarray | None) -> dict:
    """{tensor name: array} of one quantized module, in plan order (qweight, qzeros, scales[, g_idx])."""
    bits, group_size, sym, _ = spec
    q = _quantize(w, bits, group_size, sym, g_idx)
    scales, _ = _store_float(q.scales.astype(np.float32), scales_dtype)
    if quant_method == "compressed-tensors":
        return _ct_tensors(name, w.shape, q, bits, sym, scales, g_idx is not None)
    if quant_method == "awq":
        codes = _packing.unpack(q.qweight, 4, axis=0)  # [K, N]
        zeros = _packing.unpack(_zeros_to_format(q, 4, "gptq_v2"), 4)  # real zeros [R, N]
        return {f"{name}.qweight": _awq_pack(codes), f"{name}.qzeros": _awq_pack(zeros), f"{name}.scales": scales}
    return {f"{name}.qweight": q.qweight, f"{name}.qzeros": _zeros_to_format(q, bits, fmt),
            f"{name}.scales": scales, f"{name}.g_idx": q.g_idx.astype(np.int32)}


def _write_configs(folder: Path, *, family, num_layers, h, i, e_count, top_k, shared_intermediate, n_shared,
                   first_k_dense_replace, dense_intermediate, bits, group_size, sym, desc_act, fmt, quant_method,
                   dynamic, dense_dtype, in_block, quant_config_files, extra_config, extra_quant_config):
    if quant_method == "compressed-tensors":
        qcfg = _ct_config(bits, group_size, sym, desc_act)
        quant_config_files = "config"  # llm-compressor writes config.json only
    elif quant_method == "awq":
        qcfg = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    else:
        qcfg = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "lm_head": False,
                "quant_method": "gptq", "checkpoint_format": fmt, "pack_dtype": "int32",
                "meta": {"quantizer": ["cupy_moe.testing"], "damp_percent": 0.01, "static_groups": False,
                         "true_sequential": True},
                "model_file_base_name": "model"}
        if dynamic:
            qcfg["dynamic"] = dynamic
        if in_block is not None:
            qcfg["modules_in_block_to_quantize"] = in_block
    qcfg = _apply(qcfg, extra_quant_config)

    cfg = {"architectures": [_ARCH[family]], "model_type": family, "hidden_size": h, "num_hidden_layers": num_layers,
           "num_experts_per_tok": top_k, "hidden_act": "silu", "torch_dtype": {"float32": "float32",
                                                                               "bfloat16": "bfloat16"}.get(
                                                                                   dense_dtype, "float16"),
           "num_attention_heads": 4, "vocab_size": 1000, "rms_norm_eps": 1e-6}
    if family == "mixtral":
        cfg.update(intermediate_size=i, num_local_experts=e_count)
    elif family in ("qwen2_moe", "qwen3_moe"):
        cfg.update(moe_intermediate_size=i, num_experts=e_count, intermediate_size=dense_intermediate,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=family == "qwen3_moe")
        if family == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = shared_intermediate
    else:
        cfg.update(moe_intermediate_size=i, n_routed_experts=e_count, n_shared_experts=n_shared,
                   intermediate_size=dense_intermediate, first_k_dense_replace=first_k_dense_replace,
                   moe_layer_freq=1)
        if family == "deepseek_v2":
            cfg.update(norm_topk_prob=False, scoring_func="softmax", topk_method="greedy",
                       routed_scaling_factor=1.0, n_group=1, topk_group=1)
        else:
            cfg.update(norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                       routed_scaling_factor=2.5, n_group=1, topk_group=1)
    if quant_config_files in ("both", "config"):
        cfg["quantization_config"] = qcfg
    cfg = _apply(cfg, extra_config)
    with open(folder / "config.json", "w") as fh:
        json.dump(cfg, fh, indent=2)
    if quant_config_files in ("both", "quantize_config"):
        with open(folder / "quantize_config.json", "w") as fh:
            json.dump(qcfg, fh, indent=2)
    elif quant_config_files == "quant_config":
        if quant_method == "awq":  # AutoAWQ's own file and key names
            qcfg = _apply({"zero_point": True, "q_group_size": group_size, "w_bit": bits, "version": "GEMM"},
                          extra_quant_config)
        with open(folder / "quant_config.json", "w") as fh:
            json.dump(qcfg, fh, indent=2)


def dense_layer_output(layer, x) -> np.ndarray:
    """A MoE layer's output in float64 by a plain loop over the experts used, on dequantized weights.

    layer: a `cupy_moe.MoELayer` with NumPy weights (its `route` picks the experts; routing is tested on its
    own). x: [M, H]. Returns float64 [M, H]: the independent check used by the tests and the demo. The loops go
    expert by expert, so at most one expert's weights are held in float64 at a time (8 bytes a weight).
    """
    w = layer.weights

    def dequantized(stacked, e):  # [K, N] float64 of expert e
        if not hasattr(stacked, "qweight"):
            return np.asarray(stacked[e], np.float64)
        return reference.dequantize(
            stacked.qweight[e], stacked.scales[e], None if stacked.qzeros is None else stacked.qzeros[e],
            None if stacked.g_idx is None else stacked.g_idx[e], bits=stacked.bits,
            group_size=stacked.group_size, checkpoint_format="gptq_v2").astype(np.float64)

    def mlp(rows, w13, w2, b13, b2, e):  # one expert on some tokens [m, H]: down(SiLU(gate) * up)
        h = rows @ dequantized(w13, e) + (0 if b13 is None else b13[e])
        i = h.shape[1] // 2
        return (h[:, :i] / (1 + np.exp(-h[:, :i])) * h[:, i:]) @ dequantized(w2, e) + (0 if b2 is None else b2[e])

    weights, ids = layer.route(x)
    weights, ids = np.asarray(weights, np.float64), np.asarray(ids)
    xf = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], w.hidden_size))
    for e in np.unique(ids):
        m, s = np.nonzero(ids == e)
        np.add.at(out, m, weights[m, s, None] * mlp(xf[m], w.w13, w.w2, w.w13_bias, w.w2_bias, int(e)))
    if w.shared is not None:
        sh = w.shared
        shared = mlp(xf, sh.gate_up, sh.down, sh.gate_up_bias, sh.down_bias, 0)
        if w.shared_gate_weight is not None:
            shared /= 1 + np.exp(-(xf @ np.asarray(w.shared_gate_weight, np.float64)[0]))[:, None]
        out += shared
    return out


# --------------------------------------------------------------------------- compressed-tensors (llm-compressor)


def _ct_plan(name: str, shapes: dict, scales_dtype: str, sym: bool, g_idx: bool) -> list:
    """[(tensor name, dtype, shape)] of one pack-quantized module: GPTQ's shapes transposed ([N, ...])."""
    plan = [(f"{name}.weight_packed", "int32", shapes["qweight"][::-1]),
            (f"{name}.weight_scale", scales_dtype, shapes["scales"][::-1])]
    if not sym:
        plan.append((f"{name}.weight_zero_point", "int32", shapes["qzeros"][::-1]))
    if g_idx:
        plan.append((f"{name}.weight_g_idx", "int32", shapes["g_idx"]))
    return plan + [(f"{name}.weight_shape", "int64", (2,))]


def _ct_tensors(name: str, kn: tuple, q: reference.QuantizedLinear, bits: int, sym: bool, scales: np.ndarray,
                g_idx: bool) -> dict:
    """One module as compressed-tensors packs it: signed values + 2**(bits-1), packed lowest first along K (the
    weights, [N, K*bits/32]) or along N (the zero points, [N*bits/32, R]): GPTQ's words, transposed."""
    out = {f"{name}.weight_packed": np.ascontiguousarray(q.qweight.T),
           f"{name}.weight_scale": np.ascontiguousarray(scales.T)}
    if not sym:
        out[f"{name}.weight_zero_point"] = np.ascontiguousarray(_zeros_to_format(q, bits, "gptq_v2").T)
    if g_idx:
        out[f"{name}.weight_g_idx"] = q.g_idx.astype(np.int32)
    out[f"{name}.weight_shape"] = np.array([kn[1], kn[0]], np.int64)  # [N, K] of the nn.Linear weight
    return out


def _ct_config(bits: int, group_size: int, sym: bool, desc_act: bool) -> dict:
    """config.json['quantization_config'] of a W4A16/W8A16 pack-quantized checkpoint (llm-compressor's keys)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "observer": "minmax",
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if desc_act and group_size != -1 else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"],
            "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}
