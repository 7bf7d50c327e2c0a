"""Loading one MoE layer: the loading plan (every check, from headers only), then the stacked expert weights,
router and shared experts, read one tensor at a time into preallocated stacked arrays.

    load_stacked(path, layer, "w13")   -> StackedGptqWeight [E, H*bits/32, 2I] (gate columns first, then up)
    load_stacked(path, layer, "w2")    -> StackedGptqWeight [E, I*bits/32, H]
    load_layer_weights(path, layer)    -> MoELayerWeights (w13, w2, router, shared experts, routing settings)
    load_model_weights(path)           -> {layer: MoELayerWeights} for every MoE layer, with progress on a tty

How a layer is read: only the requested layer's tensors, one at a time, straight from the files with
positioned reads, into arrays preallocated for the stacked result; then one host-to-device copy per stacked
tensor. Every shape, dtype and config check runs on the safetensors headers before a byte of tensor data is
read, and nothing half-built is returned. Expected shapes come from `weights.stacked_shapes`.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .. import _packing, _xp
from .._progress import progress_bar
from ..weights import StackedGptqWeight, expert_shapes, group_len, stacked_shapes
from . import routing
from .folder import Checkpoint, Module
from .naming import NamingScheme
from .quant_config import Quant
from .safetensors import FLOATS, SafetensorsFile, TensorInfo, as_float

__all__ = ["MoELayerWeights", "SharedExpertWeights", "load_stacked", "load_layer_weights", "load_model_weights"]


def _real_zeros(raw: np.ndarray, quant: Quant) -> np.ndarray:
    """Stored zero points -> real zero points uint8 [R, N]: qzeros int32 [R, N*bits/32] (GPTQ, AWQ), or
    compressed-tensors' weight_zero_point, int32 [N*bits/32, R] packed along N or int8 [N, R] (value - 2**(bits-1))."""
    zeros = quant.storage.zeros
    if quant.storage.transposed:
        if raw.dtype == np.int8:
            return (raw.astype(np.int16) + (1 << (quant.bits - 1))).astype(np.uint8).T
        return _packing.unpack(np.ascontiguousarray(raw.T), quant.bits)
    if zeros == "awq":
        return _packing.awq_deinterleave(_packing.unpack(raw, 4))
    return _packing.unpack(_packing.v1_to_real(raw, quant.bits) if zeros == "v1" else raw, quant.bits)


# --------------------------------------------------------------------------- stacking one projection


@dataclass
class _Plan:
    """Checked (header-only) recipe for one stacked projection: experts x parts concatenated along N."""
    label: str  # "layer 3 w13", for messages
    modules: list  # [E][parts] of Module
    k: int
    ns: list  # N of each part
    quant: Quant | None  # None: all dense
    has_g_idx: bool
    has_bias: bool

    @property
    def n(self) -> int:
        return sum(self.ns)


def _expect(ckpt: Checkpoint, name: str, dtypes: tuple, shape: tuple, why: str, required: bool = True):
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


def _module_kn(mod: Module) -> tuple[int, int]:
    """(K, N) of a module from its main tensor's header (used when config.json does not give the sizes)."""
    shape = mod.main[1].shape
    if len(shape) != 2:
        raise ValueError(f"{mod.where}: tensor '{mod.main[1].name}': expected a 2-D tensor, got shape {list(shape)}")
    q = mod.quant
    if q is None:
        return shape[1], shape[0]  # nn.Linear.weight [N, K]
    if q.storage.packed_along_n:
        return shape[0], shape[1] * 32 // q.bits  # [K, N*bits/32]
    if q.storage.transposed:
        return shape[1] * 32 // q.bits, shape[0]  # [N, K*bits/32]
    return shape[0] * 32 // q.bits, shape[1]  # [K*bits/32, N]


def _plan(ckpt: Checkpoint, label: str, modules: list, k: int | None, ns: list | None, source: str) -> _Plan:
    """Check every tensor of `modules` ([E][parts]) against the config and each other, reading headers only.

    k, ns: sizes from config.json (source names the keys), or None to take them from expert 0's tensors.
    """
    mods = [[m for m in row] for row in modules]
    first = mods[0][0]
    if k is None or ns is None:
        k = _module_kn(first)[0]
        ns = [_module_kn(m)[1] for m in mods[0]]
        source = f"like expert 0's '{first.name}'"
    if k < 1 or min(ns) < 1:
        raise ValueError(f"{label}: expected positive sizes, got K={k}, N={' + '.join(map(str, ns))} ({source})")
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
    g_idx_of, bias_of = {}, {}  # module name -> whether the tensor is present
    for row in mods:
        for m, n in zip(row, ns):
            why = f"K={k}, N={n} {source}"
            if quant is None:
                _expect(ckpt, m.name + ".weight", FLOATS, (n, k), f"dense [N, K], {why}")
            else:
                b, per, fmt = quant.bits, _packing.unit(quant.bits)[0], quant.storage
                if k % per or n % per:
                    raise ValueError(f"{m.where}: module '{m.name}': K={k} and N={n} must be multiples of {per} "
                                     f"to pack {b}-bit values ({source})")
                want = expert_shapes(k, n, b, quant.group_size)
                sizes = f"bits={b}, group_size={quant.group_size}, {why}"
                name = lambda role: fmt.tensor(m.name, role)  # noqa: E731
                if fmt.packed_along_n:
                    _expect(ckpt, name("qweight"), ("I32",), (k, n * b // 32), f"AWQ [K, N*bits/32], {sizes}")
                elif fmt.transposed:
                    _expect(ckpt, name("qweight"), ("I32",), want["qweight"][::-1], f"[N, K*bits/32], {sizes}")
                else:
                    _expect(ckpt, name("qweight"), ("I32",), want["qweight"], f"[K*bits/32, N], {sizes}")
                if fmt.transposed:
                    zt = ckpt.tensor(name("qzeros"))
                    unpacked = zt is not None and zt[1].dtype == "I8"
                    _expect(ckpt, name("qzeros"), ("I8",) if unpacked else ("I32",),
                            want["scales"][::-1] if unpacked else want["qzeros"][::-1],
                            f"{'[N, R]' if unpacked else '[N*bits/32, R]'}, {sizes}", required=not quant.sym)
                    _expect(ckpt, name("scales"), FLOATS, want["scales"][::-1], f"[N, ceil(K/G)], {sizes}")
                    _expect(ckpt, f"{m.name}.{fmt.shape_tensor}", ("I32", "I64"), (2,), "[N, K]", required=False)
                else:
                    _expect(ckpt, name("qzeros"), ("I32",), want["qzeros"], f"[ceil(K/G), N*bits/32], {sizes}",
                            required=fmt.zeros_always or not quant.sym)
                    _expect(ckpt, name("scales"), FLOATS, want["scales"], f"[ceil(K/G), N], {sizes}")
                if fmt.g_idx:
                    act_order = m.quant.desc_act and m.quant.group_size != -1  # one group: g_idx changes nothing
                    need = f"; desc_act=true in {ckpt.quant.source} (act-order) needs it" if act_order else ""
                    g_idx_of[name("g_idx")] = _expect(ckpt, name("g_idx"), ("I32", "I64"), want["g_idx"],
                                                      f"[K], {sizes}{need}", required=act_order) is not None
            bias_of[m.name + ".bias"] = _expect(ckpt, m.name + ".bias", FLOATS, (n,), f"[N], {why}",
                                                required=False) is not None
    _all_or_none(ckpt, label, g_idx_of)
    _all_or_none(ckpt, label, bias_of)
    return _Plan(label, mods, k, list(ns), quant, any(g_idx_of.values()), any(bias_of.values()))


def _all_or_none(ckpt: Checkpoint, label: str, present: dict):
    """ValueError naming a module whose optional tensor is missing when another module of the stack has it (the
    stacked layout keeps one for every expert or none, and a default in its place would be silently wrong)."""
    have = [name for name, ok in present.items() if ok]
    if have and len(have) < len(present):
        missing = next(name for name, ok in present.items() if not ok)
        raise ValueError(f"tensor '{missing}' is missing, but '{have[0]}' exists ({len(have)} of the "
                         f"{len(present)} modules of {label} have one): the experts of a stacked projection must all "
                         f"carry it or none (it is in none of {ckpt.index.source})")


_WARNED_SUBNORMAL: set = set()  # files already warned about (one warning per file, not per tensor)


def _to_fp16(x: np.ndarray, f: SafetensorsFile, name: str) -> np.ndarray:
    out = x.astype(np.float16)
    if not np.all(np.isfinite(out)) and np.all(np.isfinite(x)):
        raise ValueError(f"{f.label}: tensor '{name}': values up to {np.abs(x).max():g} overflow the float16 "
                         f"scales of the stacked layout")
    small = (x != 0) & (np.abs(out) < np.float16(2.0**-14))  # fp16 subnormals (or 0): fewer than 11 bits left
    if small.any() and f.path not in _WARNED_SUBNORMAL:
        _WARNED_SUBNORMAL.add(f.path)
        warnings.warn(f"cupy_moe: {f.label}: scales below 2**-14 (the smallest {np.abs(x[small]).min():.3g}, in "
                      f"tensor '{name}') keep fewer bits as float16 subnormals; their groups' weights carry a "
                      f"relative error of about 2**-24 / scale", stacklevel=2)
    return out


def _load_plan(ckpt: Checkpoint, plan: _Plan, device: bool):
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
        shapes = stacked_shapes(e_count, k, n, q.bits, q.group_size)
        r = shapes["scales"][1]
        qweight = np.empty(shapes["qweight"], np.int32)  # [E, K*bits/32, N]
        scales = np.empty(shapes["scales"], np.float16)  # [E, R, N]
        zeros = np.empty(shapes["scales"], np.uint8)  # [E, R, N] real zero points, packed at the end
        g_idx = np.empty(shapes["g_idx"], np.int32) if plan.has_g_idx else None  # [E, K]
        default_g = np.arange(k, dtype=np.int32) // group_len(k, q.group_size)
    for e, row in enumerate(plan.modules):
        for j, m in enumerate(row):
            n0, n1 = int(offsets[j]), int(offsets[j + 1])
            whole = len(row) == 1  # the part is the whole stacked row: read straight into place
            bt = ckpt.tensor(m.name + ".bias")
            if bt is not None:
                bias[e, n0:n1] = as_float(*bt)
            if q is None:
                f, info = ckpt.tensor(m.name + ".weight")
                dense[e, :, n0:n1] = as_float(f, info).T  # nn.Linear [N, K] -> W [K, N]
                continue
            fmt = q.storage
            f, info = ckpt.tensor(fmt.tensor(m.name, "qweight"))
            if fmt.packed_along_n:
                _awq_qweight_into(f, info, qweight[e, :, n0:n1])
            elif fmt.transposed:
                qweight[e, :, n0:n1] = f.read(info).T  # [N, K*bits/32] -> GPTQ's [K*bits/32, N], same words
                _check_shape_tensor(ckpt, f"{m.name}.{fmt.shape_tensor}", k, n1 - n0)
            elif whole:
                f.read_into(info, qweight[e])
            else:
                qweight[e, :, n0:n1] = f.read(info)
            f, info = ckpt.tensor(fmt.tensor(m.name, "scales"))
            if fmt.transposed:
                scales[e, :, n0:n1] = _to_fp16(as_float(f, info).T, f, info.name)
            elif info.dtype == "F16" and whole:
                f.read_into(info, scales[e])
            else:
                scales[e, :, n0:n1] = _to_fp16(as_float(f, info), f, info.name)
            zt = ckpt.tensor(fmt.tensor(m.name, "qzeros"))
            if zt is None:  # symmetric GPTQ without qzeros
                zeros[e, :, n0:n1] = 1 << (q.bits - 1)
            else:
                f, info = zt
                raw = f.read(info)
                zeros[e, :, n0:n1] = _real_zeros(raw, q)
                _check_sym_zeros(f, info, raw, q)
            if g_idx is not None:
                gt = ckpt.tensor(fmt.tensor(m.name, "g_idx"))
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
                    first = fmt.tensor(row[0].name, "g_idx")
                    raise ValueError(f"{gt[0].label if gt else m.where}: tensor '{fmt.tensor(m.name, 'g_idx')}' "
                                     f"differs from '{first}': {plan.label} stacks both along N and keeps one g_idx "
                                     f"per expert, so gate and up must share their act-order groups")
    if bias is not None and not bias.any():
        bias = None  # AutoGPTQ <= 0.7.1 wrote all-zero biases for every layer: nothing to apply
    if q is None:
        return (_put(dense, device), _put(bias, device))
    if g_idx is not None and (g_idx == default_g).all():
        g_idx = None  # plain k // G groups: the kernels' fast path
    half = 1 << (q.bits - 1)
    qzeros = None if (zeros == half).all() else _packing.pack(zeros, q.bits)  # symmetric -> None
    del zeros
    weight = StackedGptqWeight(qweight, scales, qzeros, g_idx, q.bits, q.group_size)
    if device:
        weight = weight.to_device()  # one host-to-device copy per stacked tensor (_xp.to_device)
    return weight, _put(bias, device)


def _check_shape_tensor(ckpt: Checkpoint, name: str, k: int, n: int):
    """compressed-tensors' weight_shape [2] (the unpacked [N, K]) must agree with the packed tensors."""
    got = ckpt.tensor(name)
    if got is not None:
        shape = [int(v) for v in got[0].read(got[1])]
        if shape != [n, k]:
            raise ValueError(f"{got[0].label}: tensor '{name}' says {shape}, but the packed tensors hold [N, K] = "
                             f"[{n}, {k}]")


def _check_sym_zeros(f: SafetensorsFile, info: TensorInfo, raw: np.ndarray, q: Quant):
    """A symmetric file stores one zero everywhere; the wrong one means the format label is wrong."""
    if not q.sym or q.storage.method != "gptq" or raw.size == 0:
        return
    half = 1 << (q.bits - 1)
    stored = _packing.unpack(raw, q.bits)
    if q.fmt == "gptq" and (stored == half).all():
        raise ValueError(f"{f.label}: tensor '{info.name}': sym=true with checkpoint_format 'gptq' (v1) stores "
                         f"zero {half - 1} (= {half} - 1), but every stored zero is {half}: this is a gptq_v2 file "
                         f"(or mislabeled); the config contradicts the tensors")
    if q.fmt == "gptq_v2" and (stored == half - 1).all():
        raise ValueError(f"{f.label}: tensor '{info.name}': sym=true with checkpoint_format 'gptq_v2' stores "
                         f"zero {half}, but every stored zero is {half - 1}: this is a v1 'gptq' file (or "
                         f"mislabeled); the config contradicts the tensors")


_AWQ_CHUNK_ROWS = 2048  # bounds the unpacked temporaries of the AWQ repack (a multiple of 8)


def _awq_qweight_into(f: SafetensorsFile, info: TensorInfo, out: np.ndarray):
    """AWQ GEMM qweight int32 [K, N/8] (packed along N, interleaved) -> GPTQ qweight written into out [K/8, N]."""
    k = info.shape[0]
    for r0 in range(0, k, _AWQ_CHUNK_ROWS):
        r1 = min(k, r0 + _AWQ_CHUNK_ROWS)
        rows = f.read(dataclasses.replace(info, shape=(r1 - r0, info.shape[1]),
                                          start=info.start + r0 * info.shape[1] * 4,
                                          nbytes=(r1 - r0) * info.shape[1] * 4))
        codes = _packing.awq_deinterleave(_packing.unpack(rows, 4))  # [rows, N] in column order
        out[r0 // 8:r1 // 8] = _packing.pack(codes, 4, axis=0)  # packed along K


def _put(x, device: bool):
    """x on the device (one host-to-device copy) when device is True."""
    if x is None or not device:
        return x
    return _xp.to_device(x, "loading onto the device")


# --------------------------------------------------------------------------- public: stacked projections


def _projection_plan(ckpt: Checkpoint, layer: int, proj: str) -> _Plan:
    s = ckpt.scheme
    if proj == "w13":
        names = [s.gate_proj, s.up_proj]
    elif proj == "w2":
        names = [s.down_proj]
    else:
        raise ValueError(f"proj: expected 'w13' (gate and up) or 'w2' (down), got {proj!r}")
    e_count = ckpt.num_experts(layer)
    modules = [[ckpt.module(s.expert_module(layer, e, p), layer) for p in names] for e in range(e_count)]
    h, i = ckpt.cfg_size("hidden_size")[0], ckpt.cfg_size(s.intermediate_size_key)[0]
    if h is not None and i is not None:
        if proj == "w13":
            k, ns, src = h, [i, i], f"from config.json hidden_size={h}, {s.intermediate_size_key}={i}"
        else:
            k, ns, src = i, [h], f"from config.json {s.intermediate_size_key}={i}, hidden_size={h}"
    else:
        k = ns = src = None
    return _plan(ckpt, f"layer {layer} {proj}", modules, k, ns, src)


def _check_device(device):
    if not isinstance(device, bool):
        raise TypeError(f"device: expected True (CuPy arrays) or False (NumPy arrays), got {device!r}")


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
    Raises ValueError when the experts are dense (use load_layer_weights) or carry a non-zero bias (which a
    StackedGptqWeight cannot hold; load_layer_weights returns it).
    """
    _check_device(device)
    with Checkpoint(path, scheme) as ckpt:
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
        otherwise); topk_method ("greedy", "group_limited_greedy", "noaux_tc"), n_group, topk_group: DeepSeek
        group-limited routing; hidden_act: the config's activation (always "silu": others are refused).
        Each comes from config.json or, when absent, from the family's transformers default (routing.py).
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


def _dense_tensor(ckpt: Checkpoint, name: str, shape: tuple, why: str, device: bool, as_f32: bool = False):
    f, info = _expect(ckpt, name, FLOATS, shape, why)
    x = as_float(f, info)
    return _put(x.astype(np.float32) if as_f32 else x, device)


def _routing(ckpt: Checkpoint, num_experts: int) -> dict:
    """The layer's routing settings (config.json, else the family's transformers defaults: routing.py)."""
    out = {name: value for name, (value, _, _) in routing.resolve(ckpt.config, ckpt.scheme, num_experts).items()}
    out["routed_scaling_factor"] = float(out["routed_scaling_factor"])
    return out


def _load_layer(ckpt: Checkpoint, layer: int, device: bool) -> MoELayerWeights:
    s = ckpt.scheme
    if ckpt.config is None:
        raise FileNotFoundError(f"{ckpt.folder / 'config.json'}: not found; load_moe_layer reads the routing "
                                f"settings ({s.top_k_key}, norm_topk_prob) from it")
    ckpt.check_layer(layer)
    layer = int(layer)
    # Plan everything (headers only) before reading: a bad tensor anywhere fails before any allocation.
    w13_plan = _projection_plan(ckpt, layer, "w13")
    w2_plan = _projection_plan(ckpt, layer, "w2")
    e_count, h, i = len(w13_plan.modules), w13_plan.k, w13_plan.ns[0]
    settings = _routing(ckpt, e_count)
    plans = [w13_plan, w2_plan]
    shared_plans = None
    if s.shared_experts is not None:
        sized = ckpt.shared_config()
        i_cfg, src = None, "from the shared gate tensor"
        if sized is not None:
            i_cfg = sized[0] if sized[1] == "shared_expert_intermediate_size" else sized[0] * i  # DeepSeek: merged
            src = f"from config.json {sized[1]}={sized[0]}"
        down_name = s.shared_experts.format(layer=layer, proj=s.down_proj)
        present = (ckpt.tensor(ckpt.quant.base.storage.tensor(down_name, "qweight"))
                   or ckpt.tensor(down_name + ".weight"))
        if sized is not None and not present:
            raise ValueError(f"config.json {sized[1]}={sized[0]} describes a shared expert, but layer {layer} has "
                             f"none: neither '{ckpt.quant.base.storage.tensor(down_name, 'qweight')}' nor "
                             f"'{down_name}.weight' is in {ckpt.index.source}")
        if present:
            gate_up = [[ckpt.module(s.shared_experts.format(layer=layer, proj=p), layer)
                        for p in (s.gate_proj, s.up_proj)]]
            down = [[ckpt.module(down_name, layer)]]
            if i_cfg is None:
                i_cfg = _module_kn(gate_up[0][0])[1]
            shared_plans = (_plan(ckpt, f"layer {layer} shared gate_up", gate_up, h, [i_cfg, i_cfg], src),
                            _plan(ckpt, f"layer {layer} shared down", down, i_cfg, [h], src))
            plans += list(shared_plans)
    for plan in plans:
        _check_device_bits(plan, device)
    if device:
        _xp.require_gpu("load_moe_layer(device=True)")
    router_name = s.router.format(layer=layer)
    router_q = ckpt.quant.base.storage.tensor(router_name, "qweight")
    if ckpt.tensor(router_q) is not None:
        raise ValueError(f"{ckpt.tensor(router_q)[0].label}: the router '{router_name}' is quantized "
                         f"('{router_q}'); cupy_moe expects a dense router '{router_name}.weight' [E, H]")
    _expect(ckpt, router_name + ".weight", FLOATS, (e_count, h), f"router [E, H], E={e_count}, H={h}")
    sbias = s.score_bias.format(layer=layer) if s.score_bias else None
    if sbias:
        _expect(ckpt, sbias, FLOATS, (e_count,), f"[E], E={e_count}")
    sgate = s.shared_expert_gate.format(layer=layer) if (s.shared_expert_gate and shared_plans) else None
    if sgate:
        _expect(ckpt, sgate + ".weight", FLOATS, (1, h), f"shared expert gate [1, H], H={h}")

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
        **settings)


def load_layer_weights(path, layer: int, *, device: bool = True,
                       scheme: NamingScheme | None = None) -> MoELayerWeights:
    """Load everything MoE layer `layer` needs: stacked experts, router, shared experts, routing settings.

    path: checkpoint folder (config.json required: it holds top-k and renormalization).
    layer: decoder layer index; a dense layer (DeepSeek first_k_dense_replace, Qwen mlp_only_layers) raises.
    device: True -> CuPy arrays (bits 4 and 8), False -> NumPy arrays (any of bits 2, 3, 4, 8).
    scheme: NamingScheme for families not detected from config.json / tensor names.
    Reads only this layer's tensors, each once; see MoELayerWeights for what comes back.
    """
    _check_device(device)
    with Checkpoint(path, scheme) as ckpt:
        return _load_layer(ckpt, layer, device)


def load_model_weights(path, *, device: bool = True, progress: bool | Callable | None = None,
                       scheme: NamingScheme | None = None, layers: Iterable[int] | None = None
                       ) -> dict[int, MoELayerWeights]:
    """Load every MoE layer of a checkpoint: {layer index: MoELayerWeights}, dense layers skipped.

    progress: None -> a progress bar on stderr when stderr is a terminal; True/False force it on/off;
        a callable is called as progress(done, total, layer) after each layer.
    layers: only these layer indices (default: every MoE layer config.json describes).
    Other arguments as load_layer_weights. Layers load one after another, each read once.
    """
    _check_device(device)
    if progress is not None and not isinstance(progress, bool) and not callable(progress):
        raise TypeError(f"progress: expected None, True, False or a callable progress(done, total, layer), "
                        f"got {progress!r}")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Iterable, type(None))):
        raise TypeError(f"layers: expected an iterable of ints (layer indices) or None, got {layers!r}")
    out = {}
    with Checkpoint(path, scheme) as ckpt:
        if layers is None:
            todo = ckpt.moe_layers()
        else:
            todo = list(layers)
            for j, layer in enumerate(todo):  # every index checked before the first layer loads
                ckpt.check_layer(layer, f"layers[{j}]")
            todo = [int(layer) for layer in todo]
        with progress_bar(enabled=False if callable(progress) else progress, total=len(todo), unit="layer",
                          desc="loading MoE layers") as bar:
            total_bytes = 0
            for done, layer in enumerate(todo, 1):
                out[layer] = _load_layer(ckpt, layer, device)
                total_bytes += out[layer].nbytes
                if callable(progress):
                    progress(done, len(todo), layer)
                bar.set_postfix_str(f"layer {layer}, {total_bytes / 2**30:.2f} GiB", refresh=False)
                bar.update()
    return out
