"""The kernel shapes that exist: their template parameters, name expressions, shared memory and source files.

Three kernel families:

- kind "reg", `moe_gemm` (decode, 16-, 32- and 48-row blocks): warps side by side over 128 columns (DECODE, 16 x 128)
  or along K (DECODE_WK, 16 x 32 with 4 warps on 4 K slices summed in shared memory in a fixed order); a
  warp-private cp.async weight ring; each lane dequantizes its B fragments in registers. A 16-row block with at
  most 8 rows swaps the mma operands (weights as the m16 side). `GemmConfig.group_mode` says how the scales are
  applied, LAUNCH_BOUNDS how many CTAs per SM the registers must allow.
- kind "tc", `moe_gemm_tc` (prefill, 64 x 256 and 128 x 256): each weight is dequantized once into a shared-memory
  B tile; wgmma on sm_90a, ldmatrix + mma.sync elsewhere. It has no act-order variant: act-order weights at these
  block sizes run the "reg" shapes of ACT_ORDER_SHAPES.
- kind "swapped" (sm_90a only): out^T = W^T a^T, the weights dequantized straight into wgmma's register A operand,
  the activation rows as its shared-memory B operand. HOPPER_SHAPES maps block sizes to it (32 and 48 rows:
  SWAPPED_32, SWAPPED_48).
  It has no act-order and no pair-order variant and needs sm_90a; otherwise the portable shape of that block size
  runs (`fallback`).

Which shape a problem gets is `cupy_moe.configs.heuristic.choose_config`'s business; this module only says what
exists and how each instance is named.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GemmConfig", "KERNEL_FILES", "TEMPLATES", "KERNEL_SHAPES", "ACT_ORDER_SHAPES", "HOPPER_SHAPES",
           "SPLIT_WARPS_SHAPES", "SUPPORTED_BLOCK_M", "DECODE", "DECODE_32", "DECODE_48", "DECODE_WK",
           "DECODE_WK_ONE_PAIR", "PREFILL", "PREFILL_128", "SWAPPED_32", "SWAPPED_48", "MAX_SPLIT", "CLUSTER_SPLIT",
           "COLUMN_BAND", "warps_k_choices", "fallback", "splits_in_cluster", "max_split_k",
           "all_name_expressions"]

# The CUDA source of each kind (kernels/<file>), and the template each kind instantiates.
KERNEL_FILES = {"reg": "moe_gemm_decode.cu", "tc": "moe_gemm_prefill.cu", "swapped": "moe_gemm_swapped.cu"}
TEMPLATES = {"reg": "moe_gemm", "tc": "moe_gemm_tc", "swapped": "moe_gemm_swapped"}

# CTAs resident per SM for each block_m without a launch bound (shared memory / registers of the default shapes,
# ptxas -v): decode 16 x 128 (about 150 registers) and 32 x 128 (about 165): 3; decode 48 x 128 (at most 212): 2;
# tc 64 x 256 (89 KiB): 2; tc 128 x 256 (about 210 registers): 1. GemmConfig.min_ctas raises the decode shapes' to
# their launch bounds.
RESIDENT_PER_SM = {16: 3, 32: 3, 48: 2, 64: 2, 128: 1}
# moe_gemm launch bounds (CTAs per SM) by warp layout (mt, warps_m, warps_n, ng, warps_k): 16 x 128 and 16 x 32 x 4
# at most 128 registers, 32 x 128 at most 168, no spills (nvcc 13.0; tests/test_compile.py checks NVRTC)
LAUNCH_BOUNDS = {(1, 1, 4, 1, 1): 4, (2, 1, 4, 1, 1): 3, (1, 1, 1, 1, 4): 4}
# the swapped kernel's 32 x 256 and 48 x 256: 128 registers x 256 threads (the 48-row one under a launch bound)
SWAPPED_RESIDENT_PER_SM = 2
MAX_SPLIT = 16  # the most K slices (split-K CTAs) of one tile
# K slices that run as one thread-block cluster (`splits_in_cluster`); clusters of 3 to 8 leave CTA slots empty
CLUSTER_SPLIT = 2
# The tile order of the tc and swapped kernels: CTAs launched one after another take COLUMN_BAND column tiles of a
# row block before the next row block; 1 = row blocks fastest (why: kernels/moe_gemm_common.cuh, banded_tile;
# measured: performance.md, prefill).
COLUMN_BAND = 16


@dataclass(frozen=True)
class GemmConfig:
    """Template parameters of one GEMM kernel instance plus the run-time split-K factor: what one launch runs.

    block_m = warps_m * mt * 16 rows of one expert per CTA (= the align block size B);
    block_n = warps_n * ng * 32 columns per CTA (kind "swapped": 128 * ng); ku = 32-wide K chunks per pipeline
    stage; stages = depth of the cp.async ring (stages - 1 stages in flight while one computes).
    kind: "reg", "tc" or "swapped" (module docstring). warps_k: "reg" warps side by side along K, each on its own
    slice, summed in shared memory.
    """
    mt: int
    warps_m: int
    warps_n: int
    ng: int
    ku: int
    stages: int = 4
    split_k: int = 1
    kind: str = "reg"
    warps_k: int = 1

    def __post_init__(self):
        if self.kind not in KERNEL_FILES:
            raise ValueError(f"kind: expected one of {sorted(KERNEL_FILES)}, got {self.kind!r}")
        for name in ("mt", "warps_m", "warps_n", "ng", "ku", "stages", "split_k", "warps_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.kind != "reg" and (self.warps_k != 1 or self.threads != 256):
            raise ValueError(f"kind {self.kind!r}: expected warps_m * warps_n = 8 and warps_k = 1 (its kernel runs 256 "
                             f"threads), got warps_m={self.warps_m}, warps_n={self.warps_n}, warps_k={self.warps_k}")

    @property
    def spec(self) -> str:
        """The configuration as text, 'kind:mt,warps_m,warps_n,ng,ku,stages,warps_k/split_k' (`from_spec` reads it):
        for command lines, JSON and test data."""
        return (f"{self.kind}:{self.mt},{self.warps_m},{self.warps_n},{self.ng},{self.ku},{self.stages},"
                f"{self.warps_k}/{self.split_k}")

    @classmethod
    def from_spec(cls, text: str) -> "GemmConfig":
        """The GemmConfig of a `spec` string; '/split_k' may be left out (1)."""
        kind, _, rest = str(text).partition(":")
        ints, _, split = rest.partition("/")
        try:
            values = [int(v) for v in ints.split(",")] + [int(split or 1)]
        except ValueError:
            values = []
        if not kind or len(values) != 8:
            raise ValueError(f"spec: expected 'kind:mt,warps_m,warps_n,ng,ku,stages,warps_k[/split_k]', got {text!r}")
        mt, warps_m, warps_n, ng, ku, stages, warps_k, split_k = values
        return cls(mt, warps_m, warps_n, ng, ku, stages, split_k=split_k, kind=kind, warps_k=warps_k)

    @property
    def block_m(self) -> int:
        return self.warps_m * self.mt * 16

    @property
    def block_n(self) -> int:
        return 128 * self.ng if self.kind == "swapped" else self.warps_n * self.ng * 32

    @property
    def short_name(self) -> str:
        """Block rows with a kind mark, as benchmarks and `tune` print it: '16', '16k' (warps along K), '32s' (the
        swapped-operand kernel)."""
        return f"{self.block_m}{'s' if self.kind == 'swapped' else 'k' if self.warps_k > 1 else ''}"

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * self.warps_k * 32

    @property
    def source_file(self) -> str:
        """The file under kernels/ that holds this kind's template."""
        return KERNEL_FILES[self.kind]

    def group_mode(self, act_order: bool, group_len: int | None, k: int | None = None) -> int:
        """moe_gemm's GM: 2 act-order; 1 one group per stage and every stage whole (group_len and K multiples of
        32*ku; k None: any K that is); else 0."""
        if act_order:
            return 2
        stage = 32 * self.ku
        return 1 if group_len is not None and group_len % stage == 0 and (k is None or k % stage == 0) else 0

    def min_ctas(self, act_order: bool) -> int:
        """moe_gemm's launch bound: CTAs per SM the compiler must fit in registers (1: none), LAUNCH_BOUNDS of the
        warp layout (any bits and group mode); at most 3 with act-order (the 16 x 128 shape bounded to 4 measured
        slower there), 1 for the other layouts, which would spill."""
        if self.kind != "reg":
            return 1
        bound = LAUNCH_BOUNDS.get((self.mt, self.warps_m, self.warps_n, self.ng, self.warps_k), 1)
        return min(bound, 3) if act_order else bound

    def ctas_per_sm(self, act_order: bool) -> int:
        """CTAs resident per SM, for the split-K estimate."""
        if self.kind == "swapped":
            return SWAPPED_RESIDENT_PER_SM
        return max(self.min_ctas(act_order), RESIDENT_PER_SM.get(self.block_m, 1))

    def name_expression(self, bf16: bool, bits: int, act_order: bool, group_len: int | None = None,
                        hopper: bool = False, k: int | None = None, pair_a: bool = False) -> str:
        """The kernel instance; hopper: the tc kernel's wgmma variant (sm_90a; moe_gemm has none); pair_a: the
        activations in pair order (4-bit; kinds "reg" and "tc")."""
        b = lambda flag: "true" if flag else "false"
        template = TEMPLATES[self.kind]
        if pair_a and (bits != 4 or self.kind == "swapped"):
            raise ValueError(f"pair_a: expected 4-bit weights and kind 'reg' or 'tc', got {bits}-bit, kind "
                             f"{self.kind!r} (`fallback` gives the portable shape)")
        if self.kind == "swapped":
            if act_order or not hopper:
                raise ValueError("kind 'swapped': expected hopper=True and act_order=False (`fallback` gives the "
                                 f"portable shape), got hopper={hopper}, act_order={act_order}")
            return f"{template}<{b(bf16)}, {bits}, {self.block_m}, {self.ng}, {self.stages}, {self.ku}>"
        if self.kind == "tc":
            if act_order:
                raise ValueError("act_order: expected False for the tc kernel (`fallback` gives the act-order shape), "
                                 "got True")
            return (f"{template}<{b(bf16)}, {bits}, {self.block_m}, {self.block_n}, {self.stages}, {self.ku}, "
                    f"{b(hopper)}, {b(pair_a)}>")
        gm = self.group_mode(act_order, group_len, k)
        return (f"{template}<{b(bf16)}, {bits}, {self.mt}, {self.warps_m}, {self.warps_n}, {self.warps_k}, "
                f"{self.ng}, {self.ku}, {self.stages}, {gm}, {self.min_ctas(act_order)}, {b(pair_a)}>")

    def smem_bytes(self, bits: int, hopper: bool = False) -> int:
        """Dynamic shared memory of one launch (must match TcSmem in moe_gemm_prefill.cu and SwappedSmem in
        moe_gemm_swapped.cu); 0 for kind "reg" (static).

        tc: per 32-k step (ku of them per stage) the activation rows, raw qweight rows, scales and zero words, plus
        two B buffers of ku tiles; the wgmma variant (hopper) rounds steps to 512 bytes and adds 1 KiB to align the
        base."""
        bn = self.block_n
        if self.kind == "swapped":
            step = -(-(self.block_m * 64 + bits * bn * 4 + bn * 2 + bn * bits // 8) // 512) * 512
            return self.stages * self.ku * step + 1024
        if self.kind != "tc":
            return 0
        step = self.block_m * 64 + bits * bn * 4 + bn * 2 + bn * bits // 8
        if hopper:
            step = -(-step // 512) * 512
        return self.stages * self.ku * step + 2 * self.ku * bn * 64 + (1024 if hopper else 0)


DECODE = GemmConfig(mt=1, warps_m=1, warps_n=4, ng=1, ku=4, stages=2)
DECODE_32 = GemmConfig(mt=2, warps_m=1, warps_n=4, ng=1, ku=2, stages=4)  # two m16 tiles share each dequantized weight
DECODE_48 = GemmConfig(mt=3, warps_m=1, warps_n=4, ng=1, ku=2, stages=4)  # three, where SWAPPED_48 cannot run
PREFILL = GemmConfig(mt=2, warps_m=2, warps_n=4, ng=2, ku=1, stages=6, kind="tc")     # 64 x 256
PREFILL_128 = GemmConfig(mt=4, warps_m=2, warps_n=4, ng=2, ku=2, stages=4, kind="tc")  # 128 x 256, 64-k stages
# the portable shape of each block size
KERNEL_SHAPES = {c.block_m: c for c in (DECODE, DECODE_32, DECODE_48, PREFILL, PREFILL_128)}
SUPPORTED_BLOCK_M = tuple(sorted(KERNEL_SHAPES))
# act-order weights at the tc block sizes: "reg" shapes of the same block_m
ACT_ORDER_SHAPES = {16: DECODE, 64: GemmConfig(mt=2, warps_m=2, warps_n=2, ng=2, ku=1, stages=4),
                    128: GemmConfig(mt=4, warps_m=2, warps_n=4, ng=1, ku=1, stages=4)}
# the 16-row decode shape with its K slices as the warps of one CTA, in place of split-K
DECODE_WK = GemmConfig(mt=1, warps_m=1, warps_n=1, ng=1, ku=4, stages=2, warps_k=4)
SPLIT_WARPS_SHAPES = {16: DECODE_WK}
# DECODE_WK in 64-k stages, where it takes one pair per block (no aligned list: heuristic rules 7 and 8)
DECODE_WK_ONE_PAIR = replace(DECODE_WK, ku=2)
# sm_90a: block sizes that run the swapped-operand kernel instead (weights as the wgmma M side)
SWAPPED_32 = GemmConfig(mt=2, warps_m=1, warps_n=8, ng=2, ku=2, stages=6, kind="swapped")  # 32 x 256, 6 x 64 k
SWAPPED_48 = replace(SWAPPED_32, mt=3)  # 48 x 256
HOPPER_SHAPES = {c.block_m: c for c in (SWAPPED_32, SWAPPED_48)}


def warps_k_choices(block_m: int | None) -> tuple[int, ...]:
    """The warps_k a block size's shapes have: 1, and the warps-along-K shape's where there is one."""
    alt = SPLIT_WARPS_SHAPES.get(block_m)
    return (1,) if alt is None else (1, alt.warps_k)


def fallback(cfg: GemmConfig, *, act_order: bool, hopper: bool, pair_a: bool = False) -> GemmConfig:
    """The shape that runs `cfg` where its kernel has no variant: a swapped shape off sm_90a (hopper False), with
    act-order or with pair-ordered activations -> the portable shape of its block size; a tc shape with act-order
    -> ACT_ORDER_SHAPES. The split-K factor is kept."""
    if cfg.kind == "swapped" and (act_order or not hopper or pair_a):
        cfg = replace(KERNEL_SHAPES[cfg.block_m], split_k=cfg.split_k)
    if cfg.kind == "tc" and act_order:
        cfg = replace(ACT_ORDER_SHAPES[cfg.block_m], split_k=cfg.split_k)
    return cfg


def splits_in_cluster(cfg: GemmConfig, split: int, hopper: bool) -> bool:
    """Whether a launch of `cfg` with `split` K slices runs them as one thread-block cluster that adds the partial
    tiles through distributed shared memory (kernels/split_k.cuh) instead of the workspace, where the device has
    clusters (compute capability 9.0): CLUSTER_SPLIT slices of the decode kernel's 16-row blocks, or of the tc
    kernel's wgmma variant (hopper: the sm_90a build)."""
    if split != CLUSTER_SPLIT:
        return False
    return (cfg.kind == "reg" and cfg.block_m == 16) or (cfg.kind == "tc" and hopper)


def max_split_k(k: int, ku: int) -> int:
    """The most K slices of a shape with `ku` 32-k chunks per stage: each keeps at least 2 stages, at most
    MAX_SPLIT."""
    return max(1, min(MAX_SPLIT, (k // 32) // (2 * ku)))


def all_name_expressions(arch: str = "sm_80", filename: str | None = None) -> list[str]:
    """Every kernel instance the launcher can request when built for `arch` (the NVRTC compile test compiles all
    of them): on sm_90a the Hopper shapes where they exist and the portable ones where they fall back (act-order,
    pair order); elsewhere the portable ones. filename: only the instances of that kernels/ file."""
    hopper = arch == "sm_90a"
    names = []
    for bf16 in (False, True):
        for bits in (4, 8):
            for block_m, shape in KERNEL_SHAPES.items():
                shapes = [HOPPER_SHAPES.get(block_m, shape) if hopper else shape]
                if block_m in SPLIT_WARPS_SHAPES:
                    shapes.append(SPLIT_WARPS_SHAPES[block_m])
                if block_m == DECODE_WK_ONE_PAIR.block_m:
                    shapes.append(DECODE_WK_ONE_PAIR)
                for cfg in shapes:
                    for act in (False, True):
                        for pair_a in ((False, True) if bits == 4 else (False,)):
                            run = fallback(cfg, act_order=act, hopper=hopper, pair_a=pair_a)
                            if filename is not None and run.source_file != filename:
                                continue
                            for glen in ((None,) if act else (32, 32 * run.ku)):  # both group modes
                                names.append(run.name_expression(bf16, bits, act, glen, hopper, pair_a=pair_a))
    return list(dict.fromkeys(names))
