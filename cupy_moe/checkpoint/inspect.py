"""inspect_checkpoint: a description of a checkpoint from its configs and safetensors headers only."""
from __future__ import annotations

from .folder import Checkpoint
from .naming import NamingScheme

__all__ = ["inspect_checkpoint"]


def inspect_checkpoint(path, *, scheme: NamingScheme | None = None) -> dict:
    """Describe a checkpoint from its configs and safetensors headers only (no tensor data is read).

    Returns a JSON-serializable dict: path, family, model_type, architectures, files [{name, bytes, tensors}],
    total_bytes, quantization {method, bits, group_size, sym, desc_act, checkpoint_format, source, dynamic,
    modules_in_block_to_quantize}, hidden_size, intermediate_size, num_experts, top_k, renormalize,
    scoring_func, num_layers, moe_layers, dense_layers {layer: reason}, layers [{layer, experts_found,
    experts ("gptq", "awq", "dense" or "mixed"), expert_bytes, shared_experts}], problems [str] (tensors or
    files missing, found from the headers).
    """
    with Checkpoint(path, scheme) as ckpt:
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
                                kind = q.base.storage.method
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
            "quantization": {"method": q.base.storage.method, "bits": q.base.bits,
                             "group_size": q.base.group_size, "sym": q.base.sym, "desc_act": q.base.desc_act,
                             "checkpoint_format": q.base.fmt, "source": q.source,
                             "dynamic": {p: o for p, o in q.dynamic} or None,
                             "modules_in_block_to_quantize": sorted(q.in_block) if q.in_block is not None else None},
            "hidden_size": ckpt.cfg("hidden_size"), "intermediate_size": ckpt.cfg(s.intermediate_size_key),
            "num_experts": ckpt.cfg(s.num_experts_key), "top_k": top_k, "renormalize": renorm,
            "scoring_func": ckpt.cfg("scoring_func", s.scoring_func_default), "num_layers": n_layers,
            "moe_layers": moe, "dense_layers": dense, "layers": layers, "problems": list(dict.fromkeys(problems)),
        }
