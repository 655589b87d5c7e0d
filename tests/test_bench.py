"""`python -m mlx_engine.bench` end to end on a tiny model: every mode runs, the report and chart are written."""

import json

import model_dirs
from mlx_engine.bench.suite import main


def test_bench_runs_every_mode_and_writes_its_report(tmp_path):
    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1)
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--draft-model", "layers:1", "--prompts", "2", "--max-tokens", "6",
               "--trials", "1", "--temps", "0,0.7", "--ks", "1", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    modes = {r["mode"] for r in report["results"]}
    assert {"mlx-lm plain", "mlx-lm draft k=1", "engine plain", "engine draft k=1", "engine draft auto",
            "engine ngram k=1", "engine ngram auto"} <= modes
    for r in report["results"]:
        assert r["tokens"] > 0 and r["tok_s"] > 0
        assert r["speedup_vs_mlx_lm_plain"] > 0 and r["speedup_vs_engine_plain"] > 0
    base = [r for r in report["results"] if r["mode"] == "mlx-lm plain"]
    assert all(abs(r["speedup_vs_mlx_lm_plain"] - 1.0) < 1e-12 for r in base)
    assert report["machine"]["mlx"] and out.with_suffix(".png").stat().st_size > 0
