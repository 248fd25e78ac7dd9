"""A PNG of per-request timings: every run's requests in run order, A and B in two colours.

Why per request and in run order: a median hides warm-up effects, a slow
first request after a rebuild, and drift across blocks; a strip of points per
run shows them at once. matplotlib is imported only here, with the Agg
backend (no display), and only when `--plot` is given; it is part of the
`bench` extra.
"""
from __future__ import annotations

from pathlib import Path

from .errors import BenchError
from .harness import BenchResult
from .report import headline

COLORS = {"A": "#1f77b4", "B": "#d62728"}


def write_plot(result: BenchResult, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib (pip install 'flare-runtime[bench]')") from exc
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, box) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    x0 = 0
    seen = set()
    for run in result.runs:
        key = run.slot.key
        xs = list(range(x0, x0 + len(run.latencies_s)))
        label = f"{key}: {result.configs[key].name}" if key not in seen else None
        seen.add(key)
        ax.plot(xs, [s * 1e3 for s in run.latencies_s], "o-", ms=3, lw=0.8, color=COLORS[key], label=label)
        x0 += len(run.latencies_s) + 1
        ax.axvline(x0 - 1, color="0.85", lw=0.6)
    ax.set_xlabel("request (runs in A B B A order)")
    ax.set_ylabel("latency per request (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{result.model}: {result.blocks} block(s), {len(result.requests)} requests per run", fontsize=10)
    data = [[s * 1e3 for r in result.runs if r.slot.key == k for s in r.latencies_s] for k in ("A", "B")]
    parts = box.boxplot(data, patch_artist=True)
    box.set_xticks([1, 2], ["A", "B"])
    for patch, key in zip(parts["boxes"], ("A", "B")):
        patch.set_facecolor(COLORS[key])
        patch.set_alpha(0.4)
    box.set_ylim(bottom=0)
    box.set_title("all timed requests", fontsize=10)
    fig.suptitle(headline(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

