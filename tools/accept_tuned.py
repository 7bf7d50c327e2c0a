"""Fold a fresh `python -m cupy_moe tune` table into a shipped one, keeping only the entries that won a same-run race.

    python tools/accept_tuned.py merge TUNED DIR
    python tools/accept_tuned.py accept TUNED COMPARE_JSON DIR [--below 0.97] [--bits 4] [--group-size 128]

TUNED is the file `tune` wrote (run it with CUPY_MOE_CACHE_DIR pointing at an empty folder, so that the file holds
only what it measured); DIR is a folder of tables, such as cupy_moe/configs/tuned/ of a checkout. Either command
merges entries of TUNED into DIR's table of the same GPU (`configs.save_tuned`: a new entry replaces the old one of
its key, the others stay).

- `merge` adds every entry, to the tables of a second checkout: the candidate.
- `accept` reads what `tools/compare_versions.py OTHER --rows gemm --json COMPARE_JSON` wrote, run from the candidate
  checkout against one with the shipped table, and adds the entries whose row (model, phase, M) ran another
  configuration and took less than --below of the shipped table's time. Each GEMM row is printed with both
  configurations, both times and the verdict.

The tuner times every candidate once, a few replays each; the race repeats only the winners, interleaved with the
configurations they would replace, so that the table keeps an entry where it was faster beyond the noise of one run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cupy_moe.configs.tuned import read_table, save_tuned, tuning_key
from cupy_moe.models import get_model


def row_key(row: dict, bits: int, group_size: int) -> str:
    """The tuning key of a compare_versions GEMM row: both phases take M * top_k pairs."""
    model = get_model(row["model"])
    k, n, _ = model.phases()[row["phase"]]
    return tuning_key(model.num_experts, k, n, bits, group_size, row["m"] * model.top_k)


def accepted(rows: list, tuned: dict, below: float, bits: int, group_size: int) -> dict:
    """{key: entry} of the tuned entries whose row ran another configuration and took < below of the time."""
    kept = {}
    for row in (r for r in rows if r["phase"] in ("gate_up", "down")):
        key = row_key(row, bits, group_size)
        ratio = row["this_us"] / row["other_us"]
        keep = key in tuned and row["this_config"] != row["other_config"] and ratio < below
        print(f"{row['model']:18s} {row['phase']:7s} {row['m']:6d} {row['other_config']:>12s} -> "
              f"{row['this_config']:>12s} {row['other_us']:9.1f} {row['this_us']:9.1f} us {ratio:6.3f} "
              f"{'keep ' + key if keep else '-'}")
        if keep:
            kept[key] = tuned[key]
    return kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="add every tuned entry to DIR's table (the candidate)")
    accept = sub.add_parser("accept", help="add the tuned entries that won the race to DIR's table")
    for p in (merge, accept):
        p.add_argument("tuned", type=Path, help="the table `python -m cupy_moe tune` wrote")
    accept.add_argument("compare", type=Path, help="the --json file of tools/compare_versions.py")
    for p in (merge, accept):
        p.add_argument("dir", type=Path, help="the folder of the table to change")
    accept.add_argument("--below", type=float, default=0.97,
                        help="keep an entry whose row took less than this fraction of the time (default 0.97)")
    accept.add_argument("--bits", type=int, choices=[4, 8], default=4, help="the race's weight bits (default 4)")
    accept.add_argument("--group-size", type=int, default=128, help="the race's group size (default 128)")
    args = ap.parse_args(argv)
    gpu = json.loads(args.tuned.read_text()).get("gpu")
    tuned = read_table(args.tuned, gpu)
    if not tuned:
        raise SystemExit(f"accept_tuned: {args.tuned}: expected a tuned table with entries")
    if args.command == "accept":
        tuned = accepted(json.loads(args.compare.read_text()), tuned, args.below, args.bits, args.group_size)
    path = save_tuned(gpu, tuned, args.dir)
    print(f"# {path}: {len(tuned)} entries added or replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
