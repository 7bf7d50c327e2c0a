"""Tile choice for the fused GPTQ MoE GEMM, in one place.

Three kernels, one file each (GemmConfig.source_file):

- `moe_gemm` (kind "reg", decode, 16- and 32-row blocks): warps side by side over 128 columns (DECODE, 16 x 128)
  or along K (DECODE_WK, 16 x 32 with 4 warps on 4 K slices summed in shared memory in a fixed order); a
  warp-private cp.async weight ring; each lane dequantizes its B fragments in registers. A 16-row block with at
  most 8 rows swaps the mma operands (weights as the m16 side). `GemmConfig.group_mode` says how the scales are
  applied, LAUNCH_BOUNDS how many CTAs per SM the registers must allow.
- `moe_gemm_tc` (kind "tc", prefill, 64 x 256 and 128 x 256): each weight is dequantized once into a shared-memory
  B tile; wgmma on sm_90a, ldmatrix + mma.sync elsewhere. Act-order weights at these block sizes run the
  `moe_gemm` shapes of ACT_ORDER_SHAPES.
- `moe_gemm_swapped` (kind "ws", sm_90a only): the operands swapped, weights dequantized straight into wgmma's register
  A operand. HOPPER_SHAPES maps block sizes to it (32 rows: WS_32); off sm_90a, with act-order or with pair-ordered
  activations the portable shape of that block size runs instead.

The heuristic (`choose_config`), with P = M * A pairs, `touched` = expected_experts(M, E, A) and r = P / touched
rows per touched expert:

1. block_m = 16 for r <= ROWS_16_MAX (24), 64 for r <= ROWS_64_MAX (56), else 128. No 32-row block by default.
2. split_k: the fewest K slices (each at least 2 stages, at most 16) whose estimate
   waves x (stages per slice + SPLIT_FILL_STAGES) is within 5% of the least, with
   waves = ceil(CTAs x slices / (ctas_per_sm x NUM_SMS)). The tc tiles split only grids of less than one wave.
   Split-K is deterministic: each tile's last CTA sums the fp32 partials in slice order; no atomics on outputs.
3. A split 64-row pick (no act-order) becomes 128 rows unsplit where the 128-row grid fills at least FULL_WAVE
   of its waves.
4. A split 16-row pick becomes DECODE_WK, one CTA per column strip, where its warps' slices are at most
   WARPS_K_EXTRA_STAGES stages longer than the split's; except a 2-way split whose grid fits one wave with at most
   8 rows per expert (the swapped path), which stays 16 x 128.
5. An entry of `python -m cupy_moe tune` for this GPU and problem (block_m and split_k) wins over rules 1-3; rule 4
   still applies to it. A `block_m` passed in skips rules 1 and 3.

`block_m` is the align block size of that phase (`moe_align_block_size` takes it; fused_moe aligns a second time
when its two phases pick different sizes). Every rule and constant here was measured on an H200: the same-run
A/Bs behind them are in docs/heuristic.md.
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["GemmConfig", "choose_config", "expected_experts", "KERNEL_SHAPES", "ACT_ORDER_SHAPES", "SUPPORTED_BLOCK_M",
           "NUM_SMS", "kernel_instance", "all_name_expressions", "MODEL_SHAPES", "tuned_cache_path", "tuning_key",
           "tuned_table", "save_tuned", "hopper_enabled"]

# The MoE shapes of SHAPES.md: name -> (H, I, E, A). Benchmarks and `python -m cupy_moe tune` use these.
MODEL_SHAPES = {
    "Mixtral-8x7B": (4096, 14336, 8, 2),
    "Mixtral-8x22B": (6144, 16384, 8, 2),
    "Qwen1.5-MoE-A2.7B": (2048, 1408, 60, 4),
    "Qwen2-57B-A14B": (3584, 2560, 64, 8),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "Qwen3-235B-A22B": (4096, 1536, 128, 8),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "DeepSeek-V3": (7168, 2048, 256, 8),
}

NUM_SMS = 132        # H100/H200; only used for the split-K estimate
# CTAs resident per SM for each block_m without a launch bound (shared memory / registers of the default shapes,
# ptxas -v): decode 16 x 128 (about 150 registers) and 32 x 128 (about 165): 3; tc 64 x 256 (89 KiB): 2; tc 128 x 256
# (about 210 registers): 1. GemmConfig.min_ctas raises the decode shapes' to their launch bounds.
RESIDENT_PER_SM = {16: 3, 32: 3, 64: 2, 128: 1}
# moe_gemm launch bounds (CTAs per SM) by warp layout (mt, warps_m, warps_n, ng, warps_k): 16 x 128 and 16 x 32 x 4
# at most 128 registers, 32 x 128 at most 168, no spills (nvcc 13.0; tests/test_compile.py checks NVRTC)
LAUNCH_BOUNDS = {(1, 1, 4, 1, 1): 4, (2, 1, 4, 1, 1): 3, (1, 1, 1, 1, 4): 4}
WS_RESIDENT_PER_SM = 2  # moe_gemm_swapped 32 x 256: about 125 registers x 256 threads
_MAX_SPLIT = 16
SPLIT_FILL_STAGES = 4  # the split estimate's stages per CTA for its pipeline fill, epilogue and partials
FULL_WAVE = 0.9  # a split 64-row pick becomes 128 rows unsplit where that grid fills this much of its waves


_SOURCE_FILES = {"reg": "moe_gemm_decode.cu", "tc": "moe_gemm_prefill.cu", "ws": "moe_gemm_swapped.cu"}


@dataclass(frozen=True)
class GemmConfig:
    """Template parameters of one `moe_gemm` instance plus the run-time split-K factor.

    block_m = warps_m * mt * 16 rows of one expert per CTA (= the align block size B);
    block_n = warps_n * ng * 32 columns per CTA (kind "ws": 128 * ng); ku = 32-wide K chunks per pipeline stage;
    stages = depth of the cp.async ring (stages - 1 stages in flight while one computes).
    """
    mt: int
    warps_m: int
    warps_n: int
    ng: int
    ku: int
    stages: int = 4
    split_k: int = 1
    kind: str = "reg"  # "reg": moe_gemm (B dequantized in registers), "tc": moe_gemm_tc (B in shared memory),
    # "ws": moe_gemm_swapped (sm_90a: weights as the wgmma M side in registers; warps_m 1, warps_n 8, ng m64 tiles per
    # warpgroup, so block_n = 128 * ng)
    warps_k: int = 1  # moe_gemm: warps side by side along K, each on its own slice, summed in shared memory

    @property
    def block_m(self) -> int:
        return self.warps_m * self.mt * 16

    @property
    def block_n(self) -> int:
        return 128 * self.ng if self.kind == "ws" else self.warps_n * self.ng * 32

    @property
    def short_name(self) -> str:
        """Block rows with a kind mark, as benchmarks and `tune` print it: '16', '16k' (warps along K), '32s' (the
        swapped-operand kernel)."""
        return f"{self.block_m}{'s' if self.kind == 'ws' else 'k' if self.warps_k > 1 else ''}"

    @property
    def source_file(self) -> str:
        """The file of kernels/ that holds this kind's kernel template."""
        return _SOURCE_FILES[self.kind]

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * self.warps_k * 32

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
        if self.kind == "ws":
            return WS_RESIDENT_PER_SM
        return max(self.min_ctas(act_order), RESIDENT_PER_SM.get(self.block_m, 1))

    def name_expression(self, bf16: bool, bits: int, act_order: bool, group_len: int | None = None,
                        hopper: bool = False, k: int | None = None, pair_a: bool = False) -> str:
        """The kernel instance; hopper: the tc kernel's wgmma variant (sm_90a; moe_gemm has none); pair_a: the
        activations in pair order (4-bit; moe_gemm and the tc kernel, see kPairA in moe_gemm_decode.cu)."""
        b = lambda flag: "true" if flag else "false"
        if pair_a and (bits != 4 or self.kind == "ws"):
            raise ValueError(f"pair_a: expected 4-bit weights and kind 'reg' or 'tc', got {bits}-bit, kind "
                             f"{self.kind!r} (kernel_instance falls back from 'ws')")
        if self.kind == "ws":
            if act_order or not hopper:
                raise ValueError("kind 'ws': expected hopper=True and act_order=False (kernel_instance falls back), "
                                 f"got hopper={hopper}, act_order={act_order}")
            return f"moe_gemm_swapped<{b(bf16)}, {bits}, {self.block_m}, {self.ng}, {self.stages}, {self.ku}>"
        if self.kind == "tc":
            if act_order:
                raise ValueError("act_order: expected False for the tc kernel (use kernel_instance), got True")
            return (f"moe_gemm_tc<{b(bf16)}, {bits}, {self.block_m}, {self.block_n}, {self.stages}, {self.ku}, "
                    f"{b(hopper)}, {b(pair_a)}>")
        gm = self.group_mode(act_order, group_len, k)
        return (f"moe_gemm<{b(bf16)}, {bits}, {self.mt}, {self.warps_m}, {self.warps_n}, {self.warps_k}, {self.ng}, "
                f"{self.ku}, {self.stages}, {gm}, {self.min_ctas(act_order)}, {b(pair_a)}>")

    def smem_bytes(self, bits: int, hopper: bool = False) -> int:
        """Dynamic shared memory of one launch (must match TcSmem in moe_gemm_prefill.cu); 0 for moe_gemm (static).

        tc: per 32-k step (ku of them per stage) the activation rows, raw qweight rows, scales and zero words, plus
        two B buffers of ku tiles; the wgmma variant (hopper) rounds steps to 512 bytes and adds 1 KiB to align the
        base."""
        bn = self.block_n
        if self.kind == "ws":  # SwappedSmem in moe_gemm_swapped.cu
            step = -(-(self.block_m * 64 + bits * (bn * 4 + 32) + bn * 2 + bn * bits // 8) // 512) * 512
            return self.stages * self.ku * step + 1024
        if self.kind != "tc":
            return 0
        step = self.block_m * 64 + bits * bn * 4 + bn * 2 + bn * bits // 8
        if hopper:
            step = -(-step // 512) * 512
        return self.stages * self.ku * step + 2 * self.ku * bn * 64 + (1024 if hopper else 0)


DECODE = GemmConfig(mt=1, warps_m=1, warps_n=4, ng=1, ku=4, stages=2)
DECODE_32 = GemmConfig(mt=2, warps_m=1, warps_n=4, ng=1, ku=2, stages=4)  # two m16 tiles share each dequantized weight
PREFILL = GemmConfig(mt=2, warps_m=2, warps_n=4, ng=2, ku=1, stages=6, kind="tc")     # 64 x 256
PREFILL_128 = GemmConfig(mt=4, warps_m=2, warps_n=4, ng=2, ku=2, stages=4, kind="tc")  # 128 x 256, 64-k stages
KERNEL_SHAPES = {c.block_m: c for c in (DECODE, DECODE_32, PREFILL, PREFILL_128)}
# act-order weights at the tc block sizes: moe_gemm shapes of the same block_m
ACT_ORDER_SHAPES = {16: DECODE, 64: GemmConfig(mt=2, warps_m=2, warps_n=2, ng=2, ku=1, stages=4),
                    128: GemmConfig(mt=4, warps_m=2, warps_n=4, ng=1, ku=1, stages=4)}
SUPPORTED_BLOCK_M = tuple(sorted(KERNEL_SHAPES))
# The 16-row decode shape with its K slices as the warps of one CTA, in place of split-K (rule 4 of the docstring;
# splits of 2-4 always qualify)
DECODE_WK = GemmConfig(mt=1, warps_m=1, warps_n=1, ng=1, ku=4, stages=2, warps_k=4)
SPLIT_WARPS_SHAPES = {16: DECODE_WK}
WARPS_K_EXTRA_STAGES = 1  # negative: never
# sm_90a: block sizes that run the swapped-operand kernel instead (weights as the wgmma M side)
WS_32 = GemmConfig(mt=2, warps_m=1, warps_n=8, ng=2, ku=1, stages=6, kind="ws")  # 32 x 256, 6 stages of 32 k
HOPPER_SHAPES = {32: WS_32}
_PORTABLE_SHAPES = dict(KERNEL_SHAPES)  # what a ws shape falls back to off sm_90a or with act-order
# heuristic block_m: rows per touched expert <= 24 -> 16, <= 56 -> 64, else 128 (rule 1 of the docstring)
ROWS_16_MAX, ROWS_64_MAX = 24, 56


def hopper_enabled(arch: str) -> bool:
    """Whether the Hopper kernels run (the tc kernel's wgmma variant and HOPPER_SHAPES): on `sm_90a` unless the
    environment sets CUPY_MOE_HOPPER=0 (the portable kernels then run, e.g. to compare)."""
    return arch == "sm_90a" and os.environ.get("CUPY_MOE_HOPPER", "1") != "0"


def down_pair_order(bits: int, block_m: int) -> bool:
    """Whether fused_moe's down GEMM reads its activations in pair order (fused_moe_gemm's a_pair_order): 4-bit
    weights on 16-row blocks. moe_gemm's 16-row loops then skip re-pairing them: down rows 2-8% faster (H200,
    2026-12-04). The tc kernel of 64- and 128-row blocks ran 4-5% slower with them, though its loop is 32 of 365
    instructions shorter, so those blocks keep the natural order."""
    return bits == 4 and block_m == 16


def kernel_instance(cfg: GemmConfig, bf16: bool, bits: int, act_order: bool, group_len: int, hopper: bool = False,
                    k: int | None = None, pair_a: bool = False):
    """(config actually launched, name expression, dynamic shared-memory bytes) for one call.

    The split-K factor of `cfg` is kept; act-order at a tc block size switches to ACT_ORDER_SHAPES[block_m].
    hopper: the Hopper variants (see hopper_enabled). pair_a: activations in pair order (4-bit only), which the ws
    kernel does not read, so a ws shape falls back to the portable one.
    """
    if cfg.kind == "ws" and (act_order or not hopper or pair_a):
        cfg = replace(_PORTABLE_SHAPES[cfg.block_m], split_k=cfg.split_k)
    if cfg.kind == "tc" and act_order:
        cfg = replace(ACT_ORDER_SHAPES[cfg.block_m], split_k=cfg.split_k)
    return (cfg, cfg.name_expression(bf16, bits, act_order, group_len, hopper, k, pair_a),
            cfg.smem_bytes(bits, hopper))


def all_name_expressions(arch: str = "sm_80") -> list[str]:
    """Every kernel instance the launcher can request on `arch` (the NVRTC compile test compiles all of them);
    on sm_90a both the Hopper and the sm_80-style variants."""
    names = []
    for hopper in ((False, True) if arch == "sm_90a" else (False,)):
        for bf16 in (False, True):
            for bits in (4, 8):
                for cfg in (*KERNEL_SHAPES.values(), *HOPPER_SHAPES.values(), *SPLIT_WARPS_SHAPES.values()):
                    for act, glen in ((False, 32), (False, 32 * cfg.ku), (True, None)):
                        for pair_a in ((False, True) if bits == 4 else (False,)):
                            names.append(kernel_instance(cfg, bf16, bits, act, glen, hopper, pair_a=pair_a)[1])
    return list(dict.fromkeys(names))


def choose_config(m: int, e: int, a: int, k: int, n: int, bits: int, group_size: int,
                  block_m: int | None = None, hopper: bool | None = None, act_order: bool = False) -> GemmConfig:
    """The tile configuration for one GEMM phase.

    m: tokens M (rows of the activation), e: experts E, a: top-k A of this phase (the down phase passes
    m = M*A rows and a = 1), k: K, n: N, bits, group_size: G (-1 = one group).
    block_m: force the tile height (the align block size already used); None = heuristic.
    hopper: whether the sm_90a kernels run (HOPPER_SHAPES); None = ask the current device (False without a GPU).
    act_order: the weights carry g_idx (only the split-K estimate's CTAs per SM depend on it).
    Returns a GemmConfig; its `block_m` is the block size to align with.
    A configuration measured by `python -m cupy_moe tune` for this GPU and problem wins over the heuristic.
    """
    pairs = max(1, m * a)
    touched = expected_experts(m, e, a)
    rows = pairs / touched
    if hopper is None:
        hopper = _device_hopper()

    def shape(bm):
        if hopper and bm in HOPPER_SHAPES:
            return HOPPER_SHAPES[bm]
        return KERNEL_SHAPES[bm]

    def grid(bm):  # (shape, CTAs of the unsplit grid, resident slots)
        cfg = shape(bm)
        ctas = math.ceil(_blocks(touched, rows, cfg.block_m) * -(-n // cfg.block_n))
        return cfg, ctas, cfg.ctas_per_sm(act_order) * NUM_SMS

    def split_shape(cfg, ctas, slots):  # cfg with its split, or the warps-along-K shape in its place (_split_warps)
        return _split_warps(cfg, k, one_wave_swapped=2 * ctas <= slots and rows <= 8)

    tuned = _tuned_entry(e, k, n, bits, group_size, m * a)
    if tuned is not None and (block_m is None or block_m == tuned["block_m"]):
        base, ctas, slots = grid(tuned["block_m"])
        return split_shape(replace(base, split_k=tuned["split_k"]), ctas, slots)
    heuristic = block_m is None
    if heuristic:
        block_m = 16 if rows <= ROWS_16_MAX else 64 if rows <= ROWS_64_MAX else 128
    elif block_m not in KERNEL_SHAPES:
        raise ValueError(f"block_m: expected one of {SUPPORTED_BLOCK_M}, got {block_m}")
    base, ctas, slots = grid(block_m)
    max_split = max_split_k(k, base.ku)
    stages = -(-max(1, k // 32) // base.ku)
    if base.kind == "tc" and ctas >= slots:
        max_split = 1  # a 64- or 128-row tile's fp32 partial costs more than the estimate's F stages
    cost = [-(-ctas * s // slots) * (-(-stages // s) + SPLIT_FILL_STAGES) for s in range(1, max_split + 1)]
    split = next(s for s, c in enumerate(cost, 1) if c <= 1.05 * min(cost))
    if heuristic and block_m == 64 and split > 1 and not act_order:
        big, big_ctas, big_slots = grid(128)
        if big_ctas >= FULL_WAVE * big_slots * -(-big_ctas // big_slots):
            return replace(big, split_k=1)  # rule 3: a full unsplit wave of 128-row tiles
    return split_shape(replace(base, split_k=split), ctas, slots)


def _split_warps(cfg: GemmConfig, k: int, one_wave_swapped: bool = False) -> GemmConfig:
    """SPLIT_WARPS_SHAPES[block_m] (one CTA per column strip) in place of a split shape whose K slices its warps'
    slices exceed by at most WARPS_K_EXTRA_STAGES stages (see there); not for a 2-way split whose split grid fits one
    wave with at most 8 rows per expert (one_wave_swapped: the swapped-operand path); rule 4 of the docstring."""
    alt = SPLIT_WARPS_SHAPES.get(cfg.block_m)
    if alt is None or cfg.kind != "reg" or cfg.split_k < 2 or WARPS_K_EXTRA_STAGES < 0:
        return cfg
    if cfg.split_k == 2 and one_wave_swapped:
        return cfg
    stages = -(-max(1, k // 32) // alt.ku)
    if -(-stages // alt.warps_k) > -(-stages // cfg.split_k) + WARPS_K_EXTRA_STAGES:
        return cfg
    return replace(alt, split_k=1)


def _device_hopper() -> bool:
    from . import _compile, _xp
    return _xp.gpu_available() and hopper_enabled(_compile.device_arch())


def expected_experts(m: int, e: int, a: int) -> float:
    """Distinct experts that m tokens with top-a of e experts touch on average under uniform routing (at least 1)."""
    return max(1.0, round(e * (1.0 - (1.0 - min(1.0, a / e)) ** max(1, m)), 6))


def max_split_k(k: int, ku: int) -> int:
    """The most K slices of a shape with `ku` 32-k chunks per stage: each keeps at least 2 stages, at most
    _MAX_SPLIT."""
    return max(1, min(_MAX_SPLIT, (k // 32) // (2 * ku)))


def _blocks(touched: float, rows: float, block_m: int) -> float:
    """Live m-blocks of the aligned pair list, about: touched experts x blocks of their average row count."""
    return touched * -(-int(rows + 0.999) // block_m)


# ---------------------------------------------------------------- tuned configurations
# `python -m cupy_moe tune` times the candidates on the GPU at hand and stores the winners in one JSON file,
# {gpu name: {tuning_key: {"block_m", "split_k", "time_us"}}}, read once per process. Problems it has no entry
# for use the heuristic above; when the file holds entries for this GPU but not for a problem, a warning says so
# once per problem.

def tuned_cache_path() -> Path:
    """$CUPY_MOE_CACHE_DIR, else $XDG_CACHE_HOME/cupy_moe, else ~/.cache/cupy_moe; file tuned_configs.json."""
    root = os.environ.get("CUPY_MOE_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cupy_moe"
    return Path(root) / "tuned_configs.json"


def tuning_key(e: int, k: int, n: int, bits: int, group_size: int, pairs: int) -> str:
    """One entry per (E, K, N, bits, G, bucket of P = M*A pairs); buckets are powers of two."""
    bucket = 1 << max(0, int(pairs) - 1).bit_length()
    return f"E{e}_K{k}_N{n}_b{bits}_G{group_size}_P{bucket}"


@functools.lru_cache(maxsize=None)
def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"cupy_moe: ignoring the tuned-config cache {path}: {exc}", stacklevel=3)
        return {}
    return data if isinstance(data, dict) else {}


def _device_name() -> str | None:
    from . import _xp
    if not _xp.gpu_available():
        return None
    return _gpu_name(_xp.cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _gpu_name(device_id: int) -> str:
    from . import _xp
    name = _xp.cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def tuned_table(gpu: str | None = None) -> dict:
    """The in-memory tuned entries of one GPU (default: the current device; {} without a GPU); mutable."""
    gpu = gpu or _device_name()
    if gpu is None:
        return {}
    return _load_cache(tuned_cache_path()).setdefault(gpu, {})


_WARNED: set = set()


def _tuned_entry(e, k, n, bits, group_size, pairs):
    table = tuned_table()
    if not table or pairs <= 0:
        return None
    key = tuning_key(e, k, n, bits, group_size, pairs)
    entry = table.get(key)
    if entry is None:
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"cupy_moe: no tuned GEMM config for {key} in {tuned_cache_path()}; using the heuristic "
                          "(python -m cupy_moe tune measures one)", stacklevel=4)
        return None
    try:
        block_m, split_k = int(entry["block_m"]), int(entry["split_k"])
    except (KeyError, TypeError, ValueError):
        return None
    if block_m not in KERNEL_SHAPES or not 1 <= split_k <= _MAX_SPLIT:
        return None
    return {"block_m": block_m, "split_k": split_k}


def save_tuned(gpu: str, entries: dict) -> Path:
    """Merge {tuning_key: {"block_m", "split_k", "time_us"}} for `gpu` into the cache file; returns its path."""
    path = tuned_cache_path()
    data = dict(_load_cache(path))
    data.setdefault(gpu, {}).update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    _load_cache.cache_clear()
    return path
