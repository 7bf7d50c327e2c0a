"""What `python -m cupy_moe inspect` prints: the description of a checkpoint (checkpoint.inspect_checkpoint's dict)
as aligned text, or as strict JSON."""
from __future__ import annotations

import math

__all__ = ["format_inspection", "finite_json"]


def mib(nbytes) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 / 10 else f"{nbytes / 2**10:,.1f} KiB"


def plural(n, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Rows of cells as aligned text lines; the first row is the header, columns in `right` align right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


def format_inspection(info: dict) -> list[str]:
    """What `inspect` prints: labelled lines, the layers in order, the tensors by role and dtype, the files (when
    there are several), the problems."""
    q = info["quantization"]
    model_type = info.get("model_type") or "not given"
    arch = ", ".join(info.get("architectures") or []) or "not given"
    family = f"{info['family']} (model_type {model_type}; architectures {arch})"
    if info.get("naming"):
        family += f"; tensor names: {info['naming']}"
    routing = (f"top-{info['top_k']} of {info['num_experts']} experts, {info.get('scoring_func') or 'softmax'} "
               f"scores, {'renormalized' if info.get('renormalize') else 'not renormalized'}")
    extra = info.get("routing") or {}
    if (extra.get("topk_method") or {}).get("value") not in (None, "greedy"):
        routing += f", {extra['topk_method']['value']} selection"
    if (extra.get("routed_scaling_factor") or {}).get("value") not in (None, 1, 1.0):
        routing += f", scaled by {extra['routed_scaling_factor']['value']}"
    # where each setting came from: config.json, or the model type's default where the key is absent
    defaults = [f"{key}={row['value']} [{row['source']}]" for key, row in extra.items()
                if isinstance(row, dict) and row.get("value") is not None
                and not str(row.get("source", "")).startswith("config.json")]
    group = "one group per column (-1)" if q["group_size"] == -1 else f"group size {q['group_size']}"
    quant = (f"{q['method'].upper()} {q['bits']}-bit, {group}, {'symmetric' if q['sym'] else 'asymmetric'}, "
             f"act-order {'yes' if q['desc_act'] else 'no'}, format {q['checkpoint_format']} "
             f"(read from {q['source']})")
    if q.get("dynamic"):
        quant += f"; per-module rules: {len(q['dynamic'])}"
    layers = sorted(info["layers"], key=lambda row: row["layer"])
    moe = sum(row.get("kind", "moe") == "moe" for row in layers)
    tensors = sum(f.get("tensors", 0) for f in info["files"])
    lines = table([
        ["checkpoint", info["path"]],
        ["family", family],
        ["sizes", f"hidden {info['hidden_size']}, expert intermediate {info['intermediate_size']}"],
        ["routing", routing],
        *([["routing defaults", "; ".join(defaults)]] if defaults else []),
        *([["routing error", info["routing_error"]]] if info.get("routing_error") else []),
        ["quantization", quant],
        ["layers", f"{info['num_layers']} in all: {moe} MoE, {len(layers) - moe} dense"],
        ["files", f"{plural(len(info['files']), 'file')}, {plural(tensors, 'tensor')}, {mib(info['total_bytes'])}"],
    ])
    rows = []
    for row in layers:
        if row.get("kind", "moe") == "moe":
            shared = row.get("shared_experts") or 0
            rows.append([str(row["layer"]), "MoE", f"{row['experts_found']}/{info['num_experts']}",
                         str(row["experts"] or "none"), mib(row["expert_bytes"]),
                         f"{shared} ({row.get('shared_storage') or 'unknown'})" if shared else "none"])
        else:
            rows.append([str(row["layer"]), "dense", "", "", "", f"({row.get('reason') or 'no experts'})"])
    if rows:
        lines += ["", *table([["layer", "kind", "experts", "stored as", "expert weights", "shared experts"]] + rows,
                             right={0, 4})]
    by_role = [[role, dtype, str(v["count"]), mib(v["bytes"])]
               for role, dtypes in (info.get("tensors") or {}).items() for dtype, v in sorted(dtypes.items())]
    if by_role:
        lines += ["", *table([["tensors", "dtype", "count", "size"]] + by_role, right={2, 3})]
    if len(info["files"]) > 1:
        lines += ["", *table([["file", "tensors", "size"]] + [[f["name"], str(f["tensors"]), mib(f["bytes"])]
                                                           for f in info["files"]], right={1, 2})]
    if info.get("problems"):
        lines += ["", *(f"problem: {problem}" for problem in info["problems"])]
    return lines


def finite_json(value):
    """`value` with every float that is not finite written as a string ("NaN", "Infinity", "-Infinity"), so that
    it dumps as strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value
