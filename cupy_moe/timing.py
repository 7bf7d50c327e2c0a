"""GPU timing, written once: CUDA events around calls or around replays of a captured CUDA graph, medians after
warm-up, and the two hardware floors measured the same way (copy bandwidth, fp16 matmul rate).

Used by `tune`, the demo and the benchmarks. Every function but the targets and `regime_summary` needs CuPy and a
GPU.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ._xp import require_gpu

__all__ = ["event_time", "graph_time", "weight_copies", "random_activations", "copy_bandwidth", "matmul_rate",
           "layer_target", "roofline_target", "regime_summary", "ROOFLINE_TARGET_M", "REGIMES"]

# The token counts M at which the GEMM phases are judged against roofline_target (every model, both phases).
ROOFLINE_TARGET_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


def event_time(fn: Callable[[int], object], reps: int = 20, warmup: int = 3, stream=None) -> float:
    """Median seconds of `fn(i)` (i = 0, 1, ... so a caller can rotate inputs) between two CUDA events on `stream`
    (default: the current one), after `warmup` untimed calls."""
    cp = require_gpu("timing")
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    for i in range(warmup):
        fn(i)
    starts = [cp.cuda.Event() for _ in range(reps)]
    stops = [cp.cuda.Event() for _ in range(reps)]
    for i in range(reps):
        starts[i].record(stream)
        fn(warmup + i)
        stops[i].record(stream)
    stops[-1].synchronize()
    return float(np.median([cp.cuda.get_elapsed_time(a, b) for a, b in zip(starts, stops)])) * 1e-3


def weight_copies(nbytes: int) -> int:
    """How many copies of a weight of `nbytes` bytes a timing rotates through, one per call in turn, so that no
    call finds its weights in L2 (50 MiB on an H100 or H200) from the calls before it: enough for 512 MiB, at most
    4. Rotating routings alone is not enough where a few routings touch about the L2's size in all: a
    small-expert M = 1 row timed over 4 routings of one copy ran from L2 and its fastest configuration was not
    the fastest from memory."""
    return max(1, min(4, -(-512 * 2**20 // max(1, int(nbytes)))))


def random_activations(shape, dtype, seed: int, scale: float = 1.0):
    """scale * N(0, 1) samples of `shape` in `dtype` (float16 or ml_dtypes.bfloat16), drawn on the current CuPy
    device from `seed`: the activations that the tuner, the benchmarks and the tools time. A host draw costs
    seconds at prefill sizes: Mixtral-8x7B's down phase at M = 16384 reads 32768 x 14336 values, about 16 s for
    NumPy on one core, and a benchmark row draws eight sets."""
    cp = require_gpu("timing")
    x = cp.random.RandomState(seed).standard_normal(shape, dtype=cp.float32)
    if scale != 1.0:
        x *= scale
    return x.astype(dtype)


def graph_time(calls: Sequence[Callable[[], object]], reps: int = 10, warmup: int = 2, stream=None) -> float:
    """Median seconds per call of `calls`, captured once into a CUDA graph (after one eager round, which compiles
    kernels) and replayed: the launchers' Python stays out of the time, launch gaps inside the graph stay in.
    Several calls over different inputs keep one input set from sitting in L2 between calls."""
    cp = require_gpu("timing")
    if not calls:
        raise ValueError("calls: expected at least one call, got none")
    own = stream is None
    stream = stream or cp.cuda.Stream(non_blocking=True)
    with stream:
        for call in calls:
            call()
        stream.synchronize()
        stream.begin_capture()
        try:
            for call in calls:
                call()
        finally:
            graph = stream.end_capture()
    seconds = event_time(lambda i: graph.launch(stream), reps, warmup, stream) / len(calls)
    if own:  # the stream ends with this call: so does what the calls cached for it (split-K workspace, side stream)
        from .layer import take_stream_scratch
        take_stream_scratch(stream)
    return seconds


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (the traffic floor's
    denominator)."""
    cp = require_gpu("timing")
    src = cp.ones(nbytes, cp.uint8)
    dst = cp.empty_like(src)
    seconds = event_time(lambda i: cp.copyto(dst, src), reps=20)
    return 2 * src.nbytes / seconds


def matmul_rate(size: int = 8192) -> float:
    """Dense fp16 matmul rate in FLOP/s of a size^3 product through CuPy (cuBLAS), the FLOP floor's denominator."""
    cp = require_gpu("timing")
    a = cp.random.standard_normal((size, size)).astype(cp.float16)
    b = cp.random.standard_normal((size, size)).astype(cp.float16)
    seconds = event_time(lambda i: cp.matmul(a, b), reps=10)
    return 2 * size**3 / seconds


def roofline_target(m: int, traffic_floor: float, flop_floor: float) -> float | None:
    """The time (seconds) a GEMM phase of M tokens should take at most, from its two floors (the bytes it must move
    at the copy bandwidth, its FLOPs at the matmul rate), or None where no target is set (64 < M < 128):
    M <= 64: traffic_floor / 0.85, or traffic_floor + 4 us where the floor is under 10 us; M >= 128:
    max(traffic_floor, flop_floor) / 0.70."""
    if m <= 64:
        return traffic_floor + 4e-6 if traffic_floor < 10e-6 else traffic_floor / 0.85
    if m >= 128:
        return max(traffic_floor, flop_floor) / 0.70
    return None


# The regimes a GEMM table is summarised by: (name, largest M), each from the previous one's largest M + 1 (the last
# has no bound), split where the targets change.
REGIMES = (("M = 1", 1), ("1 < M <= 64", 64), ("64 < M <= 512", 512), ("M > 512", None))


def regime_summary(rows) -> list[str]:
    """One line per regime of benchmark rows (dicts with "m", "roofline_ratio" and, when judged, "pass"): how many
    rows, the fraction of the roofline reached (min / geometric mean / max) and how many meet their target."""
    lines, lo = [], 1
    for name, hi in REGIMES:
        sel = [r for r in rows if r["m"] >= lo and (hi is None or r["m"] <= hi)]
        lo = hi + 1 if hi is not None else lo
        if not sel:
            continue
        roof = np.array([r["roofline_ratio"] for r in sel], dtype=np.float64)
        line = (f"{name}: {len(sel)} rows, roofline {roof.min():.2f} / {np.exp(np.log(roof).mean()):.2f} / "
                f"{roof.max():.2f} (min / geometric mean / max)")
        if all("pass" in r for r in sel):
            line += f", {sum(bool(r['pass']) for r in sel)} meet the target"
        lines.append(line)
    return lines


def layer_target(phase_floors: float) -> float:
    """The time (seconds) a whole layer in a CUDA graph should take at most: the sum of its two GEMM phases' floors
    (roofline of each) over 0.70, plus 3 us for the launches between them."""
    return phase_floors / 0.70 + 3e-6
