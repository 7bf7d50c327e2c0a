"""`python -m cupy_moe tune`: time the GEMM configurations on this GPU and keep the fastest.

For each model shape (configs.MODEL_SHAPES), phase and token count M, every supported block_m and every split-K
factor the kernel allows are timed on random 4-bit weights: one CUDA graph of 4 calls over different routings,
replayed `reps` times, median per call (so Python's launch overhead and L2 residency stay out); the winner goes
into the tuned-config cache (`configs.tuned_cache_path()`), which `choose_config` reads from then on. Only the
speed changes: every configuration passes the same accuracy tests, and each is deterministic (split-K sums in a fixed
order), though two configurations may round differently.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from . import configs
from ._xp import require_gpu
from .align import moe_align_block_size
from .gemm import fused_moe_gemm
from .weights import StackedGptqWeight

__all__ = ["tune"]

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
ROTATIONS = 4


def _random_weight(cp, e, k, n, bits, group_size, seed):
    rs = cp.random.RandomState(seed)
    groups = -(-k // (k if group_size == -1 else group_size))
    qweight = rs.randint(-2**31, 2**31 - 1, size=(e, k * bits // 32, n), dtype=cp.int32)
    scales = (rs.uniform(0.5, 1.5, size=(e, groups, n)) / (2**bits * math.sqrt(k))).astype(cp.float16)
    qzeros = rs.randint(-2**31, 2**31 - 1, size=(e, groups, n * bits // 32), dtype=cp.int32)
    return StackedGptqWeight(qweight, scales, qzeros, None, bits=bits, group_size=group_size)


def _label(cfg):
    """'16k S=1': GemmConfig.short_name and split-K CTAs."""
    return f"{cfg.short_name} S={cfg.split_k}"


def _graph_time(cp, stream, calls, reps):
    """Median GPU seconds per call of `calls` (zero-argument launches), captured once in a CUDA graph and replayed:
    Python's launch overhead stays out, as in benchmarks/bench_gemm.py."""
    with stream:
        for call in calls:  # warm-up: compiles the instance and sizes this stream's split-K workspace
            call()
        stream.synchronize()
        stream.begin_capture()
        try:
            for call in calls:
                call()
        finally:
            graph = stream.end_capture()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(reps):
        start.record(stream)
        graph.launch(stream=stream)
        stop.record(stream)
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3 / len(calls))
    return float(np.median(samples))


def tune(models=None, ms=(1, 4, 16, 64, 256, 1024, 4096), *, bits=4, group_size=128, reps=10, save=True,
         log=print) -> dict:
    """Measure and (when `save`) store the fastest configuration of every (model, phase, M) asked for.

    models: names of configs.MODEL_SHAPES (default all). ms: token counts M >= 1. reps: graph replays per
    candidate. Returns {tuning_key: entry}.
    """
    bad = [m for m in ms if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1]
    if bad:
        raise ValueError(f"ms: expected token counts M >= 1, got {bad}")
    cp = require_gpu("python -m cupy_moe tune")
    gpu = configs._device_name()
    table = configs.tuned_table(gpu)
    rng = np.random.default_rng(0)
    found = {}
    stream = cp.cuda.Stream(non_blocking=True)
    for model in models or configs.MODEL_SHAPES:
        if model not in configs.MODEL_SHAPES:
            raise ValueError(f"models: expected names from {sorted(configs.MODEL_SHAPES)}, got {model!r}")
        h, inter, e, a = configs.MODEL_SHAPES[model]
        for phase, k, n in (("gate_up", h, 2 * inter), ("down", inter, h)):
            weight = _random_weight(cp, e, k, n, bits, group_size, seed=len(found))
            for m in ms:
                rows, top_k = (m, a) if phase == "gate_up" else (m * a, 1)
                # several routings per timing, so that L2 does not keep one routing's experts between calls
                routings = [cp.asarray(np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32))
                            for _ in range(ROTATIONS)]
                x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float16))
                out = cp.empty((m * a, n), cp.float16)
                key = configs.tuning_key(e, k, n, bits, group_size, m * a)
                table.pop(key, None)
                with warnings.catch_warnings():  # the "no tuned config" note is expected here
                    warnings.simplefilter("ignore")
                    heuristic = configs.choose_config(rows, e, top_k, k, n, bits, group_size)
                candidates = {(heuristic.block_m, heuristic.split_k)}
                for block_m in configs.SUPPORTED_BLOCK_M:
                    max_split = configs.max_split_k(k, configs.KERNEL_SHAPES[block_m].ku)
                    candidates.update((block_m, s) for s in SPLITS if s <= max_split)
                # a stored (block_m, split_k) runs what choose_config makes of it (16-row splits of 2-4, say, all run
                # one warps-along-K shape): each configuration is timed once, under the first entry that gives it
                runs = {}
                for block_m, split in sorted(candidates):
                    table[key] = {"block_m": block_m, "split_k": split}  # choose_config now returns it
                    runs.setdefault(configs.choose_config(rows, e, top_k, k, n, bits, group_size), (block_m, split))
                timings = {}
                for cfg, (block_m, split) in runs.items():
                    aligned = [moe_align_block_size(ids, block_m, e) for ids in routings]
                    pair = phase == "down" and configs.down_pair_order(bits, block_m)  # as fused_moe's act
                    calls = [lambda al=al: fused_moe_gemm(x, weight, *al, top_k, out=out, a_pair_order=pair)
                             for al in aligned]
                    table[key] = {"block_m": block_m, "split_k": split}
                    timings[cfg] = _graph_time(cp, stream, calls, reps)
                del table[key]
                best_cfg, best = min(timings.items(), key=lambda kv: kv[1])
                block_m, split = runs[best_cfg]
                base = timings.get(heuristic, float("nan"))
                found[key] = {"block_m": block_m, "split_k": split, "time_us": round(best * 1e6, 2)}
                per_block = {}  # the fastest configuration of each block_m
                for cfg, t in sorted(timings.items(), key=lambda kv: kv[1]):
                    per_block.setdefault(cfg.block_m, f"{_label(cfg)}: {t * 1e6:.1f}")
                log(f"{model:18s} {phase:7s} M={m:5d}  best {_label(best_cfg)} (block_m={block_m:3d} "
                    f"split_k={split:2d}) {best * 1e6:9.1f} us; the heuristic's {_label(heuristic)} {base * 1e6:9.1f} "
                    f"us; per block_m: {', '.join(per_block[bm] for bm in sorted(per_block))}")
            cp.get_default_memory_pool().free_all_blocks()
    if save and found:
        log(f"saved {len(found)} configurations for {gpu} to {configs.save_tuned(gpu, found)}")
    return found
