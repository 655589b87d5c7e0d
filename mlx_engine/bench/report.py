"""What a bench run writes: the machine it ran on, the table, the JSON report and the chart; and the
check, before any work, that the files can be written where they were asked for."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from .. import _platform  # OpenBLAS before mlx; the machine record names it

import mlx.core as mx  # noqa: E402


class BenchInputError(ValueError):
    """A flag or file the bench cannot use; reported as one `error:` line, exit status 2."""


def command(parser, run, argv) -> int:
    """A bench command's main: parse argv (a bad flag or --help: argparse's exit status, one `error:` line),
    then run(args, argv); bad input the run meets (BenchInputError, a model that does not load, a missing
    file) is one `error:` line and exit status 2, Ctrl-C the usual interrupted exit."""
    from ..args import interrupted, run_main
    from ..models import ModelLoadError

    try:
        return run_main(parser, lambda args: run(args, argv), argv,
                        (BenchInputError, ModelLoadError, FileNotFoundError))
    except KeyboardInterrupt:
        return interrupted()


def writable_file(path: str | Path, flag: str) -> Path:
    """An output file that can be written: its folder created and a file written and removed there now
    (train.inputs.writable_dir), so a run never ends with its results lost to a bad path."""
    from ..train.inputs import writable_dir

    p = Path(path).expanduser()
    if p.is_dir():
        raise BenchInputError(f"{flag} {p}: is a folder, not a file")
    try:
        writable_dir(p.parent, flag, shown=p)
    except ValueError as e:
        raise BenchInputError(str(e)) from None
    if p.exists() and not os.access(p, os.W_OK):
        raise BenchInputError(f"{flag} {p}: cannot write there (permission denied)")
    return p


def machine() -> dict:
    import importlib.metadata as md

    def version(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "mlx": version("mlx"), "mlx-lm": version("mlx-lm"),
        "device": str(mx.default_device()), "openblas": _platform.OPENBLAS, "cpu_count": os.cpu_count(),
    }


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decode speed (median over trials)")
    for col in ("mode", "temp", "tok/s", "vs mlx-lm", "vs plain", "e2e vs mlx-lm", "accept", "E", "C", "S",
                "per position", "peak MB"):
        table.add_column(col, justify="left" if col in ("mode", "per position") else "right")

    def x(v):  # a speedup, or "-" when its baseline did not run
        return "-" if v is None else f"{v:.2f}x"

    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        per = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:6])
        table.add_row(r["mode"], f"{r['temp']:g}", f"{r['tok_s']:.2f}", x(r["speedup_vs_mlx_lm_plain"]),
                      x(r["speedup_vs_engine_plain"]), x(r["e2e_speedup_vs_mlx_lm_plain"]), acc,
                      f"{r['E']:.2f}", f"{r['C']:.2f}", f"{r['S']:.2f}", per, f"{r['peak_memory_mb']:.0f}")
    Console(width=170).print(table)


def print_structured_table(rows: list[dict]) -> None:
    """The structured suites' own figures (bench/structured.py)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="structured output (median over trials)")
    for col in ("mode", "temp", "tok/s", "vs plain constrained", "vs unconstrained", "accept", "E", "forced share",
                "grammar us/token", "valid", "finished", "valid of finished"):
        table.add_column(col, justify="left" if col == "mode" else "right")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        table.add_row(r["mode"], f"{r['temp']:g}", f"{r['tok_s']:.2f}", f(r.get("speedup_vs_plain_constrained"), ".2f"),
                      f(r.get("speedup_vs_unconstrained"), ".2f"), f(r["acceptance"], ".2f"), f"{r['E']:.2f}",
                      f(r["forced_share"], ".2f"), f(r["grammar_us_per_token"], ".0f"), f(r["valid"], ".2f"),
                      f(r.get("finished"), ".2f"), f(r.get("valid_finished"), ".2f"))
    Console(width=170).print(table)


def write_outputs(report: dict, out: Path, chart: Path) -> None:
    """The JSON report, then its chart (or a note saying why there is none and how to get one)."""
    from .chart import ChartUnavailable, draw_report

    out.write_text(json.dumps(report, indent=1))
    try:
        draw_report(report, chart)
    except ChartUnavailable as e:
        print(f"wrote {out}; note: {e}", file=sys.stderr)
        return
    print(f"wrote {out} and {chart}", file=sys.stderr)
