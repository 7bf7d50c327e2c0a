"""Fold a fresh `python -m cupy_moe tune` table into a shipped one, keeping only the entries that won a same-run race.

    python tools/accept_tuned.py merge SHIPPED TUNED OUT
    python tools/accept_tuned.py accept SHIPPED TUNED COMPARE_JSON OUT [--below 0.97] [--bits 4] [--group-size 128]

SHIPPED is a table of cupy_moe/configs/tuned/, TUNED the file `tune` wrote for the same GPU (run it with
CUPY_MOE_CACHE_DIR pointing at an empty folder, so that the file holds only what it measured).

- `merge` writes SHIPPED with every entry of TUNED in it, for a second checkout whose package ships OUT in place of
  SHIPPED: the candidate.
- `accept` reads what `tools/compare_versions.py OTHER --rows gemm --json COMPARE_JSON` wrote, run from the candidate
  checkout against one with the shipped table, and writes SHIPPED plus the entries of TUNED whose row (model, phase,
  M) ran another configuration and took less than --below of the shipped table's time. Each GEMM row is printed with
  both configurations, both times and the verdict.

The tuner times every candidate once, a few replays each; the race repeats only the winners, interleaved with the
configurations they would replace, so that the table keeps an entry where it was faster beyond the noise of one run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cupy_moe.configs import tuning_key
from cupy_moe.models import get_model


def read(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise SystemExit(f"accept_tuned: {path}: expected a tuned table {{\"gpu\": ..., \"entries\": {{...}}}}")
    return data


def write(path: Path, shipped: dict, entries: dict) -> None:
    """`shipped` with `entries` in place, in the shipped tables' layout (one-space indent, sorted keys)."""
    out = dict(shipped, entries={**shipped["entries"], **entries})
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


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
    merge = sub.add_parser("merge", help="SHIPPED with every tuned entry (the candidate table)")
    accept = sub.add_parser("accept", help="SHIPPED with the tuned entries that won the race")
    for p in (merge, accept):
        p.add_argument("shipped", type=Path)
        p.add_argument("tuned", type=Path)
    accept.add_argument("compare", type=Path, help="the --json file of tools/compare_versions.py")
    for p in (merge, accept):
        p.add_argument("out", type=Path)
    accept.add_argument("--below", type=float, default=0.97,
                        help="keep an entry whose row took less than this fraction of the time (default 0.97)")
    accept.add_argument("--bits", type=int, choices=[4, 8], default=4, help="the race's weight bits (default 4)")
    accept.add_argument("--group-size", type=int, default=128, help="the race's group size (default 128)")
    args = ap.parse_args(argv)
    shipped, tuned = read(args.shipped), read(args.tuned)
    if shipped.get("gpu") != tuned.get("gpu"):
        raise SystemExit(f"accept_tuned: the tables are of different GPUs: {shipped.get('gpu')!r} and "
                         f"{tuned.get('gpu')!r}")
    if args.command == "merge":
        write(args.out, shipped, tuned["entries"])
        print(f"# {args.out}: {len(tuned['entries'])} tuned entries over {len(shipped['entries'])} shipped")
        return 0
    kept = accepted(json.loads(args.compare.read_text()), tuned["entries"], args.below, args.bits, args.group_size)
    write(args.out, shipped, kept)
    print(f"# {args.out}: kept {len(kept)} of {len(tuned['entries'])} tuned entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
