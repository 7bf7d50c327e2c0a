"""Load the MoE layers of GPTQ (and AWQ GEMM) checkpoints from safetensors, lazily, one layer at a time.

A checkpoint is a folder with `config.json` and/or `quantize_config.json` and either `model.safetensors` or
shards listed in `model.safetensors.index.json` (see /work/shared/GPTQ_FORMAT.md and docs/checkpoints.md).

    load_stacked(path, layer, "w13")  -> StackedGptqWeight [E, H*bits/32, 2I] (gate columns first, then up)
    load_stacked(path, layer, "w2")   -> StackedGptqWeight [E, I*bits/32, H]
    load_moe_layer(path, layer)       -> MoELayerWeights (w13, w2, router, shared experts, routing settings)
    load_moe_model(path)              -> {layer: MoELayerWeights} for every MoE layer, with progress on a tty
    inspect_checkpoint(path)          -> dict, from configs and safetensors headers only

Shape letters: E experts, H hidden size, I expert intermediate size, K in-features, N out-features,
G group size, R = ceil(K/G) groups.

How a layer is read: only the requested layer's tensors, one at a time, straight from the files with
positioned reads (no mmap, so untouched tensors never count in the process RSS), into arrays preallocated for
the stacked result; then one host-to-device copy per stacked tensor. Every shape, dtype and config check runs
on the safetensors headers before a byte of tensor data is read, and nothing half-built is returned.
We parse the safetensors header ourselves instead of `safetensors.safe_open`: its NumPy backend cannot return
bfloat16 (bf16 scales and routers are common) and it maps whole files, while we want to read each tensor
directly into its slot of the stacked array.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import string
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from . import _xp
from .weights import StackedGptqWeight

__all__ = [
    "NamingScheme", "SCHEMES", "MoELayerWeights", "SharedExpertWeights",
    "load_stacked", "load_moe_layer", "load_moe_model", "inspect_checkpoint",
]

# --------------------------------------------------------------------------- naming schemes


@dataclass(frozen=True)
class NamingScheme:
    """Where a model family keeps one MoE layer's tensors, and which config.json keys hold its sizes.

    Module names are format strings over `{layer}`, `{expert}` and `{proj}`; a module's tensors are the module
    name plus `.qweight/.qzeros/.scales/.g_idx[/.bias]` (GPTQ, AWQ) or `.weight[/.bias]` (dense).

    family: a label ("mixtral", ...).
    experts: routed expert projection, e.g. "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}".
    gate_proj, up_proj, down_proj: the `{proj}` names of the gate [H -> I], up [H -> I] and down [I -> H]
        projections (Mixtral: "w1", "w3", "w2").
    router: the dense router module [E, H], e.g. "model.layers.{layer}.mlp.gate".
    score_bias: tensor name of a per-expert routing score bias [E] (DeepSeek-V3
        "model.layers.{layer}.mlp.gate.e_score_correction_bias"), or None.
    shared_experts: shared expert projection module over `{layer}` and `{proj}`, or None.
    shared_expert_gate: dense module [1, H] gating the shared expert (Qwen2-MoE), or None.
    block: prefix of one decoder layer; `modules_in_block_to_quantize` names are relative to it.
    num_experts_key, intermediate_size_key, top_k_key: config.json keys of E, I and the top-k A.
    renormalize: True/False forces renormalizing the top-k weights; None reads config `norm_topk_prob`,
        defaulting to `norm_topk_prob_default`.
    scoring_func_default: used when config.json has no `scoring_func`.

    Example, a family keeping experts under "transformer.h.{layer}.moe.experts.{expert}.{proj}":

        NamingScheme(family="mine", experts="transformer.h.{layer}.moe.experts.{expert}.{proj}",
                     router="transformer.h.{layer}.moe.router", block="transformer.h.{layer}")
    """

    family: str
    experts: str
    router: str
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    score_bias: str | None = None
    shared_experts: str | None = None
    shared_expert_gate: str | None = None
    block: str = "model.layers.{layer}"
    num_experts_key: str = "num_experts"
    intermediate_size_key: str = "moe_intermediate_size"
    top_k_key: str = "num_experts_per_tok"
    renormalize: bool | None = None
    norm_topk_prob_default: bool = False
    scoring_func_default: str = "softmax"

    def __post_init__(self):
        for name in ("experts", "router", "block"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"NamingScheme.{name}: expected a str, got {type(getattr(self, name)).__name__}")
        fields = {f for _, f, _, _ in string.Formatter().parse(self.experts) if f is not None}
        if fields != {"layer", "expert", "proj"}:
            raise ValueError(f"NamingScheme.experts: expected a format string using exactly {{layer}}, {{expert}} "
                             f"and {{proj}}, got {self.experts!r}")
        if self.shared_experts is not None:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.shared_experts) if f is not None}
            if fields != {"layer", "proj"}:
                raise ValueError(f"NamingScheme.shared_experts: expected a format string using exactly {{layer}} "
                                 f"and {{proj}}, got {self.shared_experts!r}")

    def expert_module(self, layer: int, expert: int, proj: str) -> str:
        return self.experts.format(layer=layer, expert=expert, proj=proj)

    def expert_regex(self, layer: int) -> re.Pattern:
        """Matches tensor names of layer `layer`'s routed experts; group 1 = expert index, 2 = proj."""
        out = []
        for literal, field, _, _ in string.Formatter().parse(self.experts):
            out.append(re.escape(literal))
            if field == "layer":
                out.append(str(layer))
            elif field == "expert":
                out.append(r"(\d+)")
            elif field == "proj":
                out.append(r"([^.]+)")
        return re.compile("".join(out) + r"\.[^.]+$")


SCHEMES: dict[str, NamingScheme] = {
    "mixtral": NamingScheme(
        family="mixtral", experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}",
        gate_proj="w1", up_proj="w3", down_proj="w2", router="model.layers.{layer}.block_sparse_moe.gate",
        num_experts_key="num_local_experts", intermediate_size_key="intermediate_size", renormalize=True),
    "qwen2_moe": NamingScheme(
        family="qwen2_moe", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
        router="model.layers.{layer}.mlp.gate", shared_experts="model.layers.{layer}.mlp.shared_expert.{proj}",
        shared_expert_gate="model.layers.{layer}.mlp.shared_expert_gate"),
    "qwen3_moe": NamingScheme(
        family="qwen3_moe", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
        router="model.layers.{layer}.mlp.gate"),
    "deepseek_v2": NamingScheme(
        family="deepseek_v2", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
        router="model.layers.{layer}.mlp.gate", shared_experts="model.layers.{layer}.mlp.shared_experts.{proj}",
        num_experts_key="n_routed_experts"),
    "deepseek_v3": NamingScheme(
        family="deepseek_v3", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
        router="model.layers.{layer}.mlp.gate", shared_experts="model.layers.{layer}.mlp.shared_experts.{proj}",
        score_bias="model.layers.{layer}.mlp.gate.e_score_correction_bias", num_experts_key="n_routed_experts",
        norm_topk_prob_default=True, scoring_func_default="sigmoid"),
}

_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3"}
_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
                  "DeepseekV3ForCausalLM": "deepseek_v3"}


def _family_from_tensors(names: Iterable[str]) -> str | None:
    """Guess the family from tensor names alone (when config.json is missing or names no known family)."""
    seen = set()
    for name in names:
        if ".block_sparse_moe.experts." in name:
            seen.add("mixtral")
        elif ".mlp.shared_experts." in name:
            seen.add("deepseek")
        elif ".mlp.shared_expert." in name:
            seen.add("qwen2_moe")
        elif ".mlp.experts." in name:
            seen.add("mlp")
        elif name.endswith(".e_score_correction_bias"):
            seen.add("v3")
    if "mixtral" in seen:
        return "mixtral"
    if "deepseek" in seen:
        return "deepseek_v3" if "v3" in seen else "deepseek_v2"
    if "qwen2_moe" in seen:
        return "qwen2_moe"
    if "mlp" in seen:
        return "qwen3_moe"
    return None


# --------------------------------------------------------------------------- safetensors, header-only parsing

# safetensors dtype -> (NumPy dtype the raw bytes are read as, bytes per element). BF16 is read as uint16
# (NumPy has no bfloat16) and widened with a shift.
_ST_DTYPES = {
    "BOOL": (np.bool_, 1), "U8": (np.uint8, 1), "I8": (np.int8, 1), "F8_E4M3": (np.uint8, 1),
    "F8_E5M2": (np.uint8, 1), "I16": (np.int16, 2), "U16": (np.uint16, 2), "F16": (np.float16, 2),
    "BF16": (np.uint16, 2), "I32": (np.int32, 4), "U32": (np.uint32, 4), "F32": (np.float32, 4),
    "I64": (np.int64, 8), "U64": (np.uint64, 8), "F64": (np.float64, 8),
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dtype: str  # safetensors name: "I32", "F16", "BF16", ...
    shape: tuple
    start: int  # absolute byte offset in the file
    nbytes: int


class _SafetensorsFile:
    """One .safetensors file: the header parsed and checked against the file size; tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.label = path.name
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: safetensors file not found") from None
        try:
            self.tensors, self.metadata = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self):
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise ValueError(f"{self.label}: not a safetensors file: {size} bytes, shorter than the 8-byte "
                             f"header length")
        (hlen,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise ValueError(f"{self.label}: corrupt or truncated safetensors file: the header claims {hlen} bytes "
                             f"but the file has {size} bytes in all")
        raw = os.pread(self._fd, hlen, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.label}: corrupt safetensors header (not valid JSON: {exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.label}: corrupt safetensors header: expected a JSON object, "
                             f"got {type(header).__name__}")
        data_start = 8 + hlen
        tensors = {}
        metadata = header.pop("__metadata__", None) or {}
        for name, entry in header.items():
            try:
                dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
                ok = (isinstance(dtype, str) and isinstance(shape, list)
                      and all(isinstance(d, int) and d >= 0 for d in shape)
                      and isinstance(b, int) and isinstance(e, int) and 0 <= b <= e)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{self.label}: corrupt safetensors header: tensor '{name}' has entry {entry!r}, "
                                 f"expected {{dtype, shape, data_offsets: [begin, end]}}")
            if dtype not in _ST_DTYPES:
                raise ValueError(f"{self.label}: tensor '{name}': unknown safetensors dtype {dtype!r}")
            want = math.prod(shape) * _ST_DTYPES[dtype][1]
            if e - b != want:
                raise ValueError(f"{self.label}: corrupt safetensors header: tensor '{name}' {dtype} {shape} needs "
                                 f"{want} bytes, its data_offsets [{b}, {e}] span {e - b}")
            if data_start + e > size:
                raise ValueError(f"{self.label}: truncated safetensors file: tensor '{name}' ends at byte "
                                 f"{data_start + e}, but the file has only {size} bytes")
            tensors[name] = _TensorInfo(name, dtype, tuple(shape), data_start + b, e - b)
        return tensors, metadata

    def read_into(self, info: _TensorInfo, out: np.ndarray) -> np.ndarray:
        """Read `info`'s raw bytes into the C-contiguous array `out` (dtype and size already checked)."""
        view = memoryview(out).cast("B")
        done = 0
        while done < info.nbytes:  # os.preadv may return short reads on some filesystems
            n = os.preadv(self._fd, [view[done:]], info.start + done)
            if n <= 0:
                raise ValueError(f"{self.label}: tensor '{info.name}': file ended after {done} of {info.nbytes} "
                                 f"bytes (truncated while reading?)")
            done += n
        return out

    def read(self, info: _TensorInfo) -> np.ndarray:
        """A new array with the tensor's raw values (BF16 as uint16)."""
        out = np.empty(info.shape, _ST_DTYPES[info.dtype][0])
        return self.read_into(info, out)

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of bfloat16 -> float32 (exact: bf16 is the top half of a float32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _as_float(f: _SafetensorsFile, info: _TensorInfo) -> np.ndarray:
    """A float tensor as float16 (if stored F16) or float32 (BF16 widened exactly, F32)."""
    raw = f.read(info)
    return _bf16_to_f32(raw) if info.dtype == "BF16" else raw


class _TensorIndex:
    """tensor name -> file, from model.safetensors.index.json or from the headers of the folder's files."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._files: dict[str, _SafetensorsFile] = {}
        index = folder / "model.safetensors.index.json"
        if not index.exists():
            others = sorted(folder.glob("*.safetensors.index.json"))
            index = others[0] if len(others) == 1 else None
        if index is not None:
            data = _read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index.name}: expected {{'weight_map': {{tensor name: file name}}}}, "
                                 f"got {str(data)[:200]}")
            self.source = index.name
            self.weight_map = dict(weight_map)
            return
        single = folder / "model.safetensors"
        files = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no safetensors weights (looked for model.safetensors.index.json, "
                                    f"model.safetensors and *.safetensors)")
        self.source = ", ".join(p.name for p in files)
        self.weight_map = {}
        try:
            for p in files:  # no index: the headers are the index (header-only reads)
                for name in self.file(p.name).tensors:
                    self.weight_map[name] = p.name
        except BaseException:
            self.close()
            raise

    def names(self):
        return self.weight_map.keys()

    def file(self, fname: str, tensor: str | None = None) -> _SafetensorsFile:
        f = self._files.get(fname)
        if f is None:
            path = self.folder / fname
            if not path.exists():
                what = f" (it holds tensor '{tensor}' per {self.source})" if tensor else ""
                raise FileNotFoundError(f"{path}: safetensors shard not found{what}")
            f = self._files[fname] = _SafetensorsFile(path)
        return f

    def get(self, name: str) -> tuple[_SafetensorsFile, _TensorInfo] | None:
        """(file, header entry) of tensor `name`, or None when the checkpoint has no such tensor."""
        fname = self.weight_map.get(name)
        if fname is None:
            return None
        f = self.file(fname, name)
        info = f.tensors.get(name)
        if info is None:
            raise ValueError(f"{fname}: {self.source} maps tensor '{name}' to this file, but its header has no "
                             f"such tensor")
        return f, info

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


def _read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


# --------------------------------------------------------------------------- quantization config

_GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class _Quant:
    """How one module is quantized. fmt: "gptq" (v1 zeros), "gptq_v2" (real zeros) or "awq" (AWQ GEMM)."""
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    fmt: str
    rule: str | None = None  # the config entry that decided it (dynamic rule), for messages

    def same_layout(self, other: "_Quant") -> bool:
        return (self.bits, self.group_size, self.sym, self.fmt) == (other.bits, other.group_size, other.sym,
                                                                   other.fmt)

    def describe(self) -> str:
        return (f"bits={self.bits}, group_size={self.group_size}, sym={self.sym}, format={self.fmt}"
                + (f" ({self.rule})" if self.rule else ""))


@dataclass(frozen=True)
class _QuantConfig:
    base: _Quant
    source: str  # "quantize_config.json", "config.json['quantization_config']", ...
    dynamic: tuple  # ((pattern, overrides dict), ...) in file order
    in_block: frozenset | None  # flattened modules_in_block_to_quantize
    not_convert: tuple  # AWQ/transformers modules_to_not_convert (substrings)
    raw: dict

    def module(self, name: str, block: str) -> tuple[_Quant | None, str | None]:
        """(quantization of module `name`, or None if the config says it stays dense; the deciding rule)."""
        for pattern, overrides in self.dynamic:
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None, f"dynamic rule '{pattern}' in {self.source}"
            elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, name):
                rule = f"dynamic rule '{pattern}' in {self.source}"
                q = self.base
                return dataclasses.replace(
                    q, bits=int(overrides.get("bits", q.bits)), group_size=int(overrides.get("group_size",
                                                                                            q.group_size)),
                    sym=bool(overrides.get("sym", q.sym)), desc_act=bool(overrides.get("desc_act", q.desc_act)),
                    rule=rule), rule
        if self.in_block is not None:
            rel = name[len(block) + 1:] if name.startswith(block + ".") else name
            if rel not in self.in_block:
                return None, f"modules_in_block_to_quantize in {self.source} (does not list '{rel}')"
        for sub in self.not_convert:
            if sub in name:
                return None, f"modules_to_not_convert entry '{sub}' in {self.source}"
        return self.base, None


def _refuse(source: str, setting: str, why: str):
    raise ValueError(f"{source}: {setting} is not supported: {why}")


def _check_bits_gs(source: str, bits, group_size, where: str = ""):
    if bits is None:
        raise ValueError(f"{source}: {where}bits: missing (expected 2, 3, 4 or 8)")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (2, 3, 4, 8):
        extra = " (5-7 bits exist only in GPTQModel's planar gptq_p layout)" if bits in (5, 6, 7) else ""
        _refuse(source, f"{where}bits={bits!r}", f"GPTQ checkpoints here have bits 2, 3, 4 or 8{extra}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise ValueError(f"{source}: {where}group_size: expected -1 or a positive int, got {group_size!r}")


def _parse_quant_config(raw: dict, source: str) -> _QuantConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    autoawq = "w_bit" in raw or "q_group_size" in raw  # AutoAWQ's own quant_config.json names no method
    method = str(raw.get("quant_method") or raw.get("method") or ("awq" if autoawq else "gptq")).lower()
    if method == "awq":
        bits = raw.get("bits", raw.get("w_bit"))
        group_size = raw.get("group_size", raw.get("q_group_size"))
        version = str(raw.get("version", raw.get("format", "gemm"))).lower()
        if version != "gemm":
            _refuse(source, f"AWQ version={version!r}", "only AWQ GEMM checkpoints can be repacked to GPTQ layout")
        if bits != 4:
            _refuse(source, f"AWQ bits={bits!r}", "AWQ GEMM checkpoints are 4-bit")
        _check_bits_gs(source, bits, group_size)
        if raw.get("zero_point", True) is not True:
            _refuse(source, "AWQ zero_point=false", "only AWQ with zero points (zero_point=true) is supported")
        base = _Quant(4, group_size, False, False, "awq")
        not_convert = tuple(raw.get("modules_to_not_convert") or ())
        return _QuantConfig(base, source, (), None, not_convert, raw)
    if method != "gptq":
        _refuse(source, f"quant_method={method!r}", "expected 'gptq' or 'awq'")
    if raw.get("is_marlin_format"):
        _refuse(source, "is_marlin_format=true", "Marlin checkpoints are pre-repacked for the Marlin kernel; "
                "export the model in GPTQ format")
    fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    fmt = str(fmt).lower()
    if fmt not in _GPTQ_FORMATS:
        key = "checkpoint_format" if raw.get("checkpoint_format") else "format"
        _refuse(source, f"{key}={fmt!r}", "expected 'gptq' (v1) or 'gptq_v2' (marlin, bitblas and gptq_p use "
                "other layouts)")
    pack_dtype = str(raw.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        _refuse(source, f"pack_dtype={pack_dtype!r}", "qweight/qzeros must be packed in int32 words")
    rotation = raw.get("rotation")
    if rotation not in (None, "", False):
        _refuse(source, f"rotation={rotation!r}", "Hadamard-rotated weights need the rotation applied to the "
                "activations, which cupy_moe does not do")
    bits, group_size = raw.get("bits"), raw.get("group_size")
    _check_bits_gs(source, bits, group_size)
    sym, desc_act = raw.get("sym", True), raw.get("desc_act", False)
    for key, val in (("sym", sym), ("desc_act", desc_act)):
        if not isinstance(val, bool):
            raise ValueError(f"{source}: {key}: expected true or false, got {val!r}")
    base = _Quant(bits, group_size, sym, desc_act, fmt)

    dynamic = raw.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ValueError(f"{source}: dynamic: expected an object {{pattern: overrides}}, got {dynamic!r}")
    rules = []
    for pattern, overrides in dynamic.items():
        try:
            re.compile(pattern[2:] if pattern.startswith(("+:", "-:")) else pattern)
        except re.error as exc:
            raise ValueError(f"{source}: dynamic rule {pattern!r} is not a valid regular expression ({exc})") from None
        overrides = overrides or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"{source}: dynamic rule {pattern!r}: expected an object of overrides, got {overrides!r}")
        if not pattern.startswith("-:"):
            _check_bits_gs(source, overrides.get("bits", bits), overrides.get("group_size", group_size),
                           f"dynamic rule {pattern!r} ")
            pd = str(overrides.get("pack_dtype", "int32")).removeprefix("torch.")
            if pd != "int32":
                _refuse(source, f"dynamic rule {pattern!r} pack_dtype={pd!r}", "qweight/qzeros must be int32 words")
        rules.append((pattern, overrides))

    in_block = raw.get("modules_in_block_to_quantize")
    if in_block is not None:
        flat = []
        for item in in_block:
            flat.extend([item] if isinstance(item, str) else item)
        in_block = frozenset(flat)
    return _QuantConfig(base, source, tuple(rules), in_block, (), raw)


def _find_quant_config(folder: Path, config: dict | None) -> _QuantConfig:
    for name in ("quantize_config.json", "quant_config.json"):
        p = folder / name
        if p.exists():
            return _parse_quant_config(_read_json(p), name)
    if config is not None and config.get("quantization_config") is not None:
        return _parse_quant_config(config["quantization_config"], "config.json['quantization_config']")
    raise ValueError(f"{folder}: no quantization config (looked for quantize_config.json, quant_config.json and "
                     f"config.json['quantization_config'])")


# --------------------------------------------------------------------------- the open checkpoint


class _Checkpoint:
    """An open checkpoint folder: configs, naming scheme, tensor index and lazily opened files."""

    def __init__(self, path, scheme: NamingScheme | None = None):
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: checkpoint folder not found")
        self.folder = folder
        cfg_path = folder / "config.json"
        self.config = _read_json(cfg_path) if cfg_path.exists() else None
        if self.config is not None and not isinstance(self.config, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object, got {type(self.config).__name__}")
        self.quant = _find_quant_config(folder, self.config)
        self.index = _TensorIndex(folder)
        try:
            self.scheme = scheme if scheme is not None else self._detect_scheme()
            if not isinstance(self.scheme, NamingScheme):
                raise TypeError(f"scheme: expected a NamingScheme, got {type(self.scheme).__name__}")
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.index.close()

    # ----------------------------------------------------------- family and sizes
    def _detect_scheme(self) -> NamingScheme:
        from_tensors = _family_from_tensors(self.index.names())
        cfg = self.config or {}
        family, said = None, None
        if cfg.get("model_type") in _MODEL_TYPES:
            family, said = _MODEL_TYPES[cfg["model_type"]], f"model_type '{cfg['model_type']}'"
        else:
            for arch in cfg.get("architectures") or ():
                if arch in _ARCHITECTURES:
                    family, said = _ARCHITECTURES[arch], f"architectures ['{arch}']"
                    break
        if family is None:
            if from_tensors is None:
                what = (f"config.json model_type {cfg.get('model_type')!r}, architectures "
                        f"{cfg.get('architectures')!r}" if self.config else "no config.json")
                raise ValueError(f"{self.folder}: unknown MoE family ({what}, and no tensor names of a known "
                                 f"family); pass scheme=NamingScheme(...) (known: {', '.join(SCHEMES)})")
            return SCHEMES[from_tensors]
        scheme = SCHEMES[family]
        # The config's family must name the tensors the way the checkpoint does.
        if from_tensors is not None and SCHEMES[from_tensors].experts != scheme.experts:
            example = next((n for n in self.index.names() if "experts." in n), "?")
            raise ValueError(f"config.json says {said}, whose experts are named like "
                             f"'{scheme.expert_module(0, 0, scheme.gate_proj)}', but the checkpoint's tensors "
                             f"follow the {from_tensors} naming (e.g. '{example}'); pass scheme=... if intended")
        return scheme

    def cfg(self, key: str, default=None):
        return (self.config or {}).get(key, default)

    def num_layers(self) -> int | None:
        n = self.cfg("num_hidden_layers")
        return int(n) if isinstance(n, int) else None

    def check_layer(self, layer) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
        n = self.num_layers()
        if n is not None:
            if not 0 <= layer < n:
                raise ValueError(f"layer: layer {layer} does not exist: config.json has num_hidden_layers={n} "
                                 f"(layers 0..{n - 1})")
        else:
            prefix = self.scheme.block.format(layer=layer) + "."
            if layer < 0 or not any(name.startswith(prefix) for name in self.index.names()):
                raise ValueError(f"layer: layer {layer} does not exist: no tensor starts with '{prefix}' "
                                 f"(in {self.index.source})")
        reason = self.dense_reason(int(layer))
        if reason:
            raise ValueError(f"layer: layer {layer} is dense ({reason}); it has no experts to load")

    def dense_reason(self, layer: int) -> str | None:
        """Why config.json makes `layer` a dense MLP layer, or None when it is an MoE layer."""
        k = self.cfg("first_k_dense_replace")
        if isinstance(k, int) and layer < k:
            return f"first_k_dense_replace={k}"
        freq = self.cfg("moe_layer_freq")
        if isinstance(freq, int) and freq > 1 and layer % freq:
            return f"moe_layer_freq={freq}"
        only = self.cfg("mlp_only_layers")
        if isinstance(only, list) and layer in only:
            return f"mlp_only_layers={only}"
        step = self.cfg("decoder_sparse_step")
        if isinstance(step, int) and step > 1 and (layer + 1) % step:
            return f"decoder_sparse_step={step}"
        return None

    def moe_layers(self) -> list[int]:
        n = self.num_layers()
        if n is None:
            rx = re.compile(re.escape(self.scheme.block).replace(r"\{layer\}", r"(\d+)") + r"\.")
            found = {int(m.group(1)) for name in self.index.names() if (m := rx.match(name))}
            n = max(found) + 1 if found else 0
        return [i for i in range(n) if self.dense_reason(i) is None]

    def experts_found(self, layer: int) -> dict[int, set]:
        """expert index -> set of proj names present among the tensors of `layer`."""
        rx = self.scheme.expert_regex(layer)
        found: dict[int, set] = {}
        for name in self.index.names():
            m = rx.match(name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
        return found

    def num_experts(self, layer: int) -> int:
        """E from config.json (checked against the tensors), else from the tensors."""
        found = self.experts_found(layer)
        key = self.scheme.num_experts_key
        e = self.cfg(key)
        if isinstance(e, int) and not isinstance(e, bool):
            extra = sorted(i for i in found if i >= e)
            if extra:
                mod = self.scheme.expert_module(layer, extra[0], self.scheme.gate_proj)
                raise ValueError(f"config.json {key}={e}, but the checkpoint has tensors of expert {extra[0]} "
                                 f"(e.g. '{mod}.*' in {self.index.source})")
            return e
        if not found:
            raise ValueError(f"layer {layer}: no routed expert tensors named like "
                             f"'{self.scheme.expert_module(layer, 0, self.scheme.gate_proj)}.*' "
                             f"(in {self.index.source})")
        return max(found) + 1

    # ----------------------------------------------------------- modules
    def tensor(self, name: str):
        return self.index.get(name)

    def module(self, name: str, layer: int) -> "_Module":
        """How module `name` is stored: quantized (GPTQ/AWQ) or dense, after the config and tensors agree."""
        quant, rule = self.quant.module(name, self.scheme.block.format(layer=layer))
        qweight = self.tensor(name + ".qweight")
        weight = self.tensor(name + ".weight")
        if qweight is not None:
            if quant is None:
                raise ValueError(f"{qweight[0].label}: tensor '{name}.qweight' exists, but {rule} says module "
                                 f"'{name}' is not quantized (the config contradicts the tensors)")
            return _Module(name, quant, qweight, rule)
        if weight is not None:
            if quant is not None and rule is not None:
                raise ValueError(f"{weight[0].label}: module '{name}' is stored dense ('{name}.weight'), but {rule} "
                                 f"quantizes it ({quant.describe()}): the config contradicts the tensors")
            return _Module(name, None, weight, rule or "only '.weight' in the checkpoint")
        raise ValueError(f"module '{name}': neither '{name}.qweight' (quantized) nor '{name}.weight' (dense) is in "
                         f"the checkpoint ({self.index.source})")


@dataclass
class _Module:
    name: str
    quant: _Quant | None  # None: dense .weight
    main: tuple  # (file, info) of .qweight or .weight
    rule: str | None = None  # why it is dense / which dynamic rule quantized it

    @property
    def where(self) -> str:
        return self.main[0].label


# --------------------------------------------------------------------------- bit packing (vectorized)


def _unit(bits: int) -> tuple[int, int]:
    """(values per packing unit, int32 words per unit): (32/bits, 1) for 2/4/8 bits, (32, 3) for 3 bits."""
    values = 32 // math.gcd(32, bits)
    return values, values * bits // 32


def _unpack_last(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 [..., W] -> uint8 [..., W*32/bits] fields, lowest field first (GPTQ_FORMAT.md §2)."""
    per, wpu = _unit(bits)
    lead, nw = words.shape[:-1], words.shape[-1]
    u = np.ascontiguousarray(words).view(np.uint32).reshape(*lead, nw // wpu, wpu).astype(np.uint64)
    out = np.empty((*lead, nw // wpu, per), np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for j in range(per):  # one vectorized pass per field position
        word, shift = divmod(bits * j, 32)
        field = u[..., word] >> np.uint64(shift)
        if shift + bits > 32:  # 3-bit fields 10 and 21 straddle two words
            field |= u[..., word + 1] << np.uint64(32 - shift)
        out[..., j] = field & mask
    return out.reshape(*lead, nw // wpu * per)


def _pack_last(values: np.ndarray, bits: int) -> np.ndarray:
    """uint [..., C] fields -> int32 [..., C*bits/32], the inverse of _unpack_last."""
    per, wpu = _unit(bits)
    lead, c = values.shape[:-1], values.shape[-1]
    v = values.reshape(*lead, c // per, per).astype(np.uint64)
    out = np.zeros((*lead, c // per, wpu), np.uint64)
    for j in range(per):
        word, shift = divmod(bits * j, 32)
        out[..., word] |= v[..., j] << np.uint64(shift)
        if shift + bits > 32:
            out[..., word + 1] |= v[..., j] >> np.uint64(32 - shift)
    return (out & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32).reshape(*lead, c // per * wpu)


# Adding 1 to every field of a v1 qzeros word at once: the exact inverse of GPTQModel's word-level v2 -> v1
# export (borrows included) and, on every symmetric checkpoint, the same as per-field (z + 1) & mask.
_V1_WORD_ADD = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}
# AWQ GEMM interleaves 8 nibbles per word: nibble i holds column 8c + _AWQ_ORDER[i] (GPTQ_FORMAT.md §6).
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_AWQ_REVERSE = np.argsort(_AWQ_ORDER)  # column j of a word = nibble _AWQ_REVERSE[j]


def _real_zeros(raw: np.ndarray, quant: _Quant) -> np.ndarray:
    """Stored qzeros int32 [R, N*bits/32] -> real zero points uint8 [R, N]."""
    if quant.fmt == "awq":
        return _unpack_last(raw, 4).reshape(*raw.shape[:-1], -1, 8)[..., _AWQ_REVERSE].reshape(raw.shape[0], -1)
    if quant.fmt == "gptq_v2":
        return _unpack_last(raw, quant.bits)
    if quant.bits in _V1_WORD_ADD:
        added = (raw.view(np.uint32).astype(np.uint64) + _V1_WORD_ADD[quant.bits]) & np.uint64(0xFFFFFFFF)
        return _unpack_last(added.astype(np.uint32).view(np.int32), quant.bits)
    return (_unpack_last(raw, quant.bits) + 1) & ((1 << quant.bits) - 1)  # 3 bits: per field


# --------------------------------------------------------------------------- stacking one projection


@dataclass
class _Plan:
    """Checked (header-only) recipe for one stacked projection: experts x parts concatenated along N."""
    label: str  # "layer 3 w13", for messages
    modules: list  # [E][parts] of _Module
    k: int
    ns: list  # N of each part
    quant: _Quant | None  # None: all dense
    has_g_idx: bool
    has_bias: bool

    @property
    def n(self) -> int:
        return sum(self.ns)


def _expect(ckpt: _Checkpoint, name: str, dtypes: tuple, shape: tuple, why: str, required: bool = True):
    """Header entry of tensor `name` after checking its dtype and shape, or None when optional and absent."""
    got = ckpt.tensor(name)
    if got is None:
        if required:
            raise ValueError(f"tensor '{name}' is missing: expected {dtypes[0]} {list(shape)} ({why}); "
                             f"it is in none of {ckpt.index.source}")
        return None
    f, info = got
    if info.shape != tuple(shape):
        raise ValueError(f"{f.label}: tensor '{name}': expected shape {list(shape)} ({why}), got {list(info.shape)}")
    if info.dtype not in dtypes:
        raise ValueError(f"{f.label}: tensor '{name}': expected dtype {' or '.join(dtypes)} ({why}), "
                         f"got {info.dtype}")
    return got


_FLOATS = ("F16", "BF16", "F32")


def _module_kn(mod: _Module) -> tuple[int, int]:
    """(K, N) of a module from its main tensor's header (used when config.json does not give the sizes)."""
    shape = mod.main[1].shape
    if len(shape) != 2:
        raise ValueError(f"{mod.where}: tensor '{mod.main[1].name}': expected a 2-D tensor, got shape {list(shape)}")
    q = mod.quant
    if q is None:
        return shape[1], shape[0]  # nn.Linear.weight [N, K]
    if q.fmt == "awq":
        return shape[0], shape[1] * 32 // q.bits  # [K, N/8]
    return shape[0] * 32 // q.bits, shape[1]  # [K*bits/32, N]


def _plan(ckpt: _Checkpoint, label: str, modules: list, k: int | None, ns: list | None, source: str) -> _Plan:
    """Check every tensor of `modules` ([E][parts]) against the config and each other, reading headers only.

    k, ns: sizes from config.json (source names the keys), or None to take them from expert 0's tensors.
    """
    mods = [[m for m in row] for row in modules]
    first = mods[0][0]
    if k is None or ns is None:
        k = _module_kn(first)[0]
        ns = [_module_kn(m)[1] for m in mods[0]]
        source = f"like expert 0's '{first.name}'"
    quantized = [m for row in mods for m in row if m.quant is not None]
    dense = [m for row in mods for m in row if m.quant is None]
    if quantized and dense:
        d = dense[0]
        raise ValueError(f"{d.where}: module '{d.name}' is dense ({d.rule}), but the other experts of {label} are "
                         f"quantized ({quantized[0].quant.describe()}); a stacked projection cannot mix dense and "
                         f"GPTQ experts")
    quant = quantized[0].quant if quantized else None
    for m in quantized:
        if not m.quant.same_layout(quant):
            raise ValueError(f"{m.where}: module '{m.name}' is quantized with {m.quant.describe()}, but "
                             f"'{quantized[0].name}' with {quant.describe()}; the experts of {label} must share "
                             f"bits, group_size, sym and format to stack")
    has_g_idx = has_bias = False
    for row in mods:
        for m, n in zip(row, ns):
            why = f"K={k}, N={n} {source}"
            if quant is None:
                _expect(ckpt, m.name + ".weight", _FLOATS, (n, k), f"dense [N, K], {why}")
            else:
                b, per = quant.bits, _unit(quant.bits)[0]
                if k % per or n % per:
                    raise ValueError(f"{m.where}: module '{m.name}': K={k} and N={n} must be multiples of {per} "
                                     f"to pack {b}-bit values ({source})")
                glen = k if quant.group_size == -1 else quant.group_size
                r = -(-k // glen)
                sizes = f"bits={b}, group_size={quant.group_size}, {why}"
                if quant.fmt == "awq":
                    _expect(ckpt, m.name + ".qweight", ("I32",), (k, n * b // 32), f"AWQ [K, N*bits/32], {sizes}")
                else:
                    _expect(ckpt, m.name + ".qweight", ("I32",), (k * b // 32, n), f"[K*bits/32, N], {sizes}")
                _expect(ckpt, m.name + ".qzeros", ("I32",), (r, n * b // 32), f"[ceil(K/G), N*bits/32], {sizes}",
                        required=quant.fmt == "awq" or not quant.sym)
                _expect(ckpt, m.name + ".scales", _FLOATS, (r, n), f"[ceil(K/G), N], {sizes}")
                if quant.fmt != "awq":
                    has_g_idx |= _expect(ckpt, m.name + ".g_idx", ("I32", "I64"), (k,), f"[K], {sizes}",
                                         required=False) is not None
            has_bias |= _expect(ckpt, m.name + ".bias", _FLOATS, (n,), f"[N], {why}", required=False) is not None
    return _Plan(label, mods, k, list(ns), quant, has_g_idx, has_bias)


def _to_fp16(x: np.ndarray, f: _SafetensorsFile, name: str) -> np.ndarray:
    out = x.astype(np.float16)
    if not np.all(np.isfinite(out)) and np.all(np.isfinite(x)):
        raise ValueError(f"{f.label}: tensor '{name}': values up to {np.abs(x).max():g} overflow the float16 "
                         f"scales of the stacked layout")
    return out


def _load_plan(ckpt: _Checkpoint, plan: _Plan, device: bool):
    """Read the tensors of a checked plan into preallocated stacked arrays.

    Returns (weight, bias): weight is a StackedGptqWeight [E, K*bits/32, N] (quantized plan) or a dense float
    array [E, K, N] (W of y = x @ W, float16 if every tensor is F16, else float32); bias is float32 [E, N] or
    None when absent or all zero. Peak extra host memory: one tensor of one expert (plus, for AWQ, a row chunk).
    """
    e_count, k, n = len(plan.modules), plan.k, plan.n
    offsets = np.cumsum([0] + plan.ns)
    bias = np.zeros((e_count, n), np.float32) if plan.has_bias else None
    q = plan.quant
    if q is None:
        all_f16 = all(ckpt.tensor(m.name + ".weight")[1].dtype == "F16" for row in plan.modules for m in row)
        dense = np.empty((e_count, k, n), np.float16 if all_f16 else np.float32)  # [E, K, N]
    else:
        b = q.bits
        glen = k if q.group_size == -1 else q.group_size
        r = -(-k // glen)
        qweight = np.empty((e_count, k * b // 32, n), np.int32)  # [E, K*bits/32, N]
        scales = np.empty((e_count, r, n), np.float16)  # [E, R, N]
        zeros = np.empty((e_count, r, n), np.uint8)  # [E, R, N] real zero points, packed at the end
        g_idx = np.empty((e_count, k), np.int32) if plan.has_g_idx else None  # [E, K]
        default_g = (np.arange(k, dtype=np.int32) // glen)
    for e, row in enumerate(plan.modules):
        for j, m in enumerate(row):
            n0, n1 = int(offsets[j]), int(offsets[j + 1])
            whole = len(row) == 1  # the part is the whole stacked row: read straight into place
            bt = ckpt.tensor(m.name + ".bias")
            if bt is not None:
                bias[e, n0:n1] = _as_float(*bt)
            if q is None:
                f, info = ckpt.tensor(m.name + ".weight")
                dense[e, :, n0:n1] = _as_float(f, info).T  # nn.Linear [N, K] -> W [K, N]
                continue
            f, info = ckpt.tensor(m.name + ".qweight")
            if q.fmt == "awq":
                _awq_qweight_into(f, info, qweight[e, :, n0:n1])
            elif whole:
                f.read_into(info, qweight[e])
            else:
                qweight[e, :, n0:n1] = f.read(info)
            f, info = ckpt.tensor(m.name + ".scales")
            if info.dtype == "F16" and whole:
                f.read_into(info, scales[e])
            else:
                scales[e, :, n0:n1] = _to_fp16(_as_float(f, info), f, info.name)
            zt = ckpt.tensor(m.name + ".qzeros")
            if zt is None:  # symmetric GPTQ without qzeros
                zeros[e, :, n0:n1] = 1 << (b - 1)
            else:
                f, info = zt
                raw = f.read(info)
                zeros[e, :, n0:n1] = _real_zeros(raw, q)
                _check_sym_zeros(f, info, raw, q)
            if g_idx is not None:
                gt = ckpt.tensor(m.name + ".g_idx")
                if gt is None:
                    g = default_g
                else:
                    g = gt[0].read(gt[1])
                    if g.size and (g.min() < 0 or g.max() >= r):
                        raise ValueError(f"{gt[0].label}: tensor '{gt[1].name}': expected group indices in "
                                         f"[0, {r - 1}] (ceil(K/G) = {r}), got range [{g.min()}, {g.max()}]")
                if j == 0:
                    g_idx[e] = g
                elif not np.array_equal(g_idx[e], g):
                    first = row[0].name
                    raise ValueError(f"{gt[0].label if gt else m.where}: tensor '{m.name}.g_idx' differs from "
                                     f"'{first}.g_idx': {plan.label} stacks both along N and keeps one g_idx per "
                                     f"expert, so gate and up must share their act-order groups")
    if bias is not None and not bias.any():
        bias = None  # AutoGPTQ <= 0.7.1 wrote all-zero biases for every layer: nothing to apply
    if q is None:
        return (_put(dense, device), _put(bias, device))
    if g_idx is not None and (g_idx == default_g).all():
        g_idx = None  # plain k // G groups: the kernels' fast path
    half = 1 << (q.bits - 1)
    qzeros = None if (zeros == half).all() else _pack_last(zeros, q.bits)  # symmetric -> None
    del zeros
    weight = StackedGptqWeight(qweight, scales, qzeros, g_idx, q.bits, q.group_size)
    if device:
        weight = weight.to_device()  # one host-to-device copy per stacked tensor (_xp.to_device)
    return weight, _put(bias, device)


def _check_sym_zeros(f: _SafetensorsFile, info: _TensorInfo, raw: np.ndarray, q: _Quant):
    """A symmetric file stores one zero everywhere; the wrong one means the format label is wrong."""
    if not q.sym or q.fmt == "awq" or raw.size == 0:
        return
    half = 1 << (q.bits - 1)
    stored = _unpack_last(raw, q.bits)
    if q.fmt == "gptq" and (stored == half).all():
        raise ValueError(f"{f.label}: tensor '{info.name}': sym=true with checkpoint_format 'gptq' (v1) stores "
                         f"zero {half - 1} (= {half} - 1), but every stored zero is {half}: this is a gptq_v2 file "
                         f"(or mislabeled); the config contradicts the tensors")
    if q.fmt == "gptq_v2" and (stored == half - 1).all():
        raise ValueError(f"{f.label}: tensor '{info.name}': sym=true with checkpoint_format 'gptq_v2' stores "
                         f"zero {half}, but every stored zero is {half - 1}: this is a v1 'gptq' file (or "
                         f"mislabeled); the config contradicts the tensors")


_AWQ_CHUNK_ROWS = 2048  # bounds the unpacked temporaries of the AWQ repack (a multiple of 8)


def _awq_qweight_into(f: _SafetensorsFile, info: _TensorInfo, out: np.ndarray):
    """AWQ GEMM qweight int32 [K, N/8] (packed along N, interleaved) -> GPTQ qweight written into out [K/8, N]."""
    k = info.shape[0]
    for r0 in range(0, k, _AWQ_CHUNK_ROWS):
        r1 = min(k, r0 + _AWQ_CHUNK_ROWS)
        rows = f.read(dataclasses.replace(info, shape=(r1 - r0, info.shape[1]),
                                          start=info.start + r0 * info.shape[1] * 4,
                                          nbytes=(r1 - r0) * info.shape[1] * 4))
        codes = _unpack_last(rows, 4)  # [rows, N] in nibble order
        codes = codes.reshape(r1 - r0, -1, 8)[..., _AWQ_REVERSE].reshape(r1 - r0, -1)  # column order
        out[r0 // 8:r1 // 8] = _pack_last(np.ascontiguousarray(codes.T), 4).T  # pack along K


def _put(x, device: bool):
    """x on the device (one host-to-device copy) when device is True."""
    if x is None or not device:
        return x
    return _xp.to_device(x, "loading onto the device")


# --------------------------------------------------------------------------- public: stacked projections


def _projection_plan(ckpt: _Checkpoint, layer: int, proj: str) -> _Plan:
    s = ckpt.scheme
    if proj == "w13":
        names = [s.gate_proj, s.up_proj]
    elif proj == "w2":
        names = [s.down_proj]
    else:
        raise ValueError(f"proj: expected 'w13' (gate and up) or 'w2' (down), got {proj!r}")
    e_count = ckpt.num_experts(layer)
    modules = [[ckpt.module(s.expert_module(layer, e, p), layer) for p in names] for e in range(e_count)]
    h, i = ckpt.cfg("hidden_size"), ckpt.cfg(s.intermediate_size_key)
    if isinstance(h, int) and isinstance(i, int):
        if proj == "w13":
            k, ns, src = h, [i, i], f"from config.json hidden_size={h}, {s.intermediate_size_key}={i}"
        else:
            k, ns, src = i, [h], f"from config.json {s.intermediate_size_key}={i}, hidden_size={h}"
    else:
        k = ns = src = None
    return _plan(ckpt, f"layer {layer} {proj}", modules, k, ns, src)


def _check_device_bits(plan: _Plan, device: bool):
    if device and plan.quant is not None and plan.quant.bits not in (4, 8):
        raise ValueError(f"device: {plan.label} has bits={plan.quant.bits}, which loads on the host only "
                         f"(device=False, for the NumPy reference); the GPU kernels take bits 4 and 8")


def load_stacked(path, layer: int, proj: str, *, device: bool = True,
                 scheme: NamingScheme | None = None) -> StackedGptqWeight:
    """The stacked GPTQ weight of one projection of one MoE layer.

    path: checkpoint folder. layer: decoder layer index. proj: "w13" (gate and up stacked along N, gate
    columns first: [E, H*bits/32, 2I]) or "w2" (down: [E, I*bits/32, H]).
    device: True -> CuPy arrays (bits 4 and 8 only), False -> NumPy arrays.
    scheme: NamingScheme for a family not detected automatically.
    Zero points come back real (gptq_v2 semantics) or None when symmetric; g_idx None when it is k // G.
    Raises ValueError when the experts are dense (use load_moe_layer) or carry a non-zero bias (which a
    StackedGptqWeight cannot hold; load_moe_layer returns it).
    """
    with _Checkpoint(path, scheme) as ckpt:
        ckpt.check_layer(layer)
        plan = _projection_plan(ckpt, int(layer), proj)
        if plan.quant is None:
            raise ValueError(f"{plan.label}: every expert is dense ('.weight' tensors, e.g. "
                             f"'{plan.modules[0][0].name}.weight'); a StackedGptqWeight holds GPTQ experts only "
                             f"(load_moe_layer returns dense experts as arrays)")
        _check_device_bits(plan, device)
        if device:
            _xp.require_gpu("load_stacked(device=True)")
        weight, bias = _load_plan(ckpt, plan, device)
        if bias is not None:
            raise ValueError(f"{plan.label}: the experts have non-zero '.bias' tensors (e.g. "
                             f"'{plan.modules[0][0].name}.bias'), which a StackedGptqWeight cannot hold; "
                             f"use load_moe_layer, which returns them as w13_bias/w2_bias")
        return weight


# --------------------------------------------------------------------------- public: layers


@dataclass
class SharedExpertWeights:
    """The always-on shared expert MLP of a layer (Qwen2-MoE `shared_expert`, DeepSeek `shared_experts`).

    Stored like one routed expert (E = 1), so the same GEMM path can run it:
    gate_up: StackedGptqWeight [1, H*bits/32, 2*I_s] (gate columns first) or dense float [1, H, 2*I_s].
    down: StackedGptqWeight [1, I_s*bits/32, H] or dense float [1, I_s, H].
    intermediate_size: I_s (DeepSeek: n_shared_experts * moe_intermediate_size, merged in the checkpoint).
    gate_up_bias: float32 [1, 2*I_s] or None; down_bias: float32 [1, H] or None (None also when all zero).
    Dense arrays are float16 when stored F16, float32 otherwise (bf16 widened exactly).
    """
    gate_up: Any
    down: Any
    intermediate_size: int
    gate_up_bias: Any = None
    down_bias: Any = None


@dataclass
class MoELayerWeights:
    """Everything one MoE layer needs, as loaded from a checkpoint (a plain data holder).

    family, layer: the model family ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3" or a
        custom NamingScheme's) and the decoder layer index.
    hidden_size H, intermediate_size I (per routed expert), num_experts E.
    w13: StackedGptqWeight [E, H*bits/32, 2I], gate columns first, then up; or, when every routed expert is
        stored dense, a float array [E, H, 2I] (W of y = x @ W).
    w2: StackedGptqWeight [E, I*bits/32, H], or dense [E, I, H].
    w13_bias float32 [E, 2I], w2_bias float32 [E, H]: non-zero expert biases to add after each GEMM (None when
        absent or all zero).
    router_weight: [E, H] as stored (logits = x @ router_weight.T): float16 if F16 in the file, else float32
        (bf16 widened exactly). router_bias: float32 [E] or None.
    e_score_correction_bias: float32 [E] (DeepSeek-V3: added to the scores for top-k selection only) or None.
    shared: SharedExpertWeights or None. shared_gate_weight: [1, H] (Qwen2-MoE: shared output is scaled by
        sigmoid(x @ shared_gate_weight.T)) or None.
    top_k A; renormalize: divide the top-k weights by their sum (Mixtral always; others config norm_topk_prob);
    scoring_func: "softmax" or "sigmoid"; routed_scaling_factor: multiplies the routed output (DeepSeek; 1.0
        otherwise); topk_method, n_group, topk_group: DeepSeek group-limited routing, as in config.json (None
        when absent); hidden_act: the config's activation ("silu" for every supported family).
    All arrays NumPy (device=False) or CuPy (device=True).
    """
    family: str
    layer: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    w13: Any
    w2: Any
    router_weight: Any
    top_k: int
    renormalize: bool
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    topk_method: str | None = None
    n_group: int | None = None
    topk_group: int | None = None
    hidden_act: str = "silu"
    w13_bias: Any = None
    w2_bias: Any = None
    router_bias: Any = None
    e_score_correction_bias: Any = None
    shared: SharedExpertWeights | None = None
    shared_gate_weight: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of every array held (packed weights, scales, zeros, g_idx, router, biases, shared)."""
        def size(x):
            if isinstance(x, SharedExpertWeights):
                return sum(size(getattr(x, f)) for f in ("gate_up", "down", "gate_up_bias", "down_bias"))
            return int(x.nbytes) if hasattr(x, "nbytes") else 0  # arrays and StackedGptqWeight
        return sum(size(getattr(self, f.name)) for f in dataclasses.fields(self))


def _dense_tensor(ckpt: _Checkpoint, name: str, shape: tuple, why: str, device: bool, as_f32: bool = False):
    f, info = _expect(ckpt, name, _FLOATS, shape, why)
    x = _as_float(f, info)
    return _put(x.astype(np.float32) if as_f32 else x, device)


def _routing(ckpt: _Checkpoint) -> dict:
    s = ckpt.scheme
    top_k = ckpt.cfg(s.top_k_key)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"config.json {s.top_k_key}: expected a positive int (experts per token), got {top_k!r}")
    renorm = s.renormalize
    if renorm is None:
        renorm = ckpt.cfg("norm_topk_prob", s.norm_topk_prob_default)
    scoring = ckpt.cfg("scoring_func", s.scoring_func_default)
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"config.json scoring_func: expected 'softmax' or 'sigmoid', got {scoring!r}")
    return dict(top_k=top_k, renormalize=bool(renorm), scoring_func=scoring,
                routed_scaling_factor=float(ckpt.cfg("routed_scaling_factor", 1.0) or 1.0),
                topk_method=ckpt.cfg("topk_method"), n_group=ckpt.cfg("n_group"), topk_group=ckpt.cfg("topk_group"),
                hidden_act=ckpt.cfg("hidden_act", "silu"))


def _load_layer(ckpt: _Checkpoint, layer: int, device: bool) -> MoELayerWeights:
    s = ckpt.scheme
    if ckpt.config is None:
        raise FileNotFoundError(f"{ckpt.folder / 'config.json'}: not found; load_moe_layer reads the routing "
                                f"settings ({s.top_k_key}, norm_topk_prob) from it")
    ckpt.check_layer(layer)
    layer = int(layer)
    routing = _routing(ckpt)
    # Plan everything (headers only) before reading: a bad tensor anywhere fails before any allocation.
    w13_plan = _projection_plan(ckpt, layer, "w13")
    w2_plan = _projection_plan(ckpt, layer, "w2")
    e_count, h, i = len(w13_plan.modules), w13_plan.k, w13_plan.ns[0]
    plans = [w13_plan, w2_plan]
    shared_plans = None
    if s.shared_experts is not None:
        i_cfg = ckpt.cfg("shared_expert_intermediate_size")  # Qwen2-MoE
        if i_cfg is None and isinstance(ckpt.cfg("n_shared_experts"), int):  # DeepSeek: merged shared experts
            i_cfg = ckpt.cfg("n_shared_experts") * i
        down_name = s.shared_experts.format(layer=layer, proj=s.down_proj)
        present = ckpt.tensor(down_name + ".qweight") or ckpt.tensor(down_name + ".weight")
        if (i_cfg or 0) > 0 or (i_cfg is None and present):
            gate_up = [[ckpt.module(s.shared_experts.format(layer=layer, proj=p), layer)
                        for p in (s.gate_proj, s.up_proj)]]
            down = [[ckpt.module(down_name, layer)]]
            src = "from config.json"
            if i_cfg is None:
                i_cfg, src = _module_kn(gate_up[0][0])[1], "from the shared gate tensor"
            shared_plans = (_plan(ckpt, f"layer {layer} shared gate_up", gate_up, h, [i_cfg, i_cfg], src),
                            _plan(ckpt, f"layer {layer} shared down", down, i_cfg, [h], src))
            plans += list(shared_plans)
    for plan in plans:
        _check_device_bits(plan, device)
    if device:
        _xp.require_gpu("load_moe_layer(device=True)")
    router_name = s.router.format(layer=layer)
    if ckpt.tensor(router_name + ".qweight") is not None:
        raise ValueError(f"{ckpt.tensor(router_name + '.qweight')[0].label}: the router '{router_name}' is quantized "
                         f"('.qweight'); cupy_moe expects a dense router '{router_name}.weight' [E, H]")
    _expect(ckpt, router_name + ".weight", _FLOATS, (e_count, h), f"router [E, H], E={e_count}, H={h}")
    sbias = s.score_bias.format(layer=layer) if s.score_bias else None
    if sbias:
        _expect(ckpt, sbias, _FLOATS, (e_count,), f"[E], E={e_count}")
    sgate = s.shared_expert_gate.format(layer=layer) if (s.shared_expert_gate and shared_plans) else None
    if sgate:
        _expect(ckpt, sgate + ".weight", _FLOATS, (1, h), f"shared expert gate [1, H], H={h}")

    # Load one projection at a time; device=True moves each off the host before the next is read.
    w13, w13_bias = _load_plan(ckpt, w13_plan, device)
    w2, w2_bias = _load_plan(ckpt, w2_plan, device)
    shared_w = None
    if shared_plans:
        gu, gu_bias = _load_plan(ckpt, shared_plans[0], device)
        dn, dn_bias = _load_plan(ckpt, shared_plans[1], device)
        shared_w = SharedExpertWeights(gu, dn, shared_plans[1].k, gu_bias, dn_bias)
    router = _dense_tensor(ckpt, router_name + ".weight", (e_count, h), "router [E, H]", device)
    rb = ckpt.tensor(router_name + ".bias")
    router_bias = _dense_tensor(ckpt, router_name + ".bias", (e_count,), "[E]", device, True) if rb else None
    return MoELayerWeights(
        family=s.family, layer=layer, hidden_size=h, intermediate_size=i, num_experts=e_count,
        w13=w13, w2=w2, router_weight=router, w13_bias=w13_bias, w2_bias=w2_bias, router_bias=router_bias,
        e_score_correction_bias=_dense_tensor(ckpt, sbias, (e_count,), "[E]", device, True) if sbias else None,
        shared=shared_w,
        shared_gate_weight=_dense_tensor(ckpt, sgate + ".weight", (1, h), "[1, H]", device) if sgate else None,
        **routing)


def load_moe_layer(path, layer: int, *, device: bool = True, scheme: NamingScheme | None = None) -> MoELayerWeights:
    """Load everything MoE layer `layer` needs: stacked experts, router, shared experts, routing settings.

    path: checkpoint folder (config.json required: it holds top-k and renormalization).
    layer: decoder layer index; a dense layer (DeepSeek first_k_dense_replace, Qwen mlp_only_layers) raises.
    device: True -> CuPy arrays (bits 4 and 8), False -> NumPy arrays (any of bits 2, 3, 4, 8).
    scheme: NamingScheme for families not detected from config.json / tensor names.
    Reads only this layer's tensors, each once; see MoELayerWeights for what comes back.
    """
    with _Checkpoint(path, scheme) as ckpt:
        return _load_layer(ckpt, layer, device)


def load_moe_model(path, *, device: bool = True, progress: bool | Callable | None = None,
                   scheme: NamingScheme | None = None, layers: Iterable[int] | None = None
                   ) -> dict[int, MoELayerWeights]:
    """Load every MoE layer of a checkpoint: {layer index: MoELayerWeights}, dense layers skipped.

    progress: None -> a progress line on stderr when stderr is a terminal; True/False force it on/off;
        a callable is called as progress(done, total, layer) after each layer.
    layers: only these layer indices (default: every MoE layer config.json describes).
    Other arguments as load_moe_layer. Layers load one after another, each read once.
    """
    out = {}
    with _Checkpoint(path, scheme) as ckpt:
        todo = ckpt.moe_layers() if layers is None else [int(x) for x in layers]
        show = sys.stderr.isatty() if progress is None else progress
        t0, total_bytes = time.perf_counter(), 0
        for done, layer in enumerate(todo, 1):
            out[layer] = _load_layer(ckpt, layer, device)
            total_bytes += out[layer].nbytes
            if callable(show):
                show(done, len(todo), layer)
            elif show:
                sys.stderr.write(f"\rcupy_moe: loaded MoE layer {layer} ({done}/{len(todo)}, "
                                 f"{total_bytes / 2**30:.2f} GiB, {time.perf_counter() - t0:.1f} s)")
                sys.stderr.flush()
        if show and not callable(show):
            sys.stderr.write("\n")
    return out


# --------------------------------------------------------------------------- public: inspection


def inspect_checkpoint(path, *, scheme: NamingScheme | None = None) -> dict:
    """Describe a checkpoint from its configs and safetensors headers only (no tensor data is read).

    Returns a JSON-serializable dict: path, family, model_type, architectures, files [{name, bytes, tensors}],
    total_bytes, quantization {method, bits, group_size, sym, desc_act, checkpoint_format, source, dynamic,
    modules_in_block_to_quantize}, hidden_size, intermediate_size, num_experts, top_k, renormalize,
    scoring_func, num_layers, moe_layers, dense_layers {layer: reason}, layers [{layer, experts_found,
    experts ("gptq", "awq", "dense" or "mixed"), expert_bytes, shared_experts}], problems [str] (tensors or
    files missing, found from the headers).
    """
    with _Checkpoint(path, scheme) as ckpt:
        s, q = ckpt.scheme, ckpt.quant
        files = {}
        problems = []
        for fname in sorted(set(ckpt.index.weight_map.values())):
            try:
                f = ckpt.index.file(fname)
                files[fname] = {"name": fname, "bytes": f.path.stat().st_size, "tensors": len(f.tensors)}
            except (FileNotFoundError, ValueError) as exc:
                problems.append(str(exc))
        n_layers = ckpt.num_layers()
        moe = ckpt.moe_layers()
        dense = {i: ckpt.dense_reason(i) for i in range(n_layers or 0) if ckpt.dense_reason(i)}
        layers = []
        for layer in moe:
            found = ckpt.experts_found(layer)
            try:
                e_count = ckpt.num_experts(layer)
            except ValueError as exc:
                problems.append(str(exc))
                e_count = max(found) + 1 if found else 0
            kinds, nbytes = set(), 0
            for e in range(e_count):
                for p in (s.gate_proj, s.up_proj, s.down_proj):
                    mod = s.expert_module(layer, e, p)
                    kind = None
                    for suffix in (".qweight", ".qzeros", ".scales", ".g_idx", ".weight"):
                        try:
                            got = ckpt.tensor(mod + suffix)
                        except (FileNotFoundError, ValueError) as exc:
                            problems.append(str(exc))
                            got = None
                        if got is not None:
                            nbytes += got[1].nbytes
                            if suffix == ".qweight":
                                kind = "awq" if q.base.fmt == "awq" else "gptq"
                            elif suffix == ".weight":
                                kind = kind or "dense"
                    if kind is None:
                        problems.append(f"layer {layer}: expert {e} has no '{mod}.qweight' or '{mod}.weight'")
                    else:
                        kinds.add(kind)
            shared = None
            if s.shared_experts:
                mod = s.shared_experts.format(layer=layer, proj=s.down_proj)
                if mod + ".qweight" in ckpt.index.weight_map:
                    shared = "gptq"
                elif mod + ".weight" in ckpt.index.weight_map:
                    shared = "dense"
            layers.append({"layer": layer, "experts_found": len(found),
                           "experts": kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else None),
                           "expert_bytes": nbytes, "shared_experts": shared})
        top_k = ckpt.cfg(s.top_k_key)
        renorm = s.renormalize if s.renormalize is not None else ckpt.cfg("norm_topk_prob",
                                                                         s.norm_topk_prob_default)
        return {
            "path": str(ckpt.folder), "family": s.family, "model_type": ckpt.cfg("model_type"),
            "architectures": ckpt.cfg("architectures"), "files": list(files.values()),
            "total_bytes": sum(f["bytes"] for f in files.values()),
            "quantization": {"method": "awq" if q.base.fmt == "awq" else "gptq", "bits": q.base.bits,
                             "group_size": q.base.group_size, "sym": q.base.sym, "desc_act": q.base.desc_act,
                             "checkpoint_format": q.base.fmt, "source": q.source,
                             "dynamic": {p: o for p, o in q.dynamic} or None,
                             "modules_in_block_to_quantize": sorted(q.in_block) if q.in_block is not None else None},
            "hidden_size": ckpt.cfg("hidden_size"), "intermediate_size": ckpt.cfg(s.intermediate_size_key),
            "num_experts": ckpt.cfg(s.num_experts_key), "top_k": top_k, "renormalize": renorm,
            "scoring_func": ckpt.cfg("scoring_func", s.scoring_func_default), "num_layers": n_layers,
            "moe_layers": moe, "dense_layers": dense, "layers": layers, "problems": list(dict.fromkeys(problems)),
        }
