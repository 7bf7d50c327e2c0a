"""Two or more versions of cupy_moe side by side in one process: per row, the checksum of each version's output and
each version's time, so that a refactor can be shown to keep results bitwise and speed within noise.

    python tools/compare_versions.py OTHER_CHECKOUT [OTHER_CHECKOUT ...] [--models ...] [--m 1,16,64,256,1024,4096]
                                     [--rows gemm,layer] [--rounds R] [--reps N] [--bits 4|8]
                                     [--dtype float16|bfloat16] [--json FILE]

OTHER_CHECKOUT is the root of another checkout of the repository (e.g. `git worktree add /tmp/old <commit>`); its
package is imported as a second module next to this checkout's `cupy_moe`. Several other checkouts (variants of one
change, say) are timed in the same rounds, the first as "other" and the next ones as "other2", "other3", ...; each
row prints their times and this/otherN after the first pair's columns. Rows are (model, phase, M) as in
benchmarks/bench_gemm.py, on random weights (4-bit unless --bits 8; G = 128, real zero points) and fp16 activations
(--dtype bfloat16: bf16), with the routing of each version's own choice (one pair per block where fused_moe runs it
so: M = 1, and a few tokens of small experts where the version has `configs.one_pair_blocks`; 4-bit down on 16-row
blocks: pair-ordered activations), and whole-layer rows (`fused_moe`, its own choices, timed the same way) at a few M.
`--rows` picks which: `gemm` and `layer` by default; `moe_layer` adds, for the models with shared experts and at every
M, a whole `MoELayer` (routing, routed and shared experts; Qwen2-MoE's shared expert gated), whose router and shared
weights come in 4 copies used in turn so that they are not read from L2. Both versions see the same inputs; each runs
only its public API (`choose_config` for the block size, `moe_align_block_size`, `fused_moe_gemm`, `fused_moe`,
`MoELayer`), so any two versions since the tile choice took its present signature can be compared. Times are graph
replays (cupy_moe.timing), the two versions interleaved row by row; with --rounds R each version is timed R times per
row in alternating order and the median counts. Exit status 1 when a checksum differs. The same checkout on both sides
tests the method, and rows of milliseconds need it (H100, two to four rounds): there the same code timed up to 10%
apart (Mixtral-8x22B down M = 4096, 3396 against 3756 us), and DeepSeek-V3 gate/up at M = 1024 (16-row blocks, 3 ms a
call) timed 5-9% faster as "this" in all five runs with the default 10 replays per timing, whichever checkout took
which side, and within 1.5% in both runs with --reps 30. A version's own tuned tables (cupy_moe/configs/tuned/, the
user's cache) steer its choices: to compare two versions on the same configurations where only one ships a table for
this GPU, move that table aside for the run.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

import cupy_moe
from cupy_moe.models import BENCHMARK_MODELS, get_model
from cupy_moe.timing import graph_time, random_activations

# 8 routings per row, as the benchmark: with 4, a small-expert decode row touches about the L2's size in weights
# (Qwen1.5-MoE-A2.7B gate/up at M = 1: 16 experts, 46 MB), and whether they stay in L2 between replays flipped
# between the two versions of one run (7.6 against 9.0 us, the same kernel)
G, ROTATIONS = 128, 8
LAYER_MS = (1, 2, 4, 8, 64, 256)


def import_other(root: Path, name: str = "cupy_moe_other"):
    """The package of another checkout as module `name` (its kernels come from its own kernels/)."""
    init = root / "cupy_moe" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"compare_versions: {root} has no cupy_moe/__init__.py (expected a checkout's root)")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def same_weight(pkg, weight):
    """`weight` (this checkout's StackedGptqWeight) as package `pkg`'s own StackedGptqWeight, sharing the arrays."""
    return pkg.StackedGptqWeight(weight.qweight, weight.scales, weight.qzeros, None, bits=weight.bits,
                                 group_size=weight.group_size)


def digest(cp, x) -> str:
    return hashlib.sha1(cp.asnumpy(x).tobytes()).hexdigest()[:16]


def one_pair(pkg, m, a, expert_bytes):
    """Whether version `pkg`'s fused_moe runs M tokens with one pair per block (before its one_pair_blocks: M = 1)."""
    rule = getattr(pkg.configs, "one_pair_blocks", None)
    return rule(m, a, expert_bytes) if rule is not None else m == 1


def config_label(cfg) -> str:
    """'block_m/split_k/kind', block_m marked 'k' where warps split K: one label per tuned-table entry (block_m,
    split_k, warps_k), which accept_tuned.py compares (a checkout from before warps_k has none)."""
    k = "k" if getattr(cfg, "warps_k", 1) > 1 else ""
    return f"{cfg.block_m}{k}/{cfg.split_k}/{cfg.kind}"


def phase_calls(cp, pkg, weight, sets, phase, m, e, a, k, n, single):
    """(label of the configuration, one zero-argument call per input set, their outputs) for one version; single:
    one pair per block."""
    rows, top_k = (m, a) if phase == "gate_up" else (m * a, 1)
    cfg = pkg.configs.choose_config(rows, e, top_k, k, n, weight.bits, G, **({"one_pair": True} if single else {}))
    pair = phase == "down" and pkg.configs.down_pair_order(weight.bits, cfg.block_m)
    calls, outs = [], []
    for ids, tw, x, act in sets:
        src, pair_ids, weights = (x, ids, None) if phase == "gate_up" else (act, ids.reshape(-1, 1), tw)
        aligned = ((None, cp.ascontiguousarray(pair_ids), None) if single
                   else pkg.moe_align_block_size(pair_ids, cfg.block_m, e))
        out = cp.zeros((m * a, n), src.dtype)
        calls.append(lambda src=src, al=aligned, w=weights, o=out: pkg.fused_moe_gemm(
            src, weight, *al, top_k, topk_weights=w, out=o, a_pair_order=pair))
        outs.append(out)
    return config_label(cfg), calls, outs


def moe_layer_calls(pkg, model, w13, w2, copies, xs):
    """One zero-argument call per input of `xs` for package `pkg`: a MoELayer of the model's shape on the routed
    weights w13, w2 (pkg's own) and the router and shared weights of `copies` in turn."""
    ckpt = importlib.import_module(pkg.__name__ + ".checkpoint")
    layers = [pkg.MoELayer(ckpt.MoELayerWeights(
        family=model.family, layer=0, hidden_size=model.hidden, intermediate_size=model.intermediate,
        num_experts=model.num_experts, w13=w13, w2=w2, router_weight=c["router"], top_k=model.top_k,
        renormalize=False, shared_gate_weight=c["gate"],
        shared=ckpt.SharedExpertWeights(same_weight(pkg, c["gate_up"]), same_weight(pkg, c["down"]),
                                        model.shared_intermediate))) for c in copies]
    return [lambda layer=layers[k % len(layers)], x=x: layer(x) for k, x in enumerate(xs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, nargs="+", help="root of the other checkout (several: each one timed)")
    ap.add_argument("--models", default=",".join(BENCHMARK_MODELS))
    ap.add_argument("--m", default="1,16,64,256,1024,4096")
    ap.add_argument("--rows", default="gemm,layer", help="comma-separated: gemm, layer, moe_layer")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per timing")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timings per version and row, the order of the two versions alternating; the row's time "
                         "is each version's median (drift and the order of the two cancel)")
    ap.add_argument("--bits", type=int, choices=[4, 8], default=4, help="weight bits (default 4)")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                    help="activations and outputs (bfloat16 needs ml_dtypes)")
    ap.add_argument("--json", type=Path, help="write the rows here (after every row)")
    args = ap.parse_args(argv)
    import cupy as cp
    dtype = np.float16
    if args.dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    versions = {"this": cupy_moe}
    for i, root in enumerate(args.other, 1):
        label = "other" if i == 1 else f"other{i}"
        versions[label] = import_other(root.resolve(), f"cupy_moe_{label}")
    kinds = set(args.rows.split(","))
    if not kinds <= {"gemm", "layer", "moe_layer"}:
        raise SystemExit(f"compare_versions: --rows: expected some of gemm, layer, moe_layer, got {args.rows}")
    results = []
    print(f"{'model':18s} {'phase':7s} {'M':>5s} {'this cfg':>12s} {'other cfg':>12s} {'this us':>9s} "
          f"{'other us':>9s} {'ratio':>6s}  checksum")
    for model in (get_model(name) for name in args.models.split(",")):
        h, inter, e, a = model.hidden, model.intermediate, model.num_experts, model.top_k
        phases = model.phases()
        drawn = {ph: cupy_moe.StackedGptqWeight.random(e, k, n, bits=args.bits, group_size=G, seed=seed)
                 for seed, (ph, (k, n, _)) in enumerate(phases.items(), 1)}
        weights = {ph: {v: same_weight(pkg, w) for v, pkg in versions.items()} for ph, w in drawn.items()}
        copies = []
        if "moe_layer" in kinds and model.shared_intermediate:
            s_i, rs, draw = model.shared_intermediate, cp.random.RandomState(5), cupy_moe.StackedGptqWeight.random
            copies = [dict(router=(0.05 * rs.standard_normal((e, h))).astype(cp.float32),
                           gate=(0.05 * rs.standard_normal((1, h))).astype(cp.float32)
                           if model.family == "qwen2_moe" else None,
                           gate_up=draw(1, h, 2 * s_i, bits=args.bits, group_size=G, seed=10 + c),
                           down=draw(1, s_i, h, bits=args.bits, group_size=G, seed=20 + c))
                      for c in range(4)]
        for m in (int(v) for v in args.m.split(",")):
            seed = 7 * m + len(model.name)
            rng = np.random.default_rng(seed)
            sets = [(cp.asarray(np.stack([rng.permutation(e)[:a] for _ in range(m)]).astype(np.int32)),
                     cp.asarray(rng.random((m, a)).astype(np.float32)),
                     random_activations((m, h), dtype, seed=2 * (seed + r)),
                     random_activations((m * a, inter), dtype, seed=2 * (seed + r) + 1, scale=0.5))
                    for r in range(ROTATIONS)]
            for phase, (k, n, _) in phases.items() if "gemm" in kinds else ():
                row, timed = dict(model=model.name, phase=phase, m=m), {}
                for v, pkg in versions.items():
                    single = one_pair(pkg, m, a, model.expert_nbytes(args.bits, G))
                    label, timed[v], outs = phase_calls(cp, pkg, weights[phase][v], sets, phase, m, e, a, k, n,
                                                        single)
                    timed[v][0]()
                    row[f"{v}_config"], row[f"{v}_checksum"] = label, digest(cp, outs[0])
                results.append(report(time_rounds(row, timed, args)))
                save(args.json, results)
            if "layer" in kinds and m in LAYER_MS:
                row, timed = dict(model=model.name, phase="layer", m=m), {}
                for v, pkg in versions.items():
                    timed[v] = [lambda f=pkg.fused_moe, w13=weights["gate_up"][v], w2=weights["down"][v], s=s:
                                f(s[2], w13, w2, s[1], s[0]) for s in sets]
                    row[f"{v}_checksum"] = digest(cp, timed[v][0]())
                results.append(report(time_rounds(row, timed, args)))
                save(args.json, results)
            if copies:
                row, timed = dict(model=model.name, phase="MoELayer", m=m), {}
                for v, pkg in versions.items():
                    timed[v] = moe_layer_calls(pkg, model, weights["gate_up"][v], weights["down"][v], copies,
                                               [s[2] for s in sets])
                    row[f"{v}_checksum"] = digest(cp, timed[v][0]())
                results.append(report(time_rounds(row, timed, args)))
                save(args.json, results)
        del weights, drawn, copies
        cp.get_default_memory_pool().free_all_blocks()
    same = sum(identical(r) for r in results)
    print(f"# checksums: {same}/{len(results)} rows identical")
    for kind, rows in (("GEMM", [r for r in results if r["phase"] in ("gate_up", "down")]),
                       ("layer", [r for r in results if r["phase"] == "layer"]),
                       ("MoELayer", [r for r in results if r["phase"] == "MoELayer"])):
        for v in list(versions)[1:]:
            ratios = np.array([r["this_us"] / r[f"{v}_us"] for r in rows])
            if ratios.size:
                print(f"# time this/{v} over {ratios.size} {kind} rows: median {np.median(ratios):.3f}, "
                      f"min {ratios.min():.3f}, max {ratios.max():.3f}")
    return 0 if same == len(results) else 1


def save(path, results) -> None:
    """Write the rows so far (after every row: a run stopped part of the way keeps what it timed)."""
    if path:
        path.write_text(json.dumps(results, indent=1))


def time_rounds(row: dict, timed: dict, args) -> dict:
    """Each version's median time (us) over args.rounds graph timings of its calls, in the order of `timed` in even
    rounds and the reverse order in odd ones."""
    times = {v: [] for v in timed}
    for r in range(args.rounds):
        for v in (list(timed) if r % 2 == 0 else list(timed)[::-1]):
            times[v].append(graph_time(timed[v], reps=args.reps) * 1e6)
    row.update({f"{v}_us": float(np.median(t)) for v, t in times.items()})
    return row


def identical(row: dict) -> bool:
    """Whether every version's output has this checkout's checksum."""
    return all(row[key] == row["this_checksum"] for key in row if key.endswith("_checksum"))


def report(row: dict) -> dict:
    mark = "same" if identical(row) else "DIFFERENT"
    times = (f"{row.get('this_config', ''):>12s} {row.get('other_config', ''):>12s} {row['this_us']:9.1f} "
             f"{row['other_us']:9.1f} {row['this_us'] / row['other_us']:6.3f}" if "this_us" in row else " " * 53)
    more = "".join(f"  {key[:-3]} {row.get(key[:-3] + '_config', '')} {row[key]:.1f} {row['this_us'] / row[key]:.3f}"
                   for key in row if key.startswith("other") and key.endswith("_us") and key != "other_us")
    print(f"{row['model']:18s} {row['phase']:7s} {row['m']:5d} {times}  {mark} {row['this_checksum']}{more}",
          flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
