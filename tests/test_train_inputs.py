"""train-mtp, train-eagle3 and train-dflash: every bad input is ONE `error: ...` line naming the flag and the
file, exit status 2, and no traceback; what can be checked without the model is checked before it loads
(the loader is replaced by one that fails the test), the rest before any corpus is generated or encoded."""

import json

import mlx.core as mx
import numpy as np
import pytest

import model_dirs
import mlx_engine.models as models
import mlx_engine.train.corpus as corpus
import mlx_engine.train.dflash as dflash
import mlx_engine.train.eagle3 as eagle3
from mlx_engine.__main__ import main as cli_main
from mlx_engine.train.dflash import main as train_dflash
from mlx_engine.train.eagle3 import main as train_eagle3
from mlx_engine.train.mtp import main as train_mtp

TRAINERS = {"train-mtp": train_mtp, "train-eagle3": train_eagle3, "train-dflash": train_dflash}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "garbage.jsonl").write_text("not json {\n")
    (d / "wrong_form.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    (d / "ids_not_a_list.jsonl").write_text(json.dumps({"tokens": "1 2 3"}) + "\n")
    (d / "empty.jsonl").write_text("\n\n")
    (d / "big_ids.jsonl").write_text(json.dumps({"tokens": list(range(1, 12)) + [100000]}) + "\n")
    (d / "not_utf8.txt").write_bytes(b"\xff\xfe\x00 text")
    (d / "table.csv").write_text("a,b\n1,2\n")
    (d / "garbage.safetensors").write_bytes(np.random.default_rng(0).bytes(200))
    mx.save_safetensors(str(d / "tokens_only.safetensors"), {"tokens": mx.zeros((4,), mx.int32)})
    rows = [{"tokens": list(range(3, 3 + n))} for n in (20, 24, 30)]
    (d / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "a_file").write_text("not a folder")
    (d / "a_folder.jsonl").mkdir()
    ckpt = d / "broken_run" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{not json")
    return d


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the input must be refused before."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(models, "load", refuse)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_dirs.save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=2)


@pytest.fixture
def no_work(monkeypatch):
    """Generating or encoding a corpus fails the test: the input must be refused before the work."""

    def refuse(*a, **k):
        raise AssertionError("the work started before the bad input was refused")

    for module, name in ((corpus, "generate_corpus"), (corpus, "encode_sequences"), (eagle3, "encode_features"),
                         (dflash, "encode")):
        monkeypatch.setattr(module, name, refuse)


def one_error_line(capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), (words, err[0])
    assert "Traceback" not in err[0]
    return err[0]


# (trainer, argv after --out, words the error line must hold); {d} = the files' folder
BEFORE_LOAD = [
    ("train-mtp", ["--corpus", "{d}/missing.jsonl"], ["--corpus", "missing.jsonl", "no such file"]),
    ("train-mtp", ["--corpus", "{d}/garbage.jsonl"], ["--corpus", "garbage.jsonl", "line 1", "not JSON"]),
    ("train-mtp", ["--corpus", "{d}/wrong_form.jsonl"], ["wrong_form.jsonl", "line 1", "a row needs", "question"]),
    ("train-mtp", ["--corpus", "{d}/ids_not_a_list.jsonl"], ["ids_not_a_list.jsonl", "'tokens' must be a list"]),
    ("train-mtp", ["--corpus", "{d}/empty.jsonl"], ["empty.jsonl", "no rows"]),
    ("train-mtp", ["--corpus", "{d}/not_utf8.txt"], ["not_utf8.txt", "not UTF-8"]),
    ("train-mtp", ["--corpus", "{d}/table.csv"], ["table.csv", "unknown corpus format '.csv'"]),
    ("train-mtp", ["--corpus", "{d}/a_folder.jsonl"], ["a_folder.jsonl", "is a folder"]),
    ("train-mtp", ["--corpus", "{d}/garbage.safetensors"], ["garbage.safetensors", "not a readable .safetensors"]),
    ("train-mtp", ["--corpus", "{d}/tokens_only.safetensors"], ["tokens_only.safetensors", "no hidden, offsets"]),
    ("train-mtp", ["--prompts", "{d}/missing.jsonl"], ["--prompts", "missing.jsonl", "no such file"]),
    ("train-mtp", ["--prompts", "{d}/wrong_form.jsonl"], ["--prompts", "wrong_form.jsonl", "\"prompt\" string"]),
    ("train-eagle3", ["--corpus", "{d}/missing.jsonl"], ["--corpus", "missing.jsonl", "no such file"]),
    ("train-eagle3", ["--corpus", "{d}/garbage.jsonl"], ["--corpus", "garbage.jsonl", "not JSON"]),
    ("train-eagle3", ["--corpus", "{d}/tokens_only.safetensors"], ["tokens_only.safetensors", ".jsonl/.txt"]),
    ("train-eagle3", ["--prompts", "{d}/garbage.jsonl"], ["--prompts", "garbage.jsonl", "not JSON"]),
    ("train-dflash", ["--corpus", "{d}/missing.jsonl"], ["--corpus", "missing.jsonl", "no such file"]),
    ("train-dflash", ["--corpus", "{d}/wrong_form.jsonl"], ["--corpus", "wrong_form.jsonl", "a row needs"]),
    ("train-dflash", ["--corpus", "{d}/good.jsonl,{d}/garbage.safetensors"], ["garbage.safetensors", ".jsonl/.txt"]),
    ("train-dflash", ["--seq-len", "8", "--block", "8"], ["--seq-len 8", "--block + 3 = 11"]),
]


@pytest.mark.parametrize("trainer, argv, words", BEFORE_LOAD)
def test_bad_files_are_refused_before_the_model_loads(trainer, argv, words, files, tmp_path, no_model, capsys):
    out = tmp_path / "out"
    argv = [a.format(d=files) for a in argv]
    assert TRAINERS[trainer](["--out", str(out), "--steps", "2", *argv]) == 2
    one_error_line(capsys, *words)
    assert not out.exists()  # nothing written either


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("where, words", [("{d}/a_file/out", ["a_file is a file, not a folder"]),
                                          ("{d}/a_file", ["is a file, not a folder"])])
def test_an_unwritable_out_is_refused_before_the_model_loads(trainer, where, words, files, no_model, capsys):
    out = where.format(d=files)
    assert TRAINERS[trainer](["--out", out, "--corpus", str(files / "good.jsonl"), "--steps", "2"]) == 2
    one_error_line(capsys, "--out", out, *words)


@pytest.mark.parametrize("trainer", ["train-mtp", "train-eagle3"])
def test_a_broken_checkpoint_to_resume_is_refused_before_the_model_loads(trainer, files, no_model, capsys):
    run = files / "broken_run"
    assert TRAINERS[trainer](["--out", str(run), "--corpus", str(files / "good.jsonl"), "--resume"]) == 2
    one_error_line(capsys, "--resume", "state.json", "cannot be read")


# bad counts and numbers: argparse's one line, before anything
COUNTS = [("train-mtp", f, v) for f, v in (("--steps", "-1"), ("--batch", "0"), ("--seq-len", "1"),
                                           ("--gen-tokens", "0"), ("--lr", "nan"), ("--vocab-subset", "x"))] + \
         [("train-eagle3", f, v) for f, v in (("--ttt", "0"), ("--ttt-decay", "0"), ("--ttt-decay", "1.5"),
                                              ("--encode-batch", "0"), ("--batch", "-2"))] + \
         [("train-dflash", f, v) for f, v in (("--block", "1"), ("--batch", "0"), ("--anchors", "0"),
                                              ("--steps", "-1"), ("--layers", "a,b"), ("--layers", "-1"),
                                              ("--minutes", "inf"), ("--vocab-subset", "0"))]


@pytest.mark.parametrize("trainer, flag, value", COUNTS)
def test_bad_counts_are_one_error_line(trainer, flag, value, tmp_path, no_model, capsys):
    assert TRAINERS[trainer](["--out", str(tmp_path / "out"), flag, value]) == 2
    one_error_line(capsys, f"argument {flag}", repr(value))


@pytest.mark.parametrize("trainer, argv, words", [
    ("train-mtp", ["--corpus", "{d}/big_ids.jsonl"], ["big_ids.jsonl line 1", "token id 100000", "vocabulary"]),
    ("train-eagle3", ["--corpus", "{d}/big_ids.jsonl"], ["big_ids.jsonl line 1", "token id 100000"]),
    ("train-dflash", ["--corpus", "{d}/big_ids.jsonl", "--layers", "0,1"], ["big_ids.jsonl line 1", "token id 100000"]),
    ("train-dflash", ["--corpus", "{d}/good.jsonl", "--layers", "1,10"], ["--layers 1,10", "layers 0..1"]),
    ("train-dflash", ["--corpus", "{d}/good.jsonl", "--layers", "0,1", "--batch", "4", "--seq-len", "16"],
     ["--corpus", "3 sequences", "fewer than --batch 4"]),
    ("train-mtp", ["--corpus", "{d}/stored_other_model.safetensors"], ["stored_other_model", "hidden states of size 8",
                                                                        "another model"]),
])
def test_what_needs_the_model_is_refused_before_the_work(trainer, argv, words, files, tiny, no_work, capsys):
    if "stored_other_model" in argv[1]:  # a train-mtp corpus written for a model of another hidden size
        corpus.save_corpus(files / "stored_other_model.safetensors",
                           [(np.arange(3, 9, dtype=np.int32), np.zeros((6, 8), np.float16))])
    argv = [a.format(d=files) for a in argv]
    out = files / f"out-{trainer}"
    assert TRAINERS[trainer](["--model", str(tiny), "--out", str(out), "--steps", "2", *argv]) == 2
    one_error_line(capsys, *words)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_missing_model_is_one_line_through_the_cli(trainer, files, tmp_path, capsys):
    argv = [trainer, "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
            "--corpus", str(files / "good.jsonl"), "--steps", "2"]
    assert cli_main(argv) == 2
    one_error_line(capsys, "model not found", "no-model")
