"""The CLI: JSON output and trace, and clear errors with a non-zero exit for bad input."""

import json
import subprocess
import sys

import pytest

import model_dirs
from mlx_engine.__main__ import main
from reference import mlx_lm_greedy


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = model_dirs.save_tiny(root / "target", seed=1)
    other = model_dirs.save_tiny(root / "other_vocab", seed=2, vocab=300, corpus=["cats and dogs and birds " * 5])
    return {"target": str(target), "other": str(other)}


def run_json(capsys, *argv):
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_trace_equals_plain_decoding(dirs, capsys):
    from mlx_engine import load

    prompt = [5, 9, 13, 21, 9, 13]
    common = ["--model", dirs["target"], "--prompt-tokens", ",".join(map(str, prompt)), "--max-tokens", "24", "--ignore-eos"]
    plain = run_json(capsys, *common, "--drafter", "none")
    spec = run_json(capsys, *common, "--drafter", "draft", "--draft-model", dirs["target"], "--num-draft", "3", "--trace")
    ngram = run_json(capsys, *common, "--drafter", "ngram", "--trace")
    ref = mlx_lm_greedy(load(dirs["target"]).model, prompt, 24)
    assert plain["tokens"] == spec["tokens"] == ngram["tokens"] == ref
    # the trace accounts for every token after the first, one entry per verify cycle
    trace = spec["trace"]
    assert [t for e in trace for t in e["emitted"]] == spec["tokens"][1:]
    assert len(trace) == spec["stats"]["cycles"]
    for e in trace:
        assert e["emitted"][: e["accepted"]] == e["draft"][: e["accepted"]]
        assert len(e["emitted"]) == e["accepted"] + 1 or e is trace[-1]
    stats = spec["stats"]
    assert stats["accepted"] == stats["drafted"] > 0  # the target drafting for itself
    for key in ("generated", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "acceptance_per_position",
                "decode_tps", "prompt_tps", "time_draft", "time_verify", "time_sample", "time_host", "peak_memory"):
        assert key in stats
    assert isinstance(spec["text"], str)


def test_batch_invariant_flag_decodes_the_same_tokens(dirs, capsys, monkeypatch):
    """--batch-invariant routes decode and verify through the batch-invariant path (Engine records it);
    speculative output still equals plain output, and here (a tiny model) equals stock decoding too."""
    import mlx_engine.cli as cli

    engines = []
    real = cli.Engine
    monkeypatch.setattr(cli, "Engine", lambda *a, **kw: engines.append(real(*a, **kw)) or engines[-1])
    prompt = "5,9,13,21,9,13"
    common = ["--model", dirs["target"], "--prompt-tokens", prompt, "--max-tokens", "16", "--ignore-eos"]
    stock = run_json(capsys, *common)
    spec = run_json(capsys, *common, "--drafter", "ngram", "--num-draft", "3", "--batch-invariant")
    plain = run_json(capsys, *common, "--batch-invariant")
    fixed = run_json(capsys, *common, "--drafter", "ngram", "--num-draft", "3", "--batch-invariant", "fixed")
    off = run_json(capsys, *common, "--no-batch-invariant")
    assert [e.batch_invariant for e in engines] == [False, True, True, True, False]
    assert [e.max_rows for e in engines] == [None, 16, 16, 16, None]  # invariant passes of up to 16 tokens
    assert spec["tokens"] == plain["tokens"] == stock["tokens"] == fixed["tokens"] == off["tokens"]


def test_text_prompt_with_chat_template(dirs, capsys):
    out = run_json(capsys, "--model", dirs["target"], "--prompt", "hello there", "--max-tokens", "5", "--ignore-eos")
    assert len(out["tokens"]) == 5 and out["stats"]["prompt_tokens"] > 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/model", "--prompt", "hi"], "model not found"),
        (["--model", "{target}", "--prompt", "hi", "--drafter", "draft", "--draft-model", "{other}"], "another vocabulary"),
        (["--model", "{target}", "--prompt", "hi", "--num-draft", "-1"], "--num-draft must be >= 0"),
        (["--model", "{target}", "--prompt", "hi", "--drafter", "medusa"], "unknown drafter"),
        (["--model", "{target}", "--prompt", ""], "prompt is empty"),
        (["--model", "{target}", "--prompt-tokens", ""], "prompt is empty"),
        (["--model", "{target}", "--prompt-tokens", "1,x"], "comma-separated integers"),
        (["--model", "{target}", "--prompt", "hi", "--drafter", "draft"], "needs --draft-model"),
        (["--model", "{target}", "--prompt", "hi", "--drafter", "ngram", "--draft-vocab-subset", "x"],
         "only used with --drafter draft"),
        (["--model", "{target}", "--prompt", "hi", "--drafter", "draft", "--draft-model", "{target}",
          "--draft-vocab-subset", "/no/such.safetensors"], "no vocabulary subset file"),
        (["--model", "{target}", "--prompt", "hi", "--temp", "-1"], "argument --temp: expected a finite number >= 0"),
        (["--model", "{target}", "--prompt", "hi", "--temp", "nan"], "argument --temp: expected a finite number >= 0, got 'nan'"),
        (["--model", "{target}", "--prompt", "hi", "--temp", "inf"], "got 'inf'"),
        (["--model", "{target}", "--prompt", "   "], "the prompt is only whitespace"),
        (["--model", "{target}", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--model", "{target}", "--prompt", "hi", "--top-p", "0"], "top-p must be in"),
        (["--model", "{target}", "--prompt-tokens", "1,99999"], "token ids must be in"),
        (["--model", "{target}", "--prompt", "hi", "--grammar", "regex:a(b"], "--grammar: regex 'a(b' cannot be compiled"),
        (["--model", "{target}", "--prompt", "hi", "--grammar", "xml"], "expected json, json:SCHEMA_FILE"),
        (["--model", "{target}", "--prompt", "hi", "--grammar", "json:/no/such.json"], "cannot read /no/such.json"),
        (["--model", "{target}", "--prompt", "hi", "--grammar", "json", "--ignore-eos"], "drop --ignore-eos"),
    ],
)
def test_bad_input_gives_clear_error(dirs, capsys, argv, message):
    argv = [a.format(**dirs) for a in argv]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_grammar_flag_answers_valid_json_with_the_mtp_head(capsys, tmp_path):
    """The embedded model: --grammar json:SCHEMA with its MTP head drafting, the same tokens without it."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    (tmp_path / "person.json").write_text(json.dumps(schema))
    common = ["--prompt", "Ada Lovelace was 36. Give her name and age as JSON.", "--grammar",
              f"json:{tmp_path / 'person.json'}", "--max-tokens", "48"]
    spec = run_json(capsys, *common, "--drafter", "mtp")
    plain = run_json(capsys, *common)
    assert spec["tokens"] == plain["tokens"]
    jsonschema.validate(json.loads(spec["text"]), schema)
    assert spec["stats"]["forced"] > 0 and plain["stats"]["forced"] > 0  # the grammar drafts under both


def test_draft_vocab_subset_is_lossless(dirs, capsys, tmp_path):
    import mlx.core as mx

    subset = tmp_path / "subset.safetensors"
    mx.save_safetensors(str(subset), {"vocab_subset": mx.arange(0, 320, 2, dtype=mx.int32)})
    prompt = "5,9,13,21,9,13"
    common = ["--model", dirs["target"], "--prompt-tokens", prompt, "--max-tokens", "24", "--ignore-eos"]
    plain_out = run_json(capsys, *common)
    draft_out = run_json(capsys, *common, "--drafter", "draft", "--draft-model", dirs["target"],
                         "--draft-vocab-subset", str(subset), "--num-draft", "2")
    assert draft_out["tokens"] == plain_out["tokens"]


def test_module_entry_point(dirs):
    """`python -m mlx_engine` as a user runs it: exit status and stderr."""
    ok = subprocess.run(
        [sys.executable, "-m", "mlx_engine", "generate", "--model", dirs["target"], "--prompt-tokens", "1,2,3",
         "--max-tokens", "4", "--ignore-eos", "--drafter", "ngram", "--json"],
        capture_output=True, text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["tokens"]) == 4
    bad = subprocess.run([sys.executable, "-m", "mlx_engine", "generate", "--model", "/nope", "--prompt", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "model not found" in bad.stderr


def test_the_summary_line_says_plain_decoding_instead_of_an_empty_acceptance(dirs, capsys, monkeypatch):
    import mlx_engine.cli as cli

    engines = []
    real = cli.Engine
    monkeypatch.setattr(cli, "Engine", lambda *a, **kw: engines.append(real(*a, **kw)) or engines[-1])
    common = ["generate", "--model", dirs["target"], "--prompt-tokens", "1,2,3,1,2,3,1,2,3", "--max-tokens", "12",
              "--ignore-eos"]
    assert main(common) == 0
    assert "| no drafts (plain decoding) |" in capsys.readouterr().err
    assert main(common + ["--drafter", "ngram", "--num-draft", "2"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    if engines[-1].stats.drafted:  # whether the n-gram found a match depends on what the model generates
        assert "acceptance " in summary and "tokens/verify" in summary and "no drafts" not in summary
    else:
        assert "| no drafts |" in summary
