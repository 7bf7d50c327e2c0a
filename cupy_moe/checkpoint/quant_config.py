"""Quantization configs of GPTQ and AWQ checkpoints: parsing, per-module overrides, and how each format
stores a Linear's tensors.

The config is found in quantize_config.json, quant_config.json (AutoAWQ) or config.json['quantization_config'].
`quant_method` picks a parser from _PARSERS; the parsed `checkpoint_format` names a StorageFormat in FORMATS,
which tells the loader how the tensors are laid out. A format whose tensors fit StorageFormat's fields is a
parser and/or one FORMATS entry; a new kind of layout adds a field there and its reading in loading.py.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from .safetensors import read_json

__all__ = ["StorageFormat", "FORMATS", "Quant", "QuantConfig", "parse_quant_config", "find_quant_config"]


@dataclass(frozen=True)
class StorageFormat:
    """How a checkpoint format stores one quantized Linear (K in-features, N out-features, R = ceil(K/G)).

    name: the format label ("gptq", "gptq_v2", "awq"). method: the quantization method it belongs to.
    packed_along_n: qweight is [K, N*bits/32], packed along N in the AWQ nibble order (AWQ GEMM), instead of
        GPTQ's [K*bits/32, N] packed along K.
    zeros: how qzeros [R, N*bits/32] store zero points: "v1" (real zero - 1), "real", or "awq" (real, in the AWQ
        nibble order).
    zeros_always: qzeros are stored even for symmetric weights (GPTQ may omit them when sym).
    g_idx: modules may carry an act-order `.g_idx` [K].
    transposed: every tensor is stored [N, ...] (compressed-tensors): qweight [N, K*bits/32] packed along K,
        scales [N, R], zero points [N*bits/32, R] packed along N (or int8 [N, R] unpacked, older files).
        Packed words hold values + 2**(bits-1) lowest first, as GPTQ's, so a transpose gives GPTQ's words.
    suffixes: the tensor name suffixes of (qweight, qzeros, scales, g_idx) after the module name.
    shape_tensor: suffix of a tensor holding the unpacked [N, K] (compressed-tensors' weight_shape), or None.
    """
    name: str
    method: str
    packed_along_n: bool = False
    zeros: str = "real"
    zeros_always: bool = False
    g_idx: bool = True
    transposed: bool = False
    suffixes: tuple = ("qweight", "qzeros", "scales", "g_idx")
    shape_tensor: str | None = None

    def tensor(self, module: str, role: str) -> str:
        """Tensor name of `role` ("qweight", "qzeros", "scales" or "g_idx") of `module` in this format."""
        return f"{module}.{self.suffixes[('qweight', 'qzeros', 'scales', 'g_idx').index(role)]}"


FORMATS = {f.name: f for f in (
    StorageFormat("gptq", "gptq", zeros="v1"),
    StorageFormat("gptq_v2", "gptq"),
    StorageFormat("awq", "awq", packed_along_n=True, zeros="awq", zeros_always=True, g_idx=False),
    StorageFormat("pack-quantized", "compressed-tensors", transposed=True,
                  suffixes=("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx"),
                  shape_tensor="weight_shape"),
)}
_GPTQ_FORMATS = tuple(f.name for f in FORMATS.values() if f.method == "gptq")


@dataclass(frozen=True)
class Quant:
    """How one module is quantized. fmt: a FORMATS name: "gptq" (v1 zeros), "gptq_v2" (real zeros), "awq" or
    "pack-quantized" (compressed-tensors). desc_act: act-order groups, so every module stores its g_idx."""
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    fmt: str
    rule: str | None = None  # the config entry that decided it (dynamic rule), for messages

    @property
    def storage(self) -> StorageFormat:
        return FORMATS[self.fmt]

    def same_layout(self, other: "Quant") -> bool:
        return (self.bits, self.group_size, self.sym, self.fmt) == (other.bits, other.group_size, other.sym,
                                                                   other.fmt)

    def describe(self) -> str:
        return (f"bits={self.bits}, group_size={self.group_size}, sym={self.sym}, format={self.fmt}"
                + (f" ({self.rule})" if self.rule else ""))


@dataclass(frozen=True)
class QuantConfig:
    base: Quant
    source: str  # "quantize_config.json", "config.json['quantization_config']", ...
    dynamic: tuple  # ((pattern, overrides dict), ...) in file order
    in_block: frozenset | None  # flattened modules_in_block_to_quantize
    not_convert: tuple  # AWQ/transformers modules_to_not_convert (substrings)
    raw: dict
    labels: dict = dataclasses.field(default_factory=dict)  # pattern -> how to name its rule in messages
    default_dense: bool = False  # modules no rule names stay dense (compressed-tensors without a Linear group)

    def _rule(self, pattern: str) -> str:
        return self.labels.get(pattern) or f"dynamic rule '{pattern}' in {self.source}"

    def module(self, name: str, block: str) -> tuple[Quant | None, str | None]:
        """(quantization of module `name`, or None if the config says it stays dense; the deciding rule)."""
        for pattern, overrides in self.dynamic:
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None, self._rule(pattern)
            elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, name):
                rule = self._rule(pattern)
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
        if self.default_dense:
            return None, f"no config_groups target in {self.source}"
        return self.base, None


def _refuse(source: str, setting: str, why: str):
    raise ValueError(f"{source}: {setting} is not supported: {why}")


def _strings(source: str, key: str, value, nested: bool = False) -> list:
    """A config list of strings (None: []); nested: items may be lists of strings too, flattened (optimum's
    modules_in_block_to_quantize groups them)."""
    flat = []
    if isinstance(value, list):
        for item in value:
            flat.extend(item if nested and isinstance(item, list) else [item])
    if value is not None and (not isinstance(value, list) or not all(isinstance(x, str) for x in flat)):
        what = "a list of strings or of lists of strings" if nested else "a list of strings"
        raise TypeError(f"{source}: {key}: expected {what}, got {value!r}")
    return flat


def _regex(source: str, what: str, pattern: str) -> None:
    """ValueError naming the config entry when `pattern` is not a valid regular expression."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{source}: {what} is not a valid regular expression ({exc})") from None


def _check_bits_gs(source: str, bits, group_size, where: str = ""):
    if bits is None:
        raise ValueError(f"{source}: {where}bits: missing (expected 2, 3, 4 or 8)")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (2, 3, 4, 8):
        extra = " (5-7 bits exist only in GPTQModel's planar gptq_p layout)" if bits in (5, 6, 7) else ""
        _refuse(source, f"{where}bits={bits!r}", f"GPTQ checkpoints here have bits 2, 3, 4 or 8{extra}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise ValueError(f"{source}: {where}group_size: expected -1 or a positive int, got {group_size!r}")


def _parse_awq(raw: dict, source: str) -> QuantConfig:
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
    base = Quant(4, group_size, False, False, "awq")
    not_convert = tuple(_strings(source, "modules_to_not_convert", raw.get("modules_to_not_convert")))
    return QuantConfig(base, source, (), None, not_convert, raw)


def _parse_gptq(raw: dict, source: str) -> QuantConfig:
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
    base = Quant(bits, group_size, sym, desc_act, fmt)

    dynamic = raw.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ValueError(f"{source}: dynamic: expected an object {{pattern: overrides}}, got {dynamic!r}")
    rules = []
    for pattern, overrides in dynamic.items():
        _regex(source, f"dynamic rule {pattern!r}", pattern[2:] if pattern.startswith(("+:", "-:")) else pattern)
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
        in_block = frozenset(_strings(source, "modules_in_block_to_quantize", in_block, nested=True))
    return QuantConfig(base, source, tuple(rules), in_block, (), raw)


# compressed-tensors (llm-compressor): formats other than pack-quantized, by what they hold.
_CT_OTHER_FORMATS = {
    "float-quantized": "FP8 weights", "naive-quantized": "unpacked int8 weights", "int-quantized":
    "int8 weights with int8 activations (W8A8)", "marlin-24": "2:4-sparse Marlin weights",
    "sparse-24-bitmask": "2:4-sparse weights", "sparse-bitmask": "sparse weights", "nvfp4-pack-quantized":
    "NVFP4 weights", "mxfp4-pack-quantized": "MXFP4 weights", "dense": "unquantized weights"}


def _ct_group(source: str, name: str, group: dict, global_fmt) -> Quant:
    """The Quant of one compressed-tensors config group, or ValueError naming the setting we do not run."""
    where = f"config_groups['{name}']"
    if not isinstance(group, dict):
        raise ValueError(f"{source}: {where}: expected an object, got {group!r}")
    fmt = group.get("format") or global_fmt
    if fmt is not None and not isinstance(fmt, str):
        raise TypeError(f"{source}: {where} format: expected a string such as 'pack-quantized', got {fmt!r}")
    if fmt != "pack-quantized":
        _refuse(source, f"{where} format={fmt!r}", f"{_CT_OTHER_FORMATS.get(fmt, 'an unknown format')}; cupy_moe "
                "runs compressed-tensors 'pack-quantized' int weights with float activations (W4A16, W8A16)")
    for act in ("input_activations", "output_activations"):
        if group.get(act):
            _refuse(source, f"{where} {act}={group[act]!r}", "quantized activations (W8A8, W4A8, FP8) need "
                    "activation quantization, which cupy_moe does not do (W4A16/W8A16 have them null)")
    w = group.get("weights")
    if not isinstance(w, dict):
        _refuse(source, f"{where} weights={w!r}", "a group without weight quantization cannot be mapped")
    if w.get("type", "int") != "int":
        _refuse(source, f"{where} weights.type={w.get('type')!r}", "only int weights are packed (FP8/FP4 are not)")
    if w.get("dynamic"):
        _refuse(source, f"{where} weights.dynamic={w['dynamic']!r}", "weights need static scales")
    strategy = w.get("strategy")
    if strategy == "group":
        group_size = w.get("group_size")
    elif strategy == "channel":
        group_size = -1
    else:
        _refuse(source, f"{where} weights.strategy={strategy!r}", "expected 'group' or 'channel' (one scale "
                "per group of K or per output channel)")
    bits = w.get("num_bits")
    if bits not in (4, 8):
        _refuse(source, f"{where} weights.num_bits={bits!r}", "pack-quantized weights here have 4 or 8 bits")
    _check_bits_gs(source, bits, group_size, f"{where} weights.")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise ValueError(f"{source}: {where} weights.symmetric: expected true or false, got {sym!r}")
    actorder = w.get("actorder")
    if actorder not in (None, False, True, "group", "weight", "static", "dynamic"):
        _refuse(source, f"{where} weights.actorder={actorder!r}", "expected null, 'group', 'weight' or 'static'")
    # desc_act: groups follow a stored weight_g_idx, which only actorder "group" (True; "dynamic" is its alias in
    # compressed-tensors) writes; "weight" and "static" reorder the columns while quantizing but keep the groups
    # contiguous (k // G, no g_idx).
    return Quant(bits, group_size, sym, actorder in (True, "group", "dynamic"), "pack-quantized")


def _ct_pattern(target: str) -> str | None:
    """A compressed-tensors target or ignore entry as a regular expression over module names (None: "Linear")."""
    if target == "Linear":
        return None
    if target.startswith("re:"):
        return target[3:]
    return re.escape(target) + "$"  # a module name (class names other than Linear cannot be mapped)


def _parse_compressed_tensors(raw: dict, source: str) -> QuantConfig:
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        _refuse(source, f"quantization_status={status!r}", "only 'compressed' checkpoints store packed weights")
    sparsity = raw.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        _refuse(source, f"sparsity_config format={sparsity.get('format')!r}", "sparse (2:4) weights need a sparse "
                "kernel, which cupy_moe does not have")
    if raw.get("transform_config"):
        _refuse(source, "transform_config", "rotated weights need the rotation applied to the activations")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{source}: config_groups: expected an object of quantization groups, got {groups!r}")
    global_fmt = raw.get("format")
    rules, labels, base = [], {}, None
    for entry in _strings(source, "ignore", raw.get("ignore")):
        pattern = "-:" + _ct_pattern(entry) if entry != "Linear" else "-:.*"
        _regex(source, f"ignore entry {entry!r}", pattern[2:])
        rules.append((pattern, {}))
        labels[pattern] = f"ignore entry '{entry}' in {source}"
    quants = {}
    for name, group in groups.items():
        quants[name] = q = _ct_group(source, name, group, global_fmt)
        targets = group.get("targets")
        if targets is not None and not isinstance(targets, list):
            raise TypeError(f"{source}: config_groups['{name}'] targets: expected a list of strings, got {targets!r}")
        for target in targets or ():
            if not isinstance(target, str) or (target != "Linear" and not target.startswith("re:")
                                               and "." not in target):
                raise ValueError(f"{source}: config_groups['{name}'] targets {target!r}: cannot be mapped to tensor "
                                 f"names (expected 'Linear', 're:<regex>' or a module name)")
            pattern = _ct_pattern(target)
            if pattern is not None:
                _regex(source, f"config_groups['{name}'] target {target!r}", pattern)
            if pattern is None:
                if base is not None:
                    raise ValueError(f"{source}: config_groups['{name}'] targets 'Linear', as another group does: "
                                     f"which one quantizes a module is ambiguous")
                base = q
                continue
            overrides = {"bits": q.bits, "group_size": q.group_size, "sym": q.sym, "desc_act": q.desc_act}
            rules.append(("+:" + pattern, overrides))
            labels["+:" + pattern] = f"config_groups['{name}'] target '{target}' in {source}"
    default_dense = base is None
    base = base or next(iter(quants.values()))
    return QuantConfig(base, source, tuple(rules), None, (), raw, labels, default_dense)


_PARSERS = {"gptq": _parse_gptq, "awq": _parse_awq,
            "compressed-tensors": _parse_compressed_tensors}  # quant_method -> parser


def parse_quant_config(raw: dict, source: str) -> QuantConfig:
    """Parse a quantization config (source names where it came from, for messages); unsupported settings raise."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    autoawq = "w_bit" in raw or "q_group_size" in raw  # AutoAWQ's own quant_config.json names no method
    method = str(raw.get("quant_method") or raw.get("method") or ("awq" if autoawq else "gptq")).lower()
    if method not in _PARSERS:
        _refuse(source, f"quant_method={method!r}", f"expected {' or '.join(repr(m) for m in _PARSERS)}")
    return _PARSERS[method](raw, source)


def find_quant_config(folder: Path, config: dict | None) -> QuantConfig:
    """The checkpoint's quantization config, from its first file found (config: the parsed config.json)."""
    for name in ("quantize_config.json", "quant_config.json"):
        p = folder / name
        if p.exists():
            return parse_quant_config(read_json(p), name)
    if config is not None and config.get("quantization_config") is not None:
        return parse_quant_config(config["quantization_config"], "config.json['quantization_config']")
    raise ValueError(f"{folder}: no quantization config (looked for quantize_config.json, quant_config.json and "
                     f"config.json['quantization_config']): cupy_moe runs GPTQ, AWQ or compressed-tensors "
                     f"checkpoints, not unquantized ones")

