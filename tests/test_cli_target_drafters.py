"""`--drafter dflash --dflash PATH` and `--drafter gemma4-assistant --assistant PATH` through the one drafter
factory: the CLI (tokens == plain decoding), the bench, the chat's options, and clear errors."""

import json

import pytest
from mlx_lm.utils import save_config, save_model

import dflash_util as du
import gemma4_util as g
import model_dirs
from mlx_engine.__main__ import main
from mlx_engine.drafters.registry import KINDS, DrafterError, DrafterOptions, make_drafter

VOCAB = 320  # the tiny tokenizer's


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    qwen = model_dirs.save_tiny(root / "qwen3", family="qwen3", seed=1, num_hidden_layers=4)
    gemma = root / "gemma4"
    gemma.mkdir()
    save_model(gemma, g.build_target(VOCAB))
    save_config(g.target_config(VOCAB), gemma / "config.json")
    model_dirs.save_tokenizer(gemma, VOCAB)
    du.write(root / "dflash", du.config(VOCAB, 48, (0, 2)), seed=3)
    g.write_assistant(root / "assistant", VOCAB)
    return {k: str(root / k) for k in ("qwen3", "gemma4", "dflash", "assistant")}


def tokens(capsys, *argv):
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, flags", [
    ("qwen3", ["--drafter", "dflash", "--dflash", "{dflash}"]),
    ("gemma4", ["--drafter", "gemma4-assistant", "--assistant", "{assistant}"]),
])
def test_cli_output_equals_plain(dirs, capsys, model, flags):
    common = ["--model", dirs[model], "--prompt-tokens", "5,9,13,21,9,13,40,41", "--max-tokens", "20", "--ignore-eos"]
    plain = tokens(capsys, *common, "--drafter", "none")
    spec = tokens(capsys, *common, *[f.format(**dirs) for f in flags], "--num-draft", "3")
    assert spec["tokens"] == plain["tokens"]
    assert spec["stats"]["drafted"] > 0


@pytest.mark.parametrize("argv, words", [
    (["--model", "{qwen3}", "--drafter", "dflash"], ["--drafter dflash needs --dflash PATH"]),
    (["--model", "{qwen3}", "--drafter", "none", "--dflash", "{dflash}"], ["--dflash is only used with --drafter dflash"]),
    (["--model", "{qwen3}", "--drafter", "gemma4-assistant", "--assistant", "{assistant}"], ["Gemma 4 target only"]),
    (["--model", "{gemma4}", "--drafter", "gemma4-assistant"], ["needs --assistant PATH"]),
    (["--model", "{qwen3}", "--drafter", "dflash", "--dflash", "/no/such"], ["--dflash /no/such", "no config.json"]),
])
def test_errors_are_one_line_exit_2(dirs, capsys, argv, words):
    argv = [a.format(**dirs) for a in argv]
    assert main(["generate", *argv, "--prompt-tokens", "1,2,3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), err


def test_registry_and_chat_options(dirs, monkeypatch, tmp_path):
    from mlx_engine import load

    assert {"dflash", "gemma4-assistant"} <= set(KINDS)
    d = make_drafter("dflash", load(dirs["qwen3"]), DrafterOptions.for_kind("dflash", dirs["dflash"]))
    assert d.name == "dflash" and d.max_draft() == 4
    a = make_drafter("gemma4-assistant", load(dirs["gemma4"]), DrafterOptions.for_kind("gemma4-assistant", dirs["assistant"]))
    assert a.name == "gemma4-assistant"
    with pytest.raises(DrafterError):
        make_drafter("ngram", None, DrafterOptions(assistant=dirs["assistant"]))

    monkeypatch.setenv("MLX_ENGINE_CONFIG_DIR", str(tmp_path))
    from app.__main__ import build_app

    app = build_app(["--dflash", dirs["dflash"], "--no-save", "--reset"])
    assert app.settings.drafter == "dflash" and app.settings.draft_model == dirs["dflash"]
    app = build_app(["--assistant", dirs["assistant"], "--no-save", "--reset"])
    assert app.settings.drafter == "gemma4-assistant" and app.settings.draft_model == dirs["assistant"]


def test_bench_runs_dflash_modes(dirs, tmp_path):
    from mlx_engine.bench.suite import main as bench

    out = tmp_path / "r.json"
    rc = bench(["--model", dirs["qwen3"], "--draft-model", "layers:1", "--dflash", dirs["dflash"], "--prompts", "1",
                "--max-tokens", "6", "--trials", "1", "--temps", "0", "--ks", "2", "--modes", "engine dflash",
                "--out", str(out)])
    assert rc == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert {"engine dflash k=2", "engine dflash auto"} <= set(rows)
    assert all(r["tokens"] > 0 for r in rows.values())
