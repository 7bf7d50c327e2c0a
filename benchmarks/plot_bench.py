"""Plot a bench_gemm.py --json result: achieved TB/s and TFLOP/s over M per model, against the floors.

    python benchmarks/plot_bench.py bench.json docs/performance.png
The dashed lines are the ceilings measured in the same run (device copy bandwidth, cupy.matmul fp16 rate).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for model in models:
        for phase, style in (("gate_up", "-"), ("down", ":")):
            sel = sorted((r for r in rows if r["model"] == model and r["phase"] == phase), key=lambda r: r["m"])
            if not sel:
                continue
            ms = [r["m"] for r in sel]
            label = f"{model} {phase}"
            line, = axes[0].plot(ms, [r["tbps"] for r in sel], style, marker="o", ms=3, label=label)
            axes[1].plot(ms, [r["tflops"] for r in sel], style, marker="o", ms=3, color=line.get_color(), label=label)
    axes[0].axhline(data["copy_bw"] / 1e12, color="k", ls="--", lw=1, label="copy bandwidth (floor)")
    axes[1].axhline(data["mm_rate"] / 1e12, color="k", ls="--", lw=1, label="cupy.matmul fp16 rate")
    for ax, unit in ((axes[0], "achieved TB/s (weights + activations)"), (axes[1], "achieved TFLOP/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"fused GPTQ MoE GEMM, one phase, {data['gpu']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
