"""`python -m mlx_engine.bench distributed` end to end on a tiny model: 1 and 2 processes, two link
latencies (the send() delay library compiled and preloaded), plain and speculative rows."""

import json

import pytest

from model_dirs import save_tiny


@pytest.mark.slow
def test_bench_distributed_cells(tmp_path, monkeypatch, capsys):
    from mlx_engine.bench.__main__ import main

    monkeypatch.setenv("MLX_ENGINE_CACHE", str(tmp_path / "cache"))
    model = save_tiny(tmp_path / "ds3", "deepseek_v3", seed=1, num_hidden_layers=4)
    out = tmp_path / "rows.json"
    assert main(["distributed", "--model", str(model), "--processes", "1,2", "--latencies", "0,1", "--trials", "1",
                 "--max-tokens", "24", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["processes"], r["link_delay_ms"], r["mode"]) for r in rows} == {
        (1, 0, "plain"), (1, 0, "spec"), (2, 0, "plain"), (2, 0, "spec"), (2, 1, "plain"), (2, 1, "spec")}
    assert (tmp_path / "cache" / "bench-distributed" / "link_delay.so").exists()
    by = {(r["processes"], r["link_delay_ms"], r["mode"]): r for r in rows}
    assert by[1, 0, "plain"]["collectives_per_token"] == 0  # one process: no link
    for delay in (0, 1):
        plain, spec = by[2, delay, "plain"], by[2, delay, "spec"]
        assert plain["E"] == 1.0 and plain["collectives_per_token"] > 0
        # the same work at either latency: the same collectives per token
        assert plain["collectives_per_token"] == by[2, 0, "plain"]["collectives_per_token"]
        if spec["E"] > 1:  # a verify pass that kept drafts costs fewer collectives per token
            assert spec["collectives_per_token"] < plain["collectives_per_token"]
    assert "coll/tok" in capsys.readouterr().out
    assert main(["distributed", "--num-draft", "x"]) == 2
    assert main(["distributed", "--drafter", "draft"]) == 2
