"""StackedGptqWeight: the GPTQ tensors of all E experts of one projection, stacked along a leading E axis.

Shape letters: E experts, K in-features, N out-features, G group size, R = ceil(K/G) groups.

    qweight [E, K*bits/32, N]      int32   codes packed along K (docs/gptq_layout.md)
    scales  [E, R, N]              float16
    qzeros  [E, R, N*bits/32]      int32   REAL zero points packed along N (gptq_v2 semantics), or None = symmetric
    g_idx   [E, K]                 int32   group of each input row (act-order), or None = k // G

These shape rules are written once, in `stacked_shapes`; the checkpoint loader checks files against it.
All arrays live on the host (NumPy) or all on the device (CuPy).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import _packing, _xp

__all__ = ["StackedGptqWeight", "concat_n", "stacked_shapes", "expert_shapes", "expert_nbytes", "num_groups",
           "group_len"]

_BITS = (2, 3, 4, 8)
_FORMATS = ("gptq", "gptq_v2")


def _array_kind(x) -> str | None:
    if _xp.is_device_array(x):
        return "device"
    if isinstance(x, np.ndarray):
        return "host"
    return None


def _is_float_dtype(dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def group_len(k: int, group_size: int) -> int:
    """G as a length: group_size, or K when group_size == -1 (one group over all of K)."""
    return k if group_size == -1 else group_size


def num_groups(k: int, group_size: int) -> int:
    """R = ceil(K / G) scale groups."""
    return -(-k // group_len(k, group_size))


def stacked_shapes(num_experts: int, k: int, n: int, bits: int, group_size: int) -> dict[str, tuple]:
    """The shape of each array of a StackedGptqWeight with E = num_experts, K, N, bits and group_size:

    qweight (E, K*bits/32, N), scales (E, R, N), qzeros (E, R, N*bits/32), g_idx (E, K), R = ceil(K/G).
    One expert of a GPTQ checkpoint stores the same shapes without the leading E (expert_shapes).
    """
    for name, value, low in (("num_experts", num_experts, 1), ("k", k, 1), ("n", n, 1), ("bits", bits, 1),
                             ("group_size", group_size, -1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value}")
    if bits not in _BITS:
        raise ValueError(f"bits: expected one of {_BITS}, got {bits}")
    if group_size == 0:
        raise ValueError("group_size: expected -1 or a positive int, got 0")
    if k * bits % 32:
        raise ValueError(f"k: expected K * bits a multiple of 32 (whole qweight words), got K={k}, bits={bits}")
    r = num_groups(k, group_size)
    return {"qweight": (num_experts, k * bits // 32, n), "scales": (num_experts, r, n),
            "qzeros": (num_experts, r, n * bits // 32), "g_idx": (num_experts, k)}


def expert_shapes(k: int, n: int, bits: int, group_size: int) -> dict[str, tuple]:
    """The shapes one expert's tensors have in a GPTQ checkpoint: stacked_shapes without the leading E."""
    return {name: shape[1:] for name, shape in stacked_shapes(1, k, n, bits, group_size).items()}


def expert_nbytes(k: int, n: int, bits: int, group_size: int) -> int:
    """The bytes of one expert's qweight, scales and qzeros (int32, float16, int32; no g_idx): what a GEMM reads of
    each expert it touches."""
    shapes = expert_shapes(k, n, bits, group_size)
    return sum(size * int(np.prod(shapes[name])) for name, size in (("qweight", 4), ("scales", 2), ("qzeros", 4)))


@dataclass(eq=False, repr=False)
class StackedGptqWeight:
    """GPTQ weights of E experts of one projection (see the module docstring for shapes).

    qweight: int32 [E, K*bits/32, N]. scales: float16 [E, ceil(K/G), N].
    qzeros: int32 [E, ceil(K/G), N*bits/32] real zero points, or None (symmetric: zero = 2**(bits-1)).
    g_idx: int32 [E, K] or None (k // G). bits: 2, 3, 4 or 8. group_size: G, or -1 for one group of K.
    K is derived as qweight.shape[1] * 32 // bits. All arrays NumPy or all CuPy.
    """

    qweight: Any
    scales: Any
    qzeros: Any | None
    g_idx: Any | None
    bits: int
    group_size: int

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
            raise TypeError(f"bits: expected an int, got {type(bits).__name__}")
        if int(bits) not in _BITS:
            raise ValueError(f"bits: expected one of {_BITS}, got {bits}")
        self.bits = int(bits)
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, (int, np.integer)):
            raise TypeError(f"group_size: expected an int, got {type(gs).__name__}")
        if gs != -1 and gs < 1:
            raise ValueError(f"group_size: expected -1 or a positive int, got {gs}")
        self.group_size = int(gs)

        fields = [("qweight", self.qweight), ("scales", self.scales), ("qzeros", self.qzeros),
                  ("g_idx", self.g_idx)]
        kinds = {}
        for name, x in fields:
            if x is None and name in ("qzeros", "g_idx"):
                continue
            kind = _array_kind(x)
            if kind is None:
                raise TypeError(f"{name}: expected a NumPy or CuPy array, got {type(x).__name__}")
            kinds[name] = kind
        if len(set(kinds.values())) > 1:
            first = kinds["qweight"]
            other = next(n for n, k in kinds.items() if k != first)
            raise TypeError(f"{other}: expected a {first} array like qweight (all NumPy or all CuPy), "
                            f"got a {kinds[other]} array")

        for name, x, dtype, ndim, letters in (
                ("qweight", self.qweight, np.int32, 3, "[E, K*bits/32, N]"),
                ("scales", self.scales, np.float16, 3, "[E, ceil(K/G), N]"),
                ("qzeros", self.qzeros, np.int32, 3, "[E, ceil(K/G), N*bits/32]"),
                ("g_idx", self.g_idx, np.int32, 2, "[E, K]")):
            if x is None:
                continue
            if x.dtype != dtype:
                raise TypeError(f"{name}: expected {np.dtype(dtype).name}, got {x.dtype}")
            if x.ndim != ndim:
                raise ValueError(f"{name}: expected {ndim}-D {letters}, got shape {tuple(x.shape)}")
            if not x.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")

        e, rows, n = self.qweight.shape
        words_per_unit = _packing.unit(self.bits)[1]  # 3 for 3 bits, else 1
        if e < 1 or rows < 1 or n < 1:
            raise ValueError(f"qweight: expected E, K*bits/32 and N all >= 1, got shape {self.qweight.shape}")
        if rows % words_per_unit:
            raise ValueError(f"qweight: expected K*bits/32 (axis 1) a multiple of {words_per_unit} for "
                             f"{self.bits}-bit (K a multiple of 32), got shape {self.qweight.shape}")
        k = self.k
        shapes = stacked_shapes(e, k, n, self.bits, self.group_size)
        want = shapes["scales"]
        if tuple(self.scales.shape) != want:
            raise ValueError(f"scales: expected shape {want} = [E, ceil(K/G), N] for K={k}, "
                             f"group_size={self.group_size}, got {tuple(self.scales.shape)}")
        if self.qzeros is not None:
            unit = _packing.unit(self.bits)[0]
            if n % unit:
                raise ValueError(f"qzeros: N = {n} must be a multiple of {unit} to pack {self.bits}-bit zeros, "
                                 f"got N = {n}")
            want = shapes["qzeros"]
            if tuple(self.qzeros.shape) != want:
                raise ValueError(f"qzeros: expected shape {want} = [E, ceil(K/G), N*bits/32], "
                                 f"got {tuple(self.qzeros.shape)}")
        if self.g_idx is not None:
            if tuple(self.g_idx.shape) != shapes["g_idx"]:
                raise ValueError(f"g_idx: expected shape {shapes['g_idx']} = [E, K], got {tuple(self.g_idx.shape)}")
            r = shapes["scales"][1]
            lo, hi = int(self.g_idx.min()), int(self.g_idx.max())  # kernels index scales with it: check range
            if lo < 0 or hi >= r:
                raise ValueError(f"g_idx: expected values in [0, {r - 1}] (ceil(K/G) = {r} groups), "
                                 f"got range [{lo}, {hi}]")

    # ------------------------------------------------------------------ properties
    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.qweight.shape[0])

    @property
    def k(self) -> int:
        """K in-features = qweight.shape[1] * 32 // bits."""
        return int(self.qweight.shape[1]) * 32 // self.bits

    @property
    def n(self) -> int:
        """N out-features."""
        return int(self.qweight.shape[2])

    @property
    def group_len(self) -> int:
        """G as a length: group_size, or K when group_size == -1."""
        return group_len(self.k, self.group_size)

    @property
    def num_groups(self) -> int:
        """ceil(K / G)."""
        return num_groups(self.k, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays together."""
        return sum(int(x.nbytes) for x in (self.qweight, self.scales, self.qzeros, self.g_idx) if x is not None)

    @property
    def is_device(self) -> bool:
        """True when the arrays are CuPy (device) arrays."""
        return _xp.is_device_array(self.qweight)

    def __repr__(self) -> str:
        return (f"StackedGptqWeight(E={self.num_experts}, K={self.k}, N={self.n}, bits={self.bits}, "
                f"group_size={self.group_size}, qzeros={'yes' if self.qzeros is not None else 'None (sym)'}, "
                f"g_idx={'yes' if self.g_idx is not None else 'no'}, "
                f"{'device' if self.is_device else 'host'}, {self.nbytes} bytes)")

    # ------------------------------------------------------------------ moving
    def _map(self, fn) -> "StackedGptqWeight":
        return dataclasses.replace(self, qweight=fn(self.qweight), scales=fn(self.scales),
                                   qzeros=None if self.qzeros is None else fn(self.qzeros),
                                   g_idx=None if self.g_idx is None else fn(self.g_idx))

    def to_device(self) -> "StackedGptqWeight":
        """A copy on the current CuPy device (self when already there)."""
        _xp.require_gpu("StackedGptqWeight.to_device")
        return self if self.is_device else self._map(_xp.to_device)

    def to_host(self) -> "StackedGptqWeight":
        """A NumPy copy (self when already on the host)."""
        return self._map(_xp.asnumpy) if self.is_device else self

    # ------------------------------------------------------------------ building
    @classmethod
    def from_experts(cls, qweights: Sequence, scales: Sequence, qzeros: Sequence | None, g_idx: Sequence | None = None,
                     *, bits: int, group_size: int, checkpoint_format: str = "gptq",
                     device: bool = False) -> "StackedGptqWeight":
        """Stack per-expert GPTQ tensors as a checkpoint stores them.

        qweights: E arrays int32 [K*bits/32, N]. scales: E arrays float16/float32/bfloat16 [ceil(K/G), N]
        (converted to float16). qzeros: E arrays int32 [ceil(K/G), N*bits/32], or None for symmetric.
        g_idx: E integer arrays [K], or None. bits, group_size: as in the checkpoint.
        checkpoint_format: "gptq" (v1 zeros, converted to real zeros) or "gptq_v2" (real zeros, kept).
        device: stack on the host, then copy each stacked tensor to the GPU once.
        Every expert must have expert 0's shapes; the error names the first that differs.
        """
        if checkpoint_format not in _FORMATS:
            raise ValueError(f"checkpoint_format: expected one of {_FORMATS}, got {checkpoint_format!r}")
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in _BITS:
            raise ValueError(f"bits: expected one of {_BITS}, got {bits!r}")
        bits = int(bits)
        lists = {"qweights": qweights, "scales": scales, "qzeros": qzeros, "g_idx": g_idx}
        for name, seq in lists.items():  # any iterable of per-expert arrays (a list, a generator, a stacked array)
            if seq is not None and (isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__")):
                raise TypeError(f"{name}: expected a sequence of arrays, one per expert, got {type(seq).__name__}")
            lists[name] = None if seq is None else list(seq)
        qweights, scales, qzeros, g_idx = lists.values()
        num = len(qweights)
        if num == 0:
            raise ValueError("qweights: expected at least one expert, got an empty sequence")
        for name, seq in lists.items():
            if seq is not None and len(seq) != num:
                raise ValueError(f"{name}: expected {num} experts like qweights, got {len(seq)}")

        def stack(name, seq, check_dtype):
            host = [_xp.asnumpy(x) for x in seq]
            for i, x in enumerate(host):
                if not isinstance(x, np.ndarray):
                    raise TypeError(f"{name}[{i}]: expected a NumPy or CuPy array, got {type(x).__name__}")
                check_dtype(f"{name}[{i}]", x)
                if x.shape != host[0].shape:
                    raise ValueError(f"{name}[{i}]: expected shape {host[0].shape} like expert 0, "
                                     f"got {x.shape}")
            return np.stack(host)  # contiguous [E, ...]

        def int32_only(label, x):
            if x.dtype != np.int32:
                raise TypeError(f"{label}: expected int32, got {x.dtype}")

        def float_scale(label, x):
            if not _is_float_dtype(x.dtype):
                raise TypeError(f"{label}: expected float16, float32 or bfloat16, got {x.dtype}")

        def integer(label, x):
            if x.dtype.kind not in "iu":
                raise TypeError(f"{label}: expected an integer array (int32), got {x.dtype}")

        qw = stack("qweights", qweights, int32_only)
        sc = stack("scales", scales, float_scale)
        if sc.dtype.name == "bfloat16":
            sc = sc.astype(np.float32)  # bf16 -> float32 is exact; then one rounding to float16
        sc = sc.astype(np.float16)
        qz = None if qzeros is None else stack("qzeros", qzeros, int32_only)
        gi = None if g_idx is None else stack("g_idx", g_idx, integer).astype(np.int32)
        out = cls(qw, sc, qz, gi, bits, group_size)  # validates shapes on the host, before any copy
        if qz is not None and checkpoint_format == "gptq":
            out = dataclasses.replace(out, qzeros=_packing.v1_to_real(qz, bits))
        return out.to_device() if device else out

    @classmethod
    def random(cls, num_experts: int, k: int, n: int, *, bits: int = 4, group_size: int = 128,
               seed: int = 0) -> "StackedGptqWeight":
        """Random codes and zero points (every code value), scales that keep a GEMM's output near unit size, on
        the current CuPy device: the weights the tuner, the benchmarks and the tools time (speed only; no
        checkpoint holds them)."""
        cp = _xp.require_gpu("StackedGptqWeight.random")
        rs = cp.random.RandomState(seed)
        groups = num_groups(k, group_size)
        qweight = rs.randint(-2**31, 2**31 - 1, size=(num_experts, k * bits // 32, n), dtype=cp.int32)
        scales = (rs.uniform(0.5, 1.5, size=(num_experts, groups, n)) / (2**bits * np.sqrt(k))).astype(cp.float16)
        qzeros = rs.randint(-2**31, 2**31 - 1, size=(num_experts, groups, n * bits // 32), dtype=cp.int32)
        return cls(qweight, scales, qzeros, None, bits, group_size)

    @classmethod
    def concat_n(cls, gate: "StackedGptqWeight", up: "StackedGptqWeight") -> "StackedGptqWeight":
        """w13 = [gate | up] along N (gate columns first); see concat_n()."""
        return concat_n(gate, up)

    @classmethod
    def from_safetensors(cls, path, layer, proj, *, device=True, scheme=None) -> "StackedGptqWeight":
        """Load one projection ("w13" gate|up, or "w2" down) of MoE layer `layer` from a checkpoint folder.

        device: True -> CuPy arrays (bits 4 and 8), False -> NumPy. scheme: a `cupy_moe.checkpoint.NamingScheme`
        for a family not detected automatically. Delegates to `cupy_moe.checkpoint.load_stacked`.
        """
        from .checkpoint import load_stacked
        return load_stacked(path, layer, proj, device=device, scheme=scheme)


def concat_n(gate: StackedGptqWeight, up: StackedGptqWeight) -> StackedGptqWeight:
    """Concatenate two projections along N: w13 [E, ., N_gate + N_up], gate columns first.

    Both must share E, K, bits, group_size, placement (host/device), symmetry, and g_idx (equal arrays or
    both None); each half's N must pack whole qzeros words (checked when each was built).
    """
    for name, x in (("gate", gate), ("up", up)):
        if not isinstance(x, StackedGptqWeight):
            raise TypeError(f"{name}: expected a StackedGptqWeight, got {type(x).__name__}")
    for attr in ("num_experts", "k", "bits", "group_size", "is_device"):
        if getattr(gate, attr) != getattr(up, attr):
            raise ValueError(f"up: expected {attr} = {getattr(gate, attr)} like gate, got {getattr(up, attr)}")
    if (gate.qzeros is None) != (up.qzeros is None):
        raise ValueError(f"up: expected qzeros {'None' if gate.qzeros is None else 'present'} like gate "
                         f"(both symmetric or both not), got {'None' if up.qzeros is None else 'present'}")
    if (gate.g_idx is None) != (up.g_idx is None):
        raise ValueError(f"up: expected g_idx {'None' if gate.g_idx is None else 'present'} like gate, "
                         f"got {'None' if up.g_idx is None else 'present'}")
    xp = _xp.cupy if gate.is_device else np
    if gate.g_idx is not None and not bool(xp.array_equal(gate.g_idx, up.g_idx)):
        raise ValueError("up: expected g_idx equal to gate's (one g_idx serves both halves of w13), got a "
                         "different g_idx")
    cat = lambda a, b: xp.ascontiguousarray(xp.concatenate([a, b], axis=-1))  # noqa: E731
    return StackedGptqWeight(cat(gate.qweight, up.qweight), cat(gate.scales, up.scales),
                             None if gate.qzeros is None else cat(gate.qzeros, up.qzeros),
                             None if gate.g_idx is None else gate.g_idx.copy(), gate.bits, gate.group_size)
