"""Plot a bench_gemm.py --json result over M, one panel per model: the fraction of the traffic floor (floor time /
our time, solid) and of the matmul rate (achieved TFLOP/s / cupy.matmul fp16 rate, dashed) for both phases, with the
issue-6 targets (0.85 of the traffic floor at decode, 0.70 of the matmul rate at prefill) as dotted lines.

    python benchmarks/plot_bench.py bench.json docs/performance.png
Both ceilings were measured in the same run (device copy bandwidth, cupy.matmul fp16 at 8192^3).
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASE_COLORS = {"gate_up": "tab:blue", "down": "tab:orange"}


def main(src, dst):
    data = json.load(open(src))
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(4, len(models))
    nrows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.9 * nrows), sharex=True, sharey=True,
                             squeeze=False)
    for ax, model in zip(axes.flat, models):
        for phase, color in PHASE_COLORS.items():
            sel = sorted((r for r in rows if r["model"] == model and r["phase"] == phase), key=lambda r: r["m"])
            if not sel:
                continue
            ms = [r["m"] for r in sel]
            ax.plot(ms, [r["floor_ratio"] for r in sel], "-", color=color, marker="o", ms=3,
                    label=f"{phase}: traffic floor / time")
            ax.plot(ms, [r["flop_ratio"] for r in sel], "--", color=color, marker="s", ms=3,
                    label=f"{phase}: TFLOP/s / matmul rate")
        ax.axhline(0.85, color="k", ls=":", lw=0.8)
        ax.axhline(0.70, color="gray", ls=":", lw=0.8)
        ax.set_title(model, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("tokens M")
    for ax in axes[:, 0]:
        ax.set_ylabel("fraction of the ceiling")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"fused GPTQ MoE GEMM, one phase, {data['gpu']}: copy {data['copy_bw'] / 1e12:.2f} TB/s, "
                 f"matmul {data['mm_rate'] / 1e12:.0f} TFLOP/s; dotted: targets 0.85 (decode) and 0.70 (prefill)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
