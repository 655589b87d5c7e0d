"""Every measured table of README.md and docs/ is what its bench/results JSON gives (scripts/bench_tables.py):
a figure typed by hand, or a JSON re-measured without the page rewritten, turns this red."""

import importlib.util
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tables_module():
    spec = importlib.util.spec_from_file_location("bench_tables", REPO / "scripts" / "bench_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_table_on_every_page_matches_its_json():
    bt = tables_module()
    n = sum(len(bt.blocks(p.read_text())) for p in bt.pages())
    assert n >= 10, "the README and the benchmarks page show their measured tables"
    assert "<!-- bench: best -->" in (REPO / "README.md").read_text()
    assert bt.differences() == []


def test_a_changed_json_number_is_caught(tmp_path, monkeypatch):
    bt = tables_module()
    results = tmp_path / "bench" / "results"
    shutil.copytree(REPO / "bench" / "results", results)
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    name = "smollm2-agent-suffix-trees-cpu.json"
    data = json.loads((results / name).read_text())
    for r in data["results"]:
        if r["mode"] == "engine ngram auto" and r["temp"] == 0:
            r["speedup_vs_engine_plain"] = 2.71
    (results / name).write_text(json.dumps(data))
    monkeypatch.setattr(bt, "RESULTS", results)
    bad = bt.differences(tmp_path)
    assert bad and "README.md" in bad[0] and "2.62x" in bad[0] and "2.71x" in bad[0]
