"""inspect_checkpoint: a description of a checkpoint from its configs and safetensors headers only."""
from __future__ import annotations

from collections import Counter

from . import routing
from .folder import Checkpoint
from .naming import NamingScheme

__all__ = ["inspect_checkpoint"]

_ROLES = ("experts", "router", "shared", "other")


class _Problems:
    """Problems grouped by what is wrong, each reported once with the number of tensors (or layers) it affects."""

    def __init__(self):
        self._groups: dict[str, tuple] = {}

    def add(self, problem: str, tensor: str | None = None, noun: str = "tensor"):
        items = self._groups.setdefault(problem, (noun, []))[1]
        if tensor is not None:
            items.append(tensor)

    def lines(self) -> list[str]:
        out = []
        for problem, (noun, items) in self._groups.items():
            if len(items) == 1:
                out.append(f"{problem} ({noun} '{items[0]}')")
            elif items:
                out.append(f"{problem} ({len(items)} {noun}s, e.g. '{items[0]}')")
            else:
                out.append(problem)
        return out


def _files(ckpt: Checkpoint, problems: _Problems) -> tuple[list, set]:
    """[{name, bytes, tensors}] of the readable files; the names of the unreadable ones (reported once each)."""
    per_file = Counter(ckpt.index.weight_map.values())
    files, broken = [], set(ckpt.index.broken)
    for fname, error in ckpt.index.broken.items():
        problems.add(f"{error} (the file's tensors are unknown)")
    for fname in sorted(per_file):
        try:
            f = ckpt.index.file(fname)
        except (FileNotFoundError, ValueError) as exc:
            broken.add(fname)
            problems.add(f"{str(exc).split(' (it holds')[0]}: {per_file[fname]} tensors of "
                         f"{ckpt.index.source} are in it")
            continue
        files.append({"name": fname, "bytes": f.path.stat().st_size, "tensors": len(f.tensors)})
        for name in f.truncated:
            problems.add(f"{fname}: truncated safetensors file: tensors end past its {files[-1]['bytes']} bytes",
                         name)
    return files, broken


def _summary(ckpt: Checkpoint, broken: set, problems: _Problems) -> dict:
    """{role: {dtype: {count, bytes}}} over every tensor whose header could be read."""
    out = {role: {} for role in _ROLES}
    for name, fname in ckpt.index.weight_map.items():
        if fname in broken:
            continue
        info = ckpt.index.file(fname).tensors.get(name)
        if info is None:
            problems.add(f"{fname}: {ckpt.index.source} maps tensors to this file that its header lacks", name)
            continue
        slot = out[ckpt.scheme.role(name)].setdefault(info.dtype, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += info.nbytes
    return out


def _moe_layer(ckpt: Checkpoint, layer: int, broken: set, problems: _Problems) -> dict:
    s, storage = ckpt.scheme, ckpt.quant.base.storage
    found = ckpt.experts_found(layer)
    try:
        experts = range(ckpt.num_experts(layer))
    except (TypeError, ValueError) as exc:
        problems.add(str(exc))
        experts = sorted(found)  # only what is there: the count is unusable
    suffixes = [storage.tensor("", role)[1:] for role in ("qweight", "qzeros", "scales", "g_idx")]
    kinds, nbytes = set(), 0
    if layer not in ckpt.layers_found():
        problems.add("MoE layers without any tensors", f"{s.block.format(layer=layer)}.*", "layer")
        experts = ()  # one line for the layer, not one per missing expert
    for e in experts:
        for p in (s.gate_proj, s.up_proj, s.down_proj):
            mod = s.expert_module(layer, e, p)
            kind = None
            for suffix in suffixes + ["weight"]:
                name = f"{mod}.{suffix}"
                fname = ckpt.index.weight_map.get(name)
                info = None if fname is None or fname in broken else ckpt.index.file(fname).tensors.get(name)
                if fname is not None and fname in broken:
                    kind = kind or "unreadable"
                if info is not None:
                    nbytes += info.nbytes
                    kind = storage.method if suffix == suffixes[0] else (kind or "dense")
            if kind is None:
                problems.add(f"expert modules with neither '.{suffixes[0]}' nor '.weight'", f"{mod}.{suffixes[0]}")
            elif kind != "unreadable":
                kinds.add(kind)
    shared, shared_storage = 0, None
    if s.shared_experts:
        mod = s.shared_experts.format(layer=layer, proj=s.down_proj)
        if storage.tensor(mod, "qweight") in ckpt.index.weight_map:
            shared_storage = storage.method
        elif mod + ".weight" in ckpt.index.weight_map:
            shared_storage = "dense"
        try:
            sized = ckpt.shared_config()
        except (TypeError, ValueError) as exc:
            problems.add(str(exc))
            sized = None
        if sized is not None and not shared_storage:
            problems.add(f"config.json {sized[1]}={sized[0]} describes a shared expert, but a layer has none",
                         storage.tensor(mod, "qweight"))
        if shared_storage:  # DeepSeek: n_shared_experts merged into one module
            shared = sized[0] if sized is not None and sized[1] == "n_shared_experts" else 1
    return {"layer": layer, "kind": "moe", "reason": None, "experts_found": len(found),
            "experts": kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else None), "expert_bytes": nbytes,
            "shared_experts": shared, "shared_storage": shared_storage}


def inspect_checkpoint(path, *, scheme: NamingScheme | None = None) -> dict:
    """Describe a checkpoint from its configs and safetensors headers only (no tensor data is read).

    Returns a JSON-serializable dict:
      path, family, naming (which of the family's tensor namings), model_type, architectures;
      files [{name, bytes, tensors}] (readable files), total_bytes;
      quantization {method, bits, group_size, sym, desc_act, checkpoint_format, source, dynamic,
        modules_in_block_to_quantize, ignore (compressed-tensors), config_groups (compressed-tensors)};
      hidden_size, intermediate_size, num_experts (config.json under any spelling, else counted from the
        tensors), num_experts_key (the key it came from, or None);
      top_k, renormalize, scoring_func (as in routing);
      routing {setting: {value, source}}: top_k, renormalize, scoring_func, topk_method, n_group, topk_group,
        routed_scaling_factor, hidden_act; source in words, e.g. "config.json norm_topk_prob" or
        "default for deepseek_v3 (config.json has no topk_method)"; routing_error: why load_moe_layer would
        refuse the routing settings, or None;
      tensors {role: {dtype: {count, bytes}}} for roles experts, router, shared, other;
      num_layers, moe_layers [int], dense_layers {layer: reason};
      layers [{layer, kind ("moe" or "dense"), reason (why dense, else None), experts_found, experts ("gptq",
        "awq", "compressed-tensors", "dense", "mixed" or None), expert_bytes, shared_experts (count),
        shared_storage ("gptq", ..., "dense" or None)}] for every layer in order;
      problems [str]: each problem once, with the number of tensors (or layers) it affects (missing or unreadable
        shards, truncated or corrupt files, missing expert tensors, MoE layers without tensors, config/tensor
        disagreements, expert or layer counts out of range: then the experts or layers found are described).
    A missing folder raises FileNotFoundError, a folder without a quantization config or with unsupported
    quantization settings ValueError, each naming the path and the problem.
    """
    problems = _Problems()
    with Checkpoint(path, scheme, lenient=True) as ckpt:
        s, q = ckpt.scheme, ckpt.quant
        files, broken = _files(ckpt, problems)
        tensors = _summary(ckpt, broken, problems)
        try:
            n_layers, moe = ckpt.num_layers(), ckpt.moe_layers()
        except ValueError as exc:  # an absurd layer count: describe the layers the tensors have
            problems.add(str(exc))
            n_layers, moe = None, [i for i in sorted(ckpt.layers_found()) if ckpt.dense_reason(i) is None]
        dense = {i: ckpt.dense_reason(i) for i in range(n_layers or 0) if ckpt.dense_reason(i)}
        layers = []
        for layer in sorted(set(moe) | set(dense)):
            if layer in dense:
                layers.append({"layer": layer, "kind": "dense", "reason": dense[layer], "experts_found": 0,
                               "experts": None, "expert_bytes": 0, "shared_experts": 0, "shared_storage": None})
            else:
                layers.append(_moe_layer(ckpt, layer, broken, problems))
        for key in ("hidden_size", s.intermediate_size_key):
            try:
                if ckpt.cfg_size(key)[0] is None:
                    problems.add(f"config.json has no {key} (or it is null)")
            except TypeError as exc:
                problems.add(str(exc))
        try:
            e_count, e_key = ckpt.cfg_size(s.num_experts_key)
        except TypeError as exc:  # count the experts found instead
            problems.add(str(exc))
            e_count, e_key = None, None
        if e_count is None and moe:
            e_count = max((row["experts_found"] for row in layers), default=None)
        settings = routing.resolve(ckpt.config, s, None, validate=False)
        try:
            routing.check(settings, s.family, e_count if isinstance(e_count, int) else None)
            routing_error = None
        except ValueError as exc:
            routing_error = str(exc)
            problems.add(f"routing: {exc}")
        route = {name: {"value": value, "source": routing.describe_source(source, key, s.family)}
                 for name, (value, source, key) in settings.items()}
        raw = q.raw if q.base.storage.method == "compressed-tensors" else {}
        return {
            "path": str(ckpt.folder), "family": s.family, "naming": s.naming, "model_type": ckpt.cfg("model_type"),
            "architectures": ckpt.cfg("architectures"), "files": files,
            "total_bytes": sum(f["bytes"] for f in files),
            "quantization": {"method": q.base.storage.method, "bits": q.base.bits,
                             "group_size": q.base.group_size, "sym": q.base.sym, "desc_act": q.base.desc_act,
                             "checkpoint_format": q.base.fmt, "source": q.source,
                             "dynamic": ({p: o for p, o in q.dynamic} or None) if not raw else None,
                             "modules_in_block_to_quantize": sorted(q.in_block) if q.in_block is not None else None,
                             "ignore": raw.get("ignore"), "config_groups": sorted(raw.get("config_groups") or {})
                             or None},
            "hidden_size": ckpt.cfg("hidden_size"), "intermediate_size": ckpt.cfg(s.intermediate_size_key),
            "num_experts": e_count, "num_experts_key": e_key,
            "top_k": route["top_k"]["value"], "renormalize": route["renormalize"]["value"],
            "scoring_func": route["scoring_func"]["value"], "routing": route, "routing_error": routing_error,
            "tensors": tensors, "num_layers": n_layers, "moe_layers": moe, "dense_layers": dense,
            "layers": layers, "problems": problems.lines(),
        }
