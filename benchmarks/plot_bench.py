"""Plot a bench_gemm.py --json result: the fraction of the roofline reached over M, one panel per model.

    python benchmarks/plot_bench.py bench.json docs/performance.png

Roofline of a row = max(traffic floor, FLOP floor), both measured in the benchmark's own run: the traffic floor is
the row's bytes over the device copy bandwidth, the FLOP floor its 2*P*K*N FLOPs over the cupy.matmul fp16 rate
(`cupy_moe.timing`). The plotted fraction is roofline / time (1.0: as fast as the floors allow). A row gives its
floors as `traffic_floor_us` and `flop_floor_us`, or as ratios to its time (`floor_ratio`, `flop_ratio`); either set
is read. Panels follow the order of `cupy_moe.models`; one line per GEMM phase.
"""
from __future__ import annotations

import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cupy_moe.models import MODELS  # noqa: E402

PHASE_COLORS = {"gate_up": "tab:blue", "down": "tab:orange"}


def _floor_us(row: dict, us_key: str, ratio_key: str) -> float:
    if row.get(us_key) is not None:
        return float(row[us_key])
    if row.get(ratio_key) is not None:
        return float(row[ratio_key]) * float(row["time_us"])
    raise ValueError(f"row {row.get('model')} {row.get('phase')} M={row.get('m')}: expected {us_key!r} or "
                     f"{ratio_key!r}, got keys {sorted(row)}")


def roofline_fraction(row: dict) -> float:
    """max(traffic floor, FLOP floor) / time of one benchmark row."""
    traffic = _floor_us(row, "traffic_floor_us", "floor_ratio")
    flops = _floor_us(row, "flop_floor_us", "flop_ratio")
    return max(traffic, flops) / float(row["time_us"])


def _model_order(names):
    known = {name.lower(): i for i, name in enumerate(MODELS)}
    return sorted(dict.fromkeys(names), key=lambda n: (known.get(n.lower(), len(known)), n))


def main(src, dst):
    with open(src) as fh:
        data = json.load(fh)
    rows = data["rows"]
    models = _model_order(r["model"] for r in rows)
    cols = min(4, len(models))
    nrows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.9 * nrows), sharex=True, sharey=True,
                             squeeze=False)
    for ax, model in zip(axes.flat, models):
        for phase, color in PHASE_COLORS.items():
            sel = sorted((r for r in rows if r["model"] == model and r["phase"] == phase), key=lambda r: r["m"])
            if sel:
                ax.plot([r["m"] for r in sel], [roofline_fraction(r) for r in sel], "-", color=color, marker="o",
                        ms=3, label=phase)
        ax.set_title(model, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("tokens M")
    for ax in axes[:, 0]:
        ax.set_ylabel("roofline / time")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(PHASE_COLORS), fontsize=8)
    measured = []
    if data.get("copy_bw"):
        measured.append(f"copy {data['copy_bw'] / 1e12:.2f} TB/s")
    if data.get("mm_rate"):
        measured.append(f"matmul {data['mm_rate'] / 1e12:.0f} TFLOP/s")
    fig.suptitle(f"fused GPTQ MoE GEMM, one phase, {data.get('gpu', 'GPU')}"
                 + (f" ({', '.join(measured)})" if measured else "")
                 + ": fraction of max(traffic floor, FLOP floor)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/plot_bench.py BENCH_JSON OUT_PNG")
    main(sys.argv[1], sys.argv[2])
