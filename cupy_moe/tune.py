"""`python -m cupy_moe tune`: time the GEMM configurations on this GPU and keep the fastest.

For each model shape (`cupy_moe.models`), phase and token count M, every supported block_m is timed at the split-K
factors of SPLITS that its shape allows and at the rules' own split, on random weights: `cupy_moe.timing.graph_time`
over calls on ROTATIONS routings and, where the weights are small, on up to 4 copies of them in turn
(`timing.weight_copies`), so that Python's launch overhead and L2 residency stay out. Each candidate is the
configuration `choose_config` makes of a (block_m, split_k) pair, passed to `fused_moe_gemm(..., config=)`; the
winners go into this GPU's tuned table in the user's cache (`configs.tuned`), which `choose_config` reads from then
on. Token counts that `fused_moe` runs with one pair per 16-row block and no aligned list (M = 1, and a few tokens of
small experts: `configs.one_pair_blocks`) are timed so (`choose_config(..., one_pair=True)`): their candidates are the
16-row shapes. The winners are saved after each model phase, so a run stopped part of the way keeps what it measured.
Only the speed changes: every configuration passes the same accuracy tests, and each is deterministic (split-K sums in
a fixed order), though two configurations may round differently. So that a fast wrong answer is never kept, each
candidate's result on one routing is compared with the heuristic configuration's: one that differs by more than AGREE
(relative L2) is logged as rejected and not kept.
"""
from __future__ import annotations


import numpy as np

from . import configs
from ._xp import require_gpu
from .align import moe_align_block_size
from .gemm import fused_moe_gemm
from .models import BENCHMARK_MODELS, get_model
from .reference import to_pair_order
from .timing import graph_time, random_activations, weight_copies
from .weights import StackedGptqWeight

__all__ = ["tune"]

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
ROTATIONS = 8  # routings per timing, each call on the next (and on the next weight copy: timing.weight_copies)
# two configurations differ only in where split-K partial sums meet, in float32 before the one rounding: far
# below this relative L2 distance, which a kernel that skips or garbles rows exceeds
AGREE = 1e-2


def _label(cfg):
    """'16k S=1': GemmConfig.short_name and split-K CTAs."""
    return f"{cfg.short_name} S={cfg.split_k}"


def tune(models=None, ms=(1, 4, 16, 64, 256, 1024, 4096), *, bits=4, group_size=128, reps=10, save=True,
         log=print) -> dict:
    """Measure and (when `save`) store the fastest configuration of every (model, phase, M) asked for.

    models: names of `cupy_moe.models.MODELS`, any case (default: BENCHMARK_MODELS). ms: token counts M >= 1.
    bits: 4 or 8; group_size: -1 or a positive multiple of 32. reps: graph replays per candidate.
    Returns {tuning_key: {"block_m", "split_k", "warps_k", "time_us"}}, the entries it saves to this GPU's table.
    """
    shapes = [get_model(name) for name in (BENCHMARK_MODELS if models is None else models)]
    bad = [m for m in ms if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1]
    if bad:
        raise ValueError(f"ms: expected token counts M >= 1, got {bad}")
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits!r}")
    if group_size != -1 and (not isinstance(group_size, int) or group_size < 32 or group_size % 32):
        raise ValueError(f"group_size: expected -1 or a positive multiple of 32, got {group_size!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps: expected a positive int, got {reps!r}")
    cp = require_gpu("python -m cupy_moe tune")
    gpu = configs.gpu_info()
    rng = np.random.default_rng(0)
    found, path = {}, None
    for shape in shapes:
        e, a = shape.num_experts, shape.top_k
        expert_bytes = shape.expert_nbytes(bits, group_size)
        for phase, (k, n, top_k) in shape.phases().items():
            draw = lambda c: StackedGptqWeight.random(e, k, n, bits=bits, group_size=group_size, seed=len(found) + c)
            weight = draw(0)
            weights = [weight] + [draw(c) for c in range(1, weight_copies(weight.nbytes))]
            phase_found = {}
            for m in ms:
                rows = m if phase == "gate_up" else m * a
                # several routings per timing, so that L2 does not keep one routing's experts between calls
                routings = [cp.asarray(np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32))
                            for _ in range(ROTATIONS)]
                x = random_activations((rows, k), np.float16, seed=len(found) + m)
                out = cp.empty((m * a, n), cp.float16)
                key = configs.tuning_key(e, k, n, bits, group_size, m * a)
                one_pair = configs.one_pair_blocks(m, a, expert_bytes)  # as fused_moe runs these M tokens

                def pair_list(ids, block_m):  # (sorted_token_ids, expert_ids, num_tokens_post_padded)
                    return (None, ids, None) if one_pair else moe_align_block_size(ids, block_m, e)
                heuristic = configs.choose_config(rows, e, top_k, k, n, bits, group_size, gpu=gpu, tuned=False,
                                                  one_pair=one_pair)
                # candidates: every block size's plain shape at every split, and the warps-along-K shape where the
                # block size has one (rule 4's alternative), each named by the (block_m, split_k, warps_k) entry
                # that gives it exactly; a configuration is timed once, under the first entry that gives it
                runs = {}
                for block_m in (heuristic.block_m,) if one_pair else configs.SUPPORTED_BLOCK_M:
                    pair = phase == "down" and configs.down_pair_order(bits, block_m)  # as fused_moe's act
                    most = configs.max_split_k(k, configs.KERNEL_SHAPES[block_m].ku)
                    unsplit = configs.choose_config(rows, e, top_k, k, n, bits, group_size, block_m, gpu=gpu,
                                                    pair_a=pair, split_k=1, one_pair=one_pair)
                    rule = configs.split_k_estimate(unsplit, rows, e, top_k, k, n, gpu=gpu,
                                                    one_pair=one_pair)  # the heuristic's split
                    named = [(split, 1) for split in sorted({s for s in SPLITS if s <= most} | {rule})]
                    named += [(1, wk) for wk in configs.warps_k_choices(block_m) if wk > 1]
                    for split, wk in named:
                        cfg = configs.choose_config(rows, e, top_k, k, n, bits, group_size, block_m, gpu=gpu,
                                                    pair_a=pair, split_k=split, warps_k=wk, one_pair=one_pair)
                        runs.setdefault(cfg, (block_m, split, wk, pair))
                # the same activations in pair order where a candidate reads them so: every candidate, one product
                xs = {False: x, True: to_pair_order(x) if any(pair for *_, pair in runs.values()) else None}

                def result(cfg, pair):  # one call on the first routing into a new zero-filled output, in float32
                    return fused_moe_gemm(xs[pair], weight, *pair_list(routings[0], cfg.block_m), top_k,
                                          a_pair_order=pair, config=cfg).astype(cp.float32)
                expected = result(heuristic, phase == "down" and configs.down_pair_order(bits, heuristic.block_m))
                scale = float(cp.linalg.norm(expected)) or 1.0
                timings, rejected = {}, []
                for cfg, (block_m, split, _, pair) in runs.items():
                    aligned = [pair_list(ids, block_m) for ids in routings]
                    calls = [lambda al=al, w=weights[i % len(weights)], cfg=cfg, pair=pair: fused_moe_gemm(
                        xs[pair], w, *al, top_k, out=out, a_pair_order=pair, config=cfg)
                             for i, al in enumerate(aligned)]
                    seconds = graph_time(calls, reps=reps)
                    error = float(cp.linalg.norm(result(cfg, pair) - expected)) / scale
                    if error <= AGREE:  # NaN is not
                        timings[cfg] = seconds
                    else:
                        rejected.append(f"{_label(cfg)} ({seconds * 1e6:.1f} us, off by {error:.1e})")
                if rejected:
                    log(f"{shape.name:18s} {phase:7s} M={m:5d}  rejected, results differ from the heuristic's "
                        f"{_label(heuristic)}: {', '.join(rejected)}")
                if not timings:
                    continue
                best_cfg, best = min(timings.items(), key=lambda kv: kv[1])
                block_m, split, wk, _ = runs[best_cfg]
                base = timings.get(heuristic, float("nan"))
                phase_found[key] = {"block_m": block_m, "split_k": split, "warps_k": wk,
                                    "time_us": round(best * 1e6, 2)}
                per_block = {}  # the fastest configuration of each block_m
                for cfg, t in sorted(timings.items(), key=lambda kv: kv[1]):
                    per_block.setdefault(cfg.block_m, f"{_label(cfg)}: {t * 1e6:.1f}")
                log(f"{shape.name:18s} {phase:7s} M={m:5d}  best {_label(best_cfg)} (block_m={block_m:3d} "
                    f"split_k={split:2d} warps_k={wk}) {best * 1e6:9.1f} us; the heuristic's {_label(heuristic)} "
                    f"{base * 1e6:9.1f} us; per block_m: {', '.join(per_block[bm] for bm in sorted(per_block))}")
            found.update(phase_found)
            if save and phase_found:  # after each phase: a run stopped later keeps what it measured
                path = configs.save_tuned(gpu.name, phase_found)
            cp.get_default_memory_pool().free_all_blocks()
    if path is not None:
        log(f"saved {len(found)} configurations for {gpu.name} to {path}")
    return found
