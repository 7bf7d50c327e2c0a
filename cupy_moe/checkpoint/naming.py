"""Where each model family keeps one MoE layer's tensors (NamingScheme), and which family a checkpoint is.

A family is recognized from config.json (`model_type`, else `architectures`), else from the tensor names.
Adding a family is adding entries here: a NamingScheme in SCHEMES, its config labels in _MODEL_TYPES and
_ARCHITECTURES, and the tensor-name marks that identify its naming in _TENSOR_MARKS. The loader reads every
name through the NamingScheme, so it needs no change.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Iterable

__all__ = ["NamingScheme", "SCHEMES", "detect_scheme"]


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
# Family -> substrings that tensor names of that family contain (all of them); the first family whose marks are
# all present wins, so a family whose marks include another's comes first.
_TENSOR_MARKS = (
    ("mixtral", (".block_sparse_moe.experts.",)),
    ("deepseek_v3", (".mlp.shared_experts.", ".e_score_correction_bias")),
    ("deepseek_v2", (".mlp.shared_experts.",)),
    ("qwen2_moe", (".mlp.shared_expert.",)),
    ("qwen3_moe", (".mlp.experts.",)),
)


def _family_from_tensors(names: Iterable[str]) -> str | None:
    """Guess the family from tensor names alone (when config.json is missing or names no known family)."""
    marks = {m for _, family_marks in _TENSOR_MARKS for m in family_marks}
    seen = set()
    for name in names:
        seen.update(m for m in marks if m in name)
        if len(seen) == len(marks):
            break
    return next((family for family, family_marks in _TENSOR_MARKS if seen.issuperset(family_marks)), None)


def detect_scheme(config: dict | None, names: Iterable[str], where) -> NamingScheme:
    """The NamingScheme of a checkpoint from its config.json (None when absent) and its tensor names.

    where: the checkpoint folder, for messages. The config's family must name the tensors the way the
    checkpoint does.
    """
    names = list(names)
    from_tensors = _family_from_tensors(names)
    cfg = config or {}
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
                    f"{cfg.get('architectures')!r}" if config else "no config.json")
            raise ValueError(f"{where}: unknown MoE family ({what}, and no tensor names of a known "
                             f"family); pass scheme=NamingScheme(...) (known: {', '.join(SCHEMES)})")
        return SCHEMES[from_tensors]
    scheme = SCHEMES[family]
    if from_tensors is not None and SCHEMES[from_tensors].experts != scheme.experts:
        example = next((n for n in names if "experts." in n), "?")
        raise ValueError(f"config.json says {said}, whose experts are named like "
                         f"'{scheme.expert_module(0, 0, scheme.gate_proj)}', but the checkpoint's tensors "
                         f"follow the {from_tensors} naming (e.g. '{example}'); pass scheme=... if intended")
    return scheme
