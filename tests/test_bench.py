"""`python -m mlx_engine.bench` end to end on a tiny model: every mode runs, the report and chart are written."""

import json

import pytest

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


def test_modes_without_mlx_lm_plain_get_engine_plain_as_baseline(tmp_path):
    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1)
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--draft-model", "layers:1", "--prompts", "1", "--max-tokens", "4", "--trials",
               "1", "--temps", "0", "--ks", "1", "--modes", "engine ngram", "--out", str(out)])
    assert rc == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"engine plain", "engine ngram k=1", "engine ngram auto"}
    assert all(r["speedup_vs_mlx_lm_plain"] is None and r["speedup_vs_engine_plain"] > 0 for r in rows.values())


@pytest.mark.parametrize("argv, words", [
    (["--model", "/no/such/model"], ["model not found", "/no/such/model"]),
    (["--temps", "abc"], ["--temps", "'abc'"]),
    (["--temps", "nan"], ["--temps", "'nan'"]),
    (["--ks", "-1"], ["--ks", "'-1'"]),
    (["--ks", "0"], ["--ks", "'0'"]),
    (["--prompts", "0"], ["--prompts", "'0'"]),
    (["--max-tokens", "0"], ["--max-tokens", "'0'"]),
    (["--max-tokens", "1"], ["--max-tokens", "'1'"]),
    (["--trials", "0"], ["--trials", "'0'"]),
    (["--suite", "nope"], ["no prompt suite 'nope'"]),
    (["--modes", "medusa"], ["--modes 'medusa' matches none"]),
    (["--draft-model", "layers:x"], ["--draft-model 'layers:x'"]),
    (["--mtp-weights", "/no/head.safetensors"], ["/no/head.safetensors", "does not exist"]),
])
def test_bad_flags_give_one_error_line_and_status_2(tmp_path, capsys, argv, words):
    model = tmp_model(tmp_path)
    full = argv if argv[0] == "--model" else ["--model", str(model), "--draft-model", "layers:1", *argv]
    assert main([*full, "--out", str(tmp_path / "r.json")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), err
    assert not (tmp_path / "r.json").exists()


def tmp_model(tmp_path):
    return model_dirs.save_tiny(tmp_path / "tiny", seed=1)


def test_default_out_is_outside_the_source_tree_and_help_says_where(capsys):
    from pathlib import Path

    from mlx_engine.bench.suite import default_out

    repo = Path(__file__).resolve().parents[1]
    assert repo not in default_out().resolve().parents
    assert main(["--help"]) == 0
    assert str(default_out()) in "".join(capsys.readouterr().out.split())  # help wraps lines, even at a "-"


def test_bench_verify_reports_stock_invariance():
    from mlx_engine.bench.invariance import report

    lines = report()  # whether stock MLX is invariant here is the device's business: reported, not asserted
    assert len(lines) == 2 and all("batch invariant" in line for line in lines)


def test_bench_verify_shape_table_times_every_path_and_says_which_are_exact(capsys):
    """`bench verify --shape` on a 1-layer model: stock, fused and each fixed-row plan asked for, side by side,
    and the exactness line; the fused and fixed paths are invariant by contract (stock is not asserted)."""
    from mlx_engine.bench.verify import main as verify_main

    args = ["--shape", "smollm2-135m", "--shape-layers", "1", "--prefill", "8", "--trials", "1", "--max-len", "2"]
    assert verify_main(args + ["--fixed-plans", "auto,kernels"]) == 0
    out = capsys.readouterr().out
    assert "fixed:   16-row passes, plan 'kernels' -> 'kernels'" in out
    exact = next(line for line in out.splitlines() if line.startswith("8-token verify"))
    assert "fused yes" in exact and "fixed:kernels yes" in exact
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 and all(len(r) == 1 + 2 * 4 for r in rows)  # k+1, then ms and ratio per path
    with pytest.raises(SystemExit):
        verify_main(args + ["--fixed-plans", "fast"])
    assert "--fixed-plans" in capsys.readouterr().err


def test_bench_verify_shape_table_times_the_batch_engine_step(capsys):
    """`--sequences 3`: a second table, 3 sequences x (k+1) tokens over a batch cache, stock and fused."""
    from mlx_engine.bench.verify import main as verify_main

    args = ["--shape", "smollm2-135m", "--shape-layers", "1", "--prefill", "8", "--trials", "1", "--max-len", "2"]
    assert verify_main(args + ["--fixed-plans", "kernels", "--sequences", "3"]) == 0
    out = capsys.readouterr().out.split("3 sequences x (k+1) tokens over a BatchKVCache")
    assert len(out) == 2
    rows = [line.split() for line in out[1].splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 and all(len(r) == 1 + 2 * 2 for r in rows)  # k+1, then stock and fused
    with pytest.raises(SystemExit):
        verify_main(args + ["--sequences", "0"])


def test_edit_suite_is_well_formed():
    """bench/prompts/edit.jsonl: >= 10 requests to rewrite a given piece of code or text with a small change."""
    from mlx_engine.bench.suite import suite_file

    rows = [json.loads(line) for line in suite_file("edit").read_text().splitlines() if line.strip()]
    assert len(rows) >= 10
    assert [r["id"] for r in rows] == [f"edit-{i:03d}" for i in range(1, len(rows) + 1)]
    for r in rows:
        (msg,) = r["messages"]
        assert msg["role"] == "user"
        request, _, given = msg["content"].partition("\n\n")
        assert len(given.split()) >= 20, r["id"]  # the piece to rewrite is in the prompt


def test_bench_runs_the_registry_chains_and_eagle3_on_the_edit_suite(tmp_path):
    from eagle3_writer import write_eagle3

    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1, num_hidden_layers=6)
    cfg = json.loads((model / "config.json").read_text())
    head = tmp_path / "eagle3"
    write_eagle3(head, cfg, seed=3, draft_vocab=64)
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--suite", "edit", "--prompts", "2", "--max-tokens", "6", "--trials", "1",
               "--temps", "0,0.7", "--ks", "2", "--eagle3", str(head), "--modes", "eagle3", "--warmup-prompts", "1",
               "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["mode"] for r in rows} == {"engine plain", "engine eagle3 k=2", "engine eagle3 auto",
                                         "engine ngram+eagle3 k=2", "engine ngram+eagle3 auto"}
    assert all(r["tokens"] > 0 and r["speedup_vs_engine_plain"] > 0 for r in rows)


def test_bench_eagle3_bad_path_is_one_error_line(tmp_path, capsys):
    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1, num_hidden_layers=6)
    assert main(["--model", str(model), "--draft-model", "layers:1", "--eagle3", str(tmp_path / "nope"),
                 "--out", str(tmp_path / "r.json")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and "nope" in err[0], err


def test_every_mode_ends_an_answer_at_the_same_stop_token():
    """With stop tokens (the default: the model's end of turn), mlx-lm's and the engine's runs end at the
    first one and count the same tokens, the stop token included; without, both run to max_tokens."""
    import tiny_models
    from mlx_engine import Engine, NgramDrafter
    from mlx_engine.bench.modes import run_engine, run_mlx_lm
    from reference import mlx_lm_greedy

    model, _ = tiny_models.build("llama", seed=1)  # its greedy output has new tokens after the first few
    prompt = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42]
    ref = mlx_lm_greedy(model, prompt, 24)
    at = next(i for i in range(3, 24) if ref[i] not in ref[:i])  # the first time this token is emitted
    stop = frozenset({ref[at]})
    runs = [run_mlx_lm(model, prompt, 24, 0.0, 0, stop=stop), run_engine(Engine(model), prompt, 24, 0.0, 0, 0, stop),
            run_engine(Engine(model, NgramDrafter(min_ngram=1)), prompt, 24, 0.0, 0, 4, stop)]
    assert [r.tokens for r in runs] == [at] * 3
    full = [run_mlx_lm(model, prompt, 24, 0.0, 0), run_engine(Engine(model), prompt, 24, 0.0, 0, 0)]
    assert [r.tokens for r in full] == [23, 23]


def test_each_registry_mode_gets_only_its_own_checkpoint(monkeypatch):
    """With an MTP head and --eagle3 both present, ngram+mtp is built without the EAGLE-3 folder (the
    registry refuses another kind's checkpoint: the bench stopped with that error on the embedded model)."""
    from types import SimpleNamespace

    from mlx_engine.bench.suite import registry_drafters
    from mlx_engine.drafters import registry

    seen = {}
    monkeypatch.setattr(registry, "make_drafter", lambda kind, loaded, opts: seen.setdefault(kind, opts))
    args = SimpleNamespace(mtp_weights="head.safetensors", eagle3="e3", dflash="dfl", assistant=None)
    made = registry_drafters(args, loaded=None, mtp_ok=True)
    assert set(made) == set(seen) == {"suffix", "ngram+mtp", "suffix+mtp", "mtp-tree", "eagle3", "ngram+eagle3",
                                      "dflash"}
    assert seen["ngram+mtp"].eagle3 is None and seen["ngram+mtp"].dflash is None
    assert seen["eagle3"].eagle3 == seen["ngram+eagle3"].eagle3 == "e3" and seen["eagle3"].dflash is None
    assert seen["dflash"].dflash == "dfl" and seen["dflash"].eagle3 is None
    assert all(o.mtp_weights == "head.safetensors" for o in seen.values())


def test_ignore_eos_runs_every_mode_to_max_tokens(tmp_path):
    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1)
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--draft-model", "layers:1", "--prompts", "2", "--max-tokens", "6", "--trials",
               "1", "--temps", "0", "--ks", "1", "--modes", "plain,engine ngram", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["args"]["ignore_eos"] is True
    assert {r["tokens"] for r in report["results"]} == {2 * 5}  # 2 prompts x 5 tokens timed after the first


@pytest.mark.parametrize("flag", ["--trials", "--prefill", "--max-len", "--layers", "--sequences"])
def test_bench_verify_refuses_counts_below_one_with_one_line(flag, capsys):
    from mlx_engine.bench.verify import main as verify_main

    with pytest.raises(SystemExit) as e:
        verify_main([flag, "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument " + flag) and "Traceback" not in err


@pytest.mark.parametrize("suite", ["json", "tools"])
def test_structured_suites_run_constrained_modes_and_report_the_grammar_s_figures(tmp_path, suite):
    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1)
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--draft-model", "layers:1", "--suite", suite, "--prompts", "2",
               "--max-tokens", "12", "--trials", "1", "--temps", "0", "--ks", "2", "--warmup-prompts", "1",
               "--modes", "mlx-lm constrained,engine plain,engine grammar,engine ngram,engine ngram constrained,"
                          "engine grammar+ngram", "--out", str(out)])
    assert rc == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"mlx-lm constrained", "engine plain", "engine plain constrained", "engine grammar",
                         "engine ngram", "engine ngram constrained", "engine grammar+ngram"}
    for name, r in rows.items():
        assert r["speedup_vs_plain_constrained"] > 0 and 0 <= r["valid"] <= r["finished"] <= 1
        # valid among the finished: an answer cut at --max-tokens is unfinished, not a grammar failure
        assert r["valid_finished"] is None if r["finished"] == 0 else \
            r["valid_finished"] == pytest.approx(r["valid"] / r["finished"])
    assert rows["engine plain constrained"]["speedup_vs_plain_constrained"] == 1.0
    assert rows["engine grammar"]["forced_share"] > 0 and rows["engine plain constrained"]["forced_share"] == 0
    assert rows["engine grammar+ngram"]["speedup_vs_unconstrained"] > 0
    assert rows["engine grammar"]["grammar_us_per_token"] > 0 and rows["engine plain"]["grammar_us_per_token"] == 0


def test_structured_modes_are_named_exactly(tmp_path, capsys):
    model = model_dirs.save_tiny(tmp_path / "tiny", seed=1)
    assert main(["--model", str(model), "--draft-model", "layers:1", "--suite", "json", "--modes", "engine grammar+nope",
                 "--out", str(tmp_path / "r.json")]) == 2
    assert "no structured mode engine grammar+nope" in capsys.readouterr().err
