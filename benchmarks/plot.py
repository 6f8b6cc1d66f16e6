"""The harness's plot: output tokens/s and TTFT against concurrency, for each server.

    .venv/bin/python benchmarks/plot.py bench-results/harness.json docs/bench-harness.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STYLE = {  # name in the report: (label, colour)
    "mlx-troupe": ("mlx-troupe", "tab:blue"),
    "mlx-troupe@baseline": ("mlx-troupe (baseline)", "tab:green"),
    "mlx_lm.server": ("mlx_lm.server", "tab:orange"),
    "in-process": ("in-process ceiling", "tab:gray"),
}


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels side by side, from a harness report's medians; writes a small PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the harness runs headless
    import matplotlib.pyplot as plt

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    levels: set[int] = set()
    for name, (label, colour) in STYLE.items():
        serving = report["median"].get(name, {}).get("serving", {})
        cs = sorted(serving, key=int)
        if not cs:
            continue
        x = [int(c) for c in cs]
        levels.update(x)
        dashed = name == "in-process"
        tps.plot(x, [serving[c]["tokens_per_s"] for c in cs], marker="o", color=colour,
                 linestyle="--" if dashed else "-", label=label)
        p50 = [serving[c]["ttft_p50"] for c in cs]
        p99 = [serving[c]["ttft_p99"] for c in cs]
        if all(v is not None for v in p50 + p99):
            ttft.plot(x, p50, marker="o", color=colour, linestyle="--" if dashed else "-",
                      label=f"{label} p50")
            ttft.plot(x, p99, marker="^", color=colour, linestyle=":", label=f"{label} p99")
    for ax in (tps, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
    tps.set_ylabel("output tokens/s")
    tps.set_ylim(bottom=0)
    tps.legend(fontsize=7)
    ttft.set_ylabel("TTFT (s)")
    ttft.set_yscale("log")
    ttft.legend(fontsize=7)
    meta = report["meta"]
    fig.suptitle(f"{Path(meta['model']).name}, {meta['cpus']} CPUs, medians of "
                 f"{meta['reps']} rep(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
