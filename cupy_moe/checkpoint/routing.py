"""How each family routes tokens when config.json is silent: the defaults of transformers' modelling code.

A routing setting is read from config.json when present; otherwise it takes the family's default below, which is
what transformers' model (and config class) for that `model_type` does:

- mixtral: softmax over the experts, top-k, always renormalized (no config key).
- qwen2_moe, qwen3_moe: softmax, top-k, renormalized when `norm_topk_prob` (default false in both config classes).
- deepseek_v2: softmax, `topk_method` "greedy" (or "group_limited_greedy": best expert per group decides the
  `topk_group` groups kept), never renormalized unless `norm_topk_prob`, times `routed_scaling_factor` (1.0).
- deepseek_v3: sigmoid scores, always group-limited with the score-correction bias ("noaux_tc": the sum of a
  group's two best biased scores decides the groups kept; n_group 8, topk_group 4), renormalized
  (`norm_topk_prob` default true), times `routed_scaling_factor` (2.5). transformers 5 writes neither
  `topk_method` nor `scoring_func` for it.

`resolve(config, scheme, num_experts)` returns every setting with where it came from, for the loader and inspect.
"""
from __future__ import annotations

from .naming import NamingScheme

__all__ = ["DEFAULTS", "ALWAYS", "resolve", "check", "describe_source"]

# family -> {setting: default when config.json lacks the key}. "renormalize" reads config `norm_topk_prob`.
DEFAULTS: dict[str, dict] = {
    "mixtral": dict(renormalize=True, scoring_func="softmax", topk_method="greedy", routed_scaling_factor=1.0),
    "qwen2_moe": dict(renormalize=False, scoring_func="softmax", topk_method="greedy", routed_scaling_factor=1.0),
    "qwen3_moe": dict(renormalize=False, scoring_func="softmax", topk_method="greedy", routed_scaling_factor=1.0),
    "deepseek_v2": dict(renormalize=False, scoring_func="softmax", topk_method="greedy", routed_scaling_factor=1.0),
    "deepseek_v3": dict(renormalize=True, scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=2.5,
                        n_group=8, topk_group=4),
}
# family -> settings its model fixes whatever config.json says (Mixtral renormalizes, with no config key).
ALWAYS: dict[str, set] = {"mixtral": {"renormalize"}}
_GENERIC = dict(renormalize=False, scoring_func="softmax", topk_method="greedy", routed_scaling_factor=1.0)
_KEYS = {"renormalize": "norm_topk_prob", "scoring_func": "scoring_func", "topk_method": "topk_method",
         "routed_scaling_factor": "routed_scaling_factor", "n_group": "n_group", "topk_group": "topk_group"}
_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_RSF_MAX = 65504.0  # largest float16: a larger routed_scaling_factor overflows float16 activations


def describe_source(source: str, key: str | None, family: str) -> str:
    """Human words for a source tag: "config" -> "config.json KEY", "default" -> "default for FAMILY", ..."""
    if source == "config":
        return f"config.json {key}"
    if source == "always":
        return f"always for {family}"
    if source == "scheme":
        return "the NamingScheme"
    return f"default for {family} (config.json has no {key})"


def resolve(config: dict | None, scheme: NamingScheme, num_experts: int | None, validate: bool = True) -> dict:
    """Every routing setting of a layer: {setting: (value, source, key)}.

    source: "config" (read from config.json under `key`), "default" (the family's default; `key` is the config
    key that was absent), "always" (the family ignores the config, e.g. Mixtral's renormalization) or "scheme"
    (forced by a custom NamingScheme). num_experts: E, to check the group settings (None skips that check).
    validate: raise ValueError (see `check`) for values transformers would not run.
    """
    cfg = config or {}
    family = scheme.family
    defaults = DEFAULTS.get(family, _GENERIC)
    out = {}
    top_k = cfg.get(scheme.top_k_key)
    out["top_k"] = (top_k, "config" if top_k is not None else "default", scheme.top_k_key)
    for name, key in _KEYS.items():
        forced = {"renormalize": scheme.renormalize}.get(name)
        default = defaults.get(name)
        if name == "renormalize" and scheme.norm_topk_prob_default is not None:
            default = scheme.norm_topk_prob_default
        if name == "scoring_func" and scheme.scoring_func_default is not None:
            default = scheme.scoring_func_default
        if forced is not None:
            out[name] = (forced, "scheme", key)
        elif name in ALWAYS.get(family, ()):
            out[name] = (default, "always", key)
        elif cfg.get(key) is not None:
            out[name] = (cfg[key], "config", key)
        else:
            out[name] = (default, "default", key)
    out["hidden_act"] = (cfg.get("hidden_act", "silu"), "config" if "hidden_act" in cfg else "default", "hidden_act")
    if validate:
        check(out, family, num_experts)
    return out


def check(out: dict, family: str, num_experts: int | None):
    """ValueError naming the setting and where it came from when a resolved setting cannot be run."""
    def bad(name: str, expected: str):
        value, source, key = out[name]
        said = (f"config.json {key}={value!r}" if source == "config"
                else f"{key}={value!r}, the {describe_source(source, key, family)}")
        raise ValueError(f"{said}: expected {expected}")

    top_k = out["top_k"][0]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        bad("top_k", "a positive int (experts per token)")
    if num_experts is not None and top_k > num_experts:
        bad("top_k", f"at most E={num_experts} experts")
    if out["scoring_func"][0] not in ("softmax", "sigmoid"):
        bad("scoring_func", "'softmax' or 'sigmoid'")
    if out["topk_method"][0] not in _METHODS:
        bad("topk_method", " or ".join(repr(m) for m in _METHODS))
    if not isinstance(out["renormalize"][0], bool):
        bad("renormalize", "true or false")
    rsf = out["routed_scaling_factor"][0]
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not 0 < rsf <= _RSF_MAX:
        bad("routed_scaling_factor", f"a positive finite number, at most {_RSF_MAX:g} (the largest float16: a "
            f"larger factor overflows float16 activations)")
    if out["hidden_act"][0] != "silu":
        bad("hidden_act", "'silu' (the expert kernels compute SiLU(gate) * up)")
    if out["topk_method"][0] == "greedy":
        return
    n_group, topk_group = out["n_group"][0], out["topk_group"][0]
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad(name, f"a positive int (topk_method {out['topk_method'][0]!r} groups the experts)")
    if topk_group > n_group:
        bad("topk_group", f"at most n_group={n_group}")
    if num_experts is not None and num_experts % n_group:
        bad("n_group", f"a divisor of the E={num_experts} experts")
    if num_experts is not None and out["topk_method"][0] == "noaux_tc" and num_experts // n_group < 2:
        bad("n_group", f"at most E/2 = {num_experts // 2} (topk_method 'noaux_tc' scores a group by the sum of its "
            f"two best experts, so each group of the E={num_experts} experts needs at least 2)")
    if num_experts is not None and top_k > topk_group * (num_experts // n_group):
        bad("top_k", f"at most topk_group * E / n_group = {topk_group * (num_experts // n_group)} (only the experts "
            f"of the topk_group={topk_group} kept groups can be chosen)")
