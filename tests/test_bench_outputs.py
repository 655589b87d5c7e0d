"""What the bench writes and where: output paths refused before the model loads, the chart drawn with
matplotlib (mode names whole, axes labelled, one bar per temperature), the bench without matplotlib, and
the batching bench's bad inputs as one line."""

import errno
import json
import math
import sys
from pathlib import Path

import pytest

import model_dirs
import mlx_engine.bench.suite as suite
from mlx_engine.bench.batching import main as batching_main
from mlx_engine.bench.chart import main as chart_main
from mlx_engine.bench.suite import main

FAST = ["--draft-model", "layers:1", "--prompts", "1", "--max-tokens", "4", "--trials", "1", "--temps", "0",
        "--ks", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_dirs.save_tiny(tmp_path_factory.mktemp("bench") / "tiny", seed=1)


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad output path was refused")

    monkeypatch.setattr(suite, "load", refuse)
    import mlx_engine.models as models

    monkeypatch.setattr(models, "load", refuse)


def one_error_line(capsys, *words):
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), err
    return err[0]


def report_of(modes_speedups: dict, suite_name="edit", temps=(0.0, 0.7)) -> dict:
    rows = [{"mode": m, "temp": t, "speedup_vs_mlx_lm_plain": v[i], "speedup_vs_engine_plain": None}
            for m, v in modes_speedups.items() for i, t in enumerate(temps)]
    return {"results": rows, "model": "/models/SmolLM2-135M", "prompts": 8, "date": "2026-11-25 10:00:00",
            "machine": {"device": "Device(cpu, 0)"}, "args": {"suite": suite_name, "trials": 3, "max_tokens": 64}}


# -- output paths -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--out", "{d}/a_file/r.json"], ["--out", "a_file is a file, not a folder"]),
    (["--out", "{d}"], ["--out", "is a folder, not a file"]),
    (["--out", "{d}/r.json", "--chart", "{d}/a_file/c.png"], ["--chart", "a_file is a file, not a folder"]),
])
def test_an_unwritable_output_is_refused_before_the_model_loads(flags, words, tiny, tmp_path, no_model, capsys):
    (tmp_path / "a_file").write_text("x")
    flags = [f.format(d=tmp_path) for f in flags]
    assert main(["--model", str(tiny), *FAST, *flags]) == 2
    one_error_line(capsys, *words)


def test_a_read_only_place_is_refused_before_the_model_loads(tiny, tmp_path, no_model, monkeypatch, capsys):
    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_bytes", read_only)
    assert main(["--model", str(tiny), *FAST, "--out", str(tmp_path / "r.json")]) == 2
    one_error_line(capsys, "--out", "cannot write there (Read-only file system)")


# -- the chart ----------------------------------------------------------------------------------------
def test_the_chart_names_every_mode_whole_and_labels_its_axes(tmp_path):
    from mlx_engine.bench.chart import report_figure

    speedups = {"mlx-lm plain": (1.0, 1.0), "engine plain": (1.04, 0.97), "engine ngram+mtp auto": (1.22, 1.12),
                "engine ngram+eagle3 k=2": (0.91, None)}
    fig = report_figure(report_of(speedups))
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == list(speedups)  # "+" and "=" kept
    assert "speedup over mlx-lm plain" in ax.get_xlabel() and ax.get_ylabel() == "mode"
    assert "edit suite" in ax.get_title() and "SmolLM2-135M" in ax.get_title()
    labels = [t.get_text() for t in ax.texts]
    assert {"1.22x", "1.12x", "0.91x", "not run"} <= set(labels)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["mlx-lm plain = 1.0x", "T=0", "T=0.7"]
    bars = [p.get_width() for p in ax.patches]
    assert math.isclose(max(bars), 1.22) and len(bars) == 2 * len(speedups)
    png = tmp_path / "c.png"
    fig.savefig(png)
    import matplotlib.image

    h, w, _ = matplotlib.image.imread(png).shape
    assert w > 800 and h > 300


def test_the_chart_is_redrawn_from_a_report_and_a_bad_file_is_one_line(tmp_path, capsys):
    good = tmp_path / "run.json"
    good.write_text(json.dumps(report_of({"mlx-lm plain": (1.0, 1.0), "engine mtp auto": (1.1, 1.0)})))
    assert chart_main([str(good)]) == 0
    assert good.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert chart_main([str(bad)]) == 2
    one_error_line(capsys, "bad.json", "not a bench report")


def test_without_matplotlib_the_bench_runs_and_says_how_to_get_the_chart(tiny, tmp_path, monkeypatch, capsys):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of matplotlib fails, as if not installed
    out = tmp_path / "r.json"
    assert main(["--model", str(tiny), *FAST, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"] and not out.with_suffix(".png").exists()
    err = capsys.readouterr().err
    assert "chart skipped: matplotlib is not installed" in err and "pip install 'mlx-engine[plot]'" in err


# -- the batching bench -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words, loads", [
    (["--suite", "nope"], ["no prompt suite 'nope'"], False),
    (["--json", "{d}/a_file/r.json"], ["--json", "a_file is a file, not a folder"], False),
    (["--drafter", "medusa"], ["argument --drafter", "medusa"], False),
    (["--modes", "fast"], ["--modes", "'fast'"], False),
    (["--clients", "0"], ["argument --clients"], False),
    (["--drafter", "mtp"], ["--drafter mtp", "no MTP head"], True),
])
def test_batching_bad_inputs_are_one_line(argv, words, loads, tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("x")
    if not loads:
        import mlx_engine.models as models

        monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = [a.format(d=tmp_path) for a in argv]
    assert batching_main(["--model", str(tiny), *argv]) == 2
    one_error_line(capsys, *words)
