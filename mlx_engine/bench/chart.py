"""The bench's chart: the speedup of every mode over plain decoding, one bar per temperature, one chart per
run (a run is one prompt suite), drawn with matplotlib's Agg backend (no display needed).

matplotlib is an optional extra (`pip install 'mlx-engine[plot]'`): without it the bench still runs and
writes its JSON, and says the chart was skipped and how to get it.

    python -m mlx_engine.bench.chart RESULTS.json [RESULTS.json ...]   # (re)draw RESULTS.png beside each
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

INSTALL = "pip install 'mlx-engine[plot]' (or pip install matplotlib)"
COLORS = ("#4682b4", "#e68c3c", "#5a9e5a", "#9467bd")


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed: the chart is skipped, the message says how to get it."""


def series_of(report: dict) -> tuple[list[str], dict[str, list[float]], str]:
    """(modes in run order, {"T=0": speedups per mode, ...}, baseline) of a bench report: the speedup over
    mlx-lm plain when it ran, else over engine plain; NaN where a mode has none."""
    rows = report["results"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    temps = list(dict.fromkeys(r["temp"] for r in rows))
    base = "mlx-lm plain" if "mlx-lm plain" in modes else "engine plain"
    key = "speedup_vs_mlx_lm_plain" if base == "mlx-lm plain" else "speedup_vs_engine_plain"
    value = {(r["mode"], r["temp"]): r.get(key) for r in rows}
    series = {f"T={t:g}": [math.nan if value.get((m, t)) is None else float(value[(m, t)]) for m in modes]
              for t in temps}
    return modes, series, base


def title_of(report: dict, base: str) -> tuple[str, str]:
    args = report.get("args", {})
    model = Path(str(report.get("model", "?"))).name
    device = str(report.get("machine", {}).get("device", "")).removeprefix("Device(").split(",")[0]
    title = f"{args.get('suite', '?')} suite: decode speedup over {base}"
    trials = args.get("trials", "?")
    sub = (f"{model}, {report.get('prompts', '?')} prompts x {trials} trial{'' if trials == 1 else 's'}, "
           f"{args.get('max_tokens', '?')} tokens, {device}; "
           f"{report.get('date', '')}")
    return title, sub


def speedup_figure(modes: list[str], series: dict[str, list[float]], title: str, subtitle: str = "",
                   baseline: str = "plain"):
    """A matplotlib Figure (Agg canvas): horizontal bars, one row per mode (its name as the label, whole),
    one bar per series with its value at the end, a dashed line at 1.0x (the baseline); x axis: the speedup.
    ChartUnavailable without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ChartUnavailable(f"chart skipped: matplotlib is not installed; {INSTALL}") from None

    n, k = len(modes), max(1, len(series))
    height = 1.6 + 0.32 * n * max(1, k * 0.75)
    fig = Figure(figsize=(10, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bar = 0.8 / k
    finite = [v for vals in series.values() for v in vals if math.isfinite(v)]
    top = max([1.0, *finite])
    for j, (name, vals) in enumerate(series.items()):
        ys = [i + (j - (k - 1) / 2) * bar for i in range(n)]
        bars = ax.barh(ys, [v if math.isfinite(v) else 0 for v in vals], height=bar * 0.92,
                       color=COLORS[j % len(COLORS)], label=name)
        labels = [f"{v:.2f}x" if math.isfinite(v) else "not run" for v in vals]
        ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
    ax.axvline(1.0, color="#c00000", linestyle="--", linewidth=1, label=f"{baseline} = 1.0x")
    ax.set_yticks(range(n), modes, fontsize=9)
    ax.invert_yaxis()  # the first mode on top, as in the table
    ax.set_xlim(0, top * 1.15)
    ax.set_xlabel(f"speedup over {baseline} (decode tok/s ratio, median over trials)")
    ax.set_ylabel("mode")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=k + 1, fontsize=8, frameon=False)
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    return fig


def report_figure(report: dict):
    modes, series, base = series_of(report)
    title, sub = title_of(report, base)
    return speedup_figure(modes, series, title, sub, base)


def draw_report(report: dict, path) -> None:
    """The report's chart as a PNG (ChartUnavailable without matplotlib)."""
    report_figure(report).savefig(path, format="png")


def main(argv=None) -> int:
    from ..args import ArgumentParser

    ap = ArgumentParser(prog="python -m mlx_engine.bench.chart",
                        description="Draw the speedup chart of bench result files (RESULTS.png beside each).")
    ap.add_argument("results", nargs="+", help="bench JSON reports")
    args = ap.parse_args(argv)
    for f in args.results:
        try:
            report = json.loads(Path(f).read_text())
            png = Path(f).with_suffix(".png")
            draw_report(report, png)
        except ChartUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {f}: not a bench report that can be drawn ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        print(f"wrote {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
