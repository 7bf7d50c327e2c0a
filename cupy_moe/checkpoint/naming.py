"""Where each model family keeps one MoE layer's tensors (NamingScheme), and which naming a checkpoint uses.

A family is recognized from config.json (`model_type`, else `architectures`); its naming from the tensor names,
among the namings real checkpoints of that family use (NAMINGS: Mixtral has three, `block_sparse_moe.experts.E.w1`
from transformers 4, `mlp.experts.E.gate_proj` from GPTQModel 7 and `block_sparse_moe.experts.E.gate_proj` from
llm-compressor, both on transformers 5). Without a config.json the
tensor names alone decide. Adding a family or a naming is adding entries here: a NamingScheme in NAMINGS and the
family's config labels in _MODEL_TYPES and _ARCHITECTURES (its routing defaults live in routing.py). The loader
reads every name through the NamingScheme, so it needs no change.
"""
from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Iterable

__all__ = ["NamingScheme", "NAMINGS", "SCHEMES", "CONFIG_SYNONYMS", "detect_scheme", "config_value"]


@dataclass(frozen=True)
class NamingScheme:
    """Where a model family keeps one MoE layer's tensors, and which config.json keys hold its sizes.

    Module names are format strings over `{layer}`, `{expert}` and `{proj}`; a module's tensors are the module
    name plus `.qweight/.qzeros/.scales/.g_idx[/.bias]` (GPTQ, AWQ) or `.weight[/.bias]` (dense).

    family: a label ("mixtral", ...). naming: which of the family's namings this is ("" when it has one).
    experts: routed expert projection, e.g. "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}".
    gate_proj, up_proj, down_proj: the `{proj}` names of the gate [H -> I], up [H -> I] and down [I -> H]
        projections (Mixtral: "w1", "w3", "w2").
    router: the dense router module [E, H], e.g. "model.layers.{layer}.mlp.gate".
    score_bias: tensor name of a per-expert routing score bias [E] (DeepSeek-V3
        "model.layers.{layer}.mlp.gate.e_score_correction_bias"), or None.
    shared_experts: shared expert projection module over `{layer}` and `{proj}`, or None.
    shared_expert_gate: dense module [1, H] gating the shared expert (Qwen2-MoE), or None.
    block: prefix of one decoder layer; `modules_in_block_to_quantize` names are relative to it.
    num_experts_key, intermediate_size_key, top_k_key: config.json keys of E, I and the top-k A (the other
        spellings in CONFIG_SYNONYMS are read too: transformers 5 writes `num_local_experts` for Qwen-MoE).
    renormalize: True/False forces renormalizing the top-k weights; None reads config `norm_topk_prob`.
    norm_topk_prob_default, scoring_func_default: used when config.json lacks the key; None takes the family's
        default from routing.py (a family without one there: False, "softmax").

    Example, a family keeping experts under "transformer.h.{layer}.moe.experts.{expert}.{proj}":

        NamingScheme(family="mine", experts="transformer.h.{layer}.moe.experts.{expert}.{proj}",
                     router="transformer.h.{layer}.moe.router", block="transformer.h.{layer}")
    """

    family: str
    experts: str
    router: str
    naming: str = ""
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
    norm_topk_prob_default: bool | None = None
    scoring_func_default: str | None = None

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

    def expert_regex(self) -> re.Pattern:
        """Matches whole tensor names of routed experts, one per line of a newline-joined list; groups "layer",
        "expert" and "proj"."""
        out = []
        for literal, field, _, _ in string.Formatter().parse(self.experts):
            out.append(re.escape(literal))
            if field in ("layer", "expert"):
                out.append(rf"(?P<{field}>\d+)")
            elif field == "proj":
                out.append(r"(?P<proj>[^.\n]+)")
        return re.compile("^" + "".join(out) + r"\.[^.\n]+$", re.M)

    def _pattern(self, fmt: str, tail: str) -> re.Pattern:
        """`fmt` over any layer/expert/proj as a regex of whole names (one per line of a joined list), + tail."""
        out = []
        for literal, field, _, _ in string.Formatter().parse(fmt):
            out.append(re.escape(literal))
            if field in ("layer", "expert"):
                out.append(r"\d+")
            elif field == "proj":
                out.append("(?:" + "|".join(re.escape(p) for p in (self.gate_proj, self.up_proj,
                                                                   self.down_proj)) + ")")
        return re.compile("^" + "".join(out) + tail + "$", re.M)

    def features(self) -> dict[str, re.Pattern]:
        """What identifies this naming among tensor names, any layer: {"experts": ..., "shared_experts": ...,
        "score_bias": ...} (the ones it has), each a pattern matching whole names in a newline-joined list."""
        found = {"experts": self._pattern(self.experts, r"\.[^.\n]+")}
        if self.shared_experts:
            found["shared_experts"] = self._pattern(self.shared_experts, r"\.[^.\n]+")
        if self.score_bias:
            found["score_bias"] = self._pattern(self.score_bias, "")
        return found

    @functools.cached_property
    def _role_patterns(self) -> list:
        feats = self.features()
        roles = [("experts", feats["experts"]), ("router", self._pattern(self.router, r"\.[^.\n]+"))]
        roles += [("router", feats["score_bias"])] if "score_bias" in feats else []
        roles += [("shared", feats["shared_experts"])] if "shared_experts" in feats else []
        if self.shared_expert_gate:
            roles.append(("shared", self._pattern(self.shared_expert_gate, r"\.[^.\n]+")))
        return roles

    def role(self, name: str) -> str:
        """"experts", "router", "shared" or "other": what a tensor of this naming is part of."""
        return next((role for role, pattern in self._role_patterns if pattern.match(name)), "other")


_MIXTRAL_CONFIG = dict(num_experts_key="num_local_experts", intermediate_size_key="intermediate_size")
# Every naming real checkpoints use, per family; a family's first entry is its default (SCHEMES).
NAMINGS: tuple[NamingScheme, ...] = (
    # transformers 4 Mixtral (AutoGPTQ, GPTQModel < 7, most Hub repositories).
    NamingScheme(family="mixtral", naming="block_sparse_moe.w1",
                 experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}", gate_proj="w1",
                 up_proj="w3", down_proj="w2", router="model.layers.{layer}.block_sparse_moe.gate", **_MIXTRAL_CONFIG),
    NamingScheme(family="qwen2_moe", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
                 router="model.layers.{layer}.mlp.gate", shared_experts="model.layers.{layer}.mlp.shared_expert.{proj}",
                 shared_expert_gate="model.layers.{layer}.mlp.shared_expert_gate"),
    NamingScheme(family="qwen3_moe", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
                 router="model.layers.{layer}.mlp.gate"),
    NamingScheme(family="deepseek_v2", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
                 router="model.layers.{layer}.mlp.gate",
                 shared_experts="model.layers.{layer}.mlp.shared_experts.{proj}", num_experts_key="n_routed_experts"),
    NamingScheme(family="deepseek_v3", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
                 router="model.layers.{layer}.mlp.gate",
                 shared_experts="model.layers.{layer}.mlp.shared_experts.{proj}",
                 score_bias="model.layers.{layer}.mlp.gate.e_score_correction_bias", num_experts_key="n_routed_experts"),
    # transformers 5 fuses Mixtral's experts; the tools write them back per expert with Llama-style proj names:
    # GPTQModel 7 under mlp, llm-compressor (compressed-tensors) under block_sparse_moe.
    NamingScheme(family="mixtral", naming="mlp.gate_proj", experts="model.layers.{layer}.mlp.experts.{expert}.{proj}",
                 router="model.layers.{layer}.mlp.gate", **_MIXTRAL_CONFIG),
    NamingScheme(family="mixtral", naming="block_sparse_moe.gate_proj",
                 experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}",
                 router="model.layers.{layer}.block_sparse_moe.gate", **_MIXTRAL_CONFIG),
)
SCHEMES: dict[str, NamingScheme] = {}  # family -> its default naming
for _n in NAMINGS:
    SCHEMES.setdefault(_n.family, _n)

_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3"}
_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
                  "DeepseekV3ForCausalLM": "deepseek_v3"}

# Spellings of one setting in config.json files: transformers 5 writes `num_local_experts` where transformers 4
# wrote `num_experts` (Qwen2/3-MoE); DeepSeek names it `n_routed_experts`. A key is looked up first, then its
# synonyms in this order.
CONFIG_SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("num_experts", "num_local_experts", "n_routed_experts"),
)


def config_value(config: dict | None, key: str):
    """(value, the key it was found under) of `key` or, failing that, of a synonym; (None, None) when absent."""
    cfg = config or {}
    keys = next(((key,) + tuple(k for k in group if k != key) for group in CONFIG_SYNONYMS if key in group), (key,))
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k], k
    return None, None


def _fits(names_blob: str, namings: Iterable[NamingScheme]) -> list[tuple[int, NamingScheme]]:
    """(number of features matched, naming) for each naming whose routed experts appear among the tensors."""
    out = []
    for naming in namings:
        feats = naming.features()
        if feats["experts"].search(names_blob):
            out.append((sum(1 for p in feats.values() if p.search(names_blob)) - len(feats), naming))
    return out


def _from_tensors(names_blob: str, namings) -> NamingScheme | None:
    """The naming that explains the most of the tensors (all its features present first; table order on ties)."""
    fits = _fits(names_blob, namings)
    if not fits:
        return None
    complete = [(len(n.features()), n) for missing, n in fits if missing == 0]
    return max(complete or [(m, n) for m, n in fits], key=lambda t: t[0])[1]


def detect_scheme(config: dict | None, names: Iterable[str], where) -> NamingScheme:
    """The NamingScheme of a checkpoint from its config.json (None when absent) and its tensor names.

    where: the checkpoint folder, for messages. The config's family must name the tensors one of the ways that
    family's checkpoints do.
    """
    blob = "\n".join(names)
    cfg = config or {}
    model_type, archs = cfg.get("model_type"), cfg.get("architectures")
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"{where}: config.json model_type: expected a string, got {model_type!r}")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise TypeError(f"{where}: config.json architectures: expected a list of strings, got {archs!r}")
    family, said = None, None
    if cfg.get("model_type") in _MODEL_TYPES:
        family, said = _MODEL_TYPES[cfg["model_type"]], f"model_type '{cfg['model_type']}'"
    else:
        for arch in cfg.get("architectures") or ():
            if arch in _ARCHITECTURES:
                family, said = _ARCHITECTURES[arch], f"architectures ['{arch}']"
                break
    if family is None:
        found = _from_tensors(blob, NAMINGS)
        if found is None:
            what = (f"config.json model_type {cfg.get('model_type')!r}, architectures "
                    f"{cfg.get('architectures')!r}" if config else "no config.json")
            raise ValueError(f"{where}: unknown MoE family ({what}, and no tensor names of a known "
                             f"family); pass scheme=NamingScheme(...) (known: {', '.join(SCHEMES)})")
        return found
    own = [n for n in NAMINGS if n.family == family]
    found = _from_tensors(blob, own)
    if found is not None:
        return found
    other = _from_tensors(blob, NAMINGS)
    if other is not None:
        m = other.features()["experts"].search(blob)
        likes = " or ".join(f"'{n.expert_module(0, 0, n.gate_proj)}'" for n in own)
        raise ValueError(f"config.json says {said}, whose experts are named like {likes}, but the checkpoint's "
                         f"tensors follow the {other.family} naming (e.g. '{m.group(0)}'); pass scheme=... if "
                         f"intended")
    return own[0]  # no expert tensors at all: the loader says what is missing
