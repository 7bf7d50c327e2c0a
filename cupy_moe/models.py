"""The MoE layer shapes of the models cupy_moe is measured on: one table for the demo, `tune` and the benchmarks.

Letters: H hidden size, I expert intermediate size, E routed experts, A top-k, G the group size of common GPTQ
releases. Names match case-insensitively (`get_model("mixtral-8x7b")`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .weights import expert_nbytes

__all__ = ["ModelShape", "MODELS", "BENCHMARK_MODELS", "get_model", "phase_shapes"]


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer: `family` is the checkpoint naming the demo writes; `shared_intermediate` the shared experts'
    intermediate size (0: none)."""
    name: str
    family: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    group_size: int = 128
    shared_intermediate: int = 0

    def phases(self) -> dict[str, tuple[int, int, int]]:
        """{"gate_up": (K, N, top_k), "down": (K, N, top_k)} of the two GEMM phases (down runs one row per pair)."""
        return phase_shapes(self.hidden, self.intermediate, self.top_k)

    def expert_nbytes(self, bits: int, group_size: int) -> int:
        """The bytes of one routed expert's gate/up and down weights at `bits` and `group_size` (weights.expert_nbytes
        of each phase)."""
        return sum(expert_nbytes(k, n, bits, group_size) for k, n, _ in self.phases().values())


def phase_shapes(hidden: int, intermediate: int, top_k: int) -> dict[str, tuple[int, int, int]]:
    """(K, N, top_k) of gate/up ([M, H] @ [H, 2I], A pairs a row) and down ([M*A, I] @ [I, H], one pair a row)."""
    return {"gate_up": (hidden, 2 * intermediate, top_k), "down": (intermediate, hidden, 1)}


_TABLE = (
    ModelShape("tiny", "qwen2_moe", 256, 384, 8, 2, group_size=64),
    ModelShape("Mixtral-8x7B", "mixtral", 4096, 14336, 8, 2),
    ModelShape("Mixtral-8x22B", "mixtral", 6144, 16384, 8, 2),
    ModelShape("Qwen1.5-MoE-A2.7B", "qwen2_moe", 2048, 1408, 60, 4, shared_intermediate=5632),
    ModelShape("Qwen2-57B-A14B", "qwen2_moe", 3584, 2560, 64, 8, shared_intermediate=20480),
    ModelShape("Qwen3-30B-A3B", "qwen3_moe", 2048, 768, 128, 8),
    ModelShape("Qwen3-235B-A22B", "qwen3_moe", 4096, 1536, 128, 8),
    ModelShape("DeepSeek-V2-Lite", "deepseek_v2", 2048, 1408, 64, 6, shared_intermediate=2816),
    ModelShape("DeepSeek-V3", "deepseek_v3", 7168, 2048, 256, 8, shared_intermediate=2048),
)
MODELS: dict[str, ModelShape] = {m.name: m for m in _TABLE}
# the real models (every one but "tiny"): what `tune` and the benchmarks cover by default
BENCHMARK_MODELS: tuple[str, ...] = tuple(m.name for m in _TABLE if m.name != "tiny")


def get_model(name: str) -> ModelShape:
    """The shape called `name`, matched case-insensitively; ValueError naming the known names otherwise."""
    if isinstance(name, ModelShape):
        return name
    for key, shape in MODELS.items():
        if key.lower() == str(name).lower():
            return shape
    raise ValueError(f"model: expected one of {', '.join(MODELS)} (any case), got {name!r}")
