"""`convert` keeps the head of any model that has one (a native head in the shards, a head trained here
beside an MLX folder as the embedded default has, a head in its own mtp.safetensors shard), quantized to
--mtp-bits; `--mtp-from` adds a head to an existing conversion or takes one from another checkpoint; every
bad input is one `error:` line with exit status 2, found before any output is written."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import model_dirs
from hf_writer import write_checkpoint
from mlx_engine.__main__ import main
from mlx_engine.drafters.mtp import trained
from mlx_engine.drafters.vocab_subset import SUBSET_KEY
from mlx_engine.models import load
from real_fixtures import write_real
from test_mtp_helpers import PROMPT

ARGS = ["--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "24", "--ignore-eos", "--json"]


def generate(capsys, model, *extra) -> dict:
    code = main(["generate", "--model", str(model), *ARGS, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def convert(capsys, *args) -> tuple[int, str]:
    code = main(["convert", *map(str, args)])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def with_trained_head(tmp_path_factory):
    """An MLX llama folder with a head trained here beside it (mtp.safetensors, family trained, a draft
    vocabulary): the embedded default's layout."""
    folder = model_dirs.save_tiny(tmp_path_factory.mktemp("default") / "smol", "llama", seed=0)
    m = load(str(folder))
    mx.random.seed(0)
    head = trained.build(m.model)
    arrays = dict(tree_flatten(head.parameters()))
    arrays[SUBSET_KEY] = mx.arange(0, 320, 2, dtype=mx.int32)
    meta = {"format": "mlx-engine-mtp-v1", "family": "trained", "target": "llama", "num_layers": "1",
            "quantization": "", "vocab_subset": "160"}
    mx.save_safetensors(str(folder / "mtp.safetensors"), arrays, metadata=meta)
    (folder / "mtp.json").write_text(json.dumps(meta))
    return folder


def test_the_embedded_defaults_trained_head_is_kept(with_trained_head, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mlx_engine.models.default_model", lambda: str(with_trained_head))
    code, err = convert(capsys, "--mlx-path", tmp_path / "q", "-q", "--q-group-size", "32")  # no --hf-path
    assert code == 0, err
    info = json.loads((tmp_path / "q" / "mtp.json").read_text())
    assert info["family"] == "trained" and info["quantization"]["bits"] == 8 and info["vocab_subset"] == 160
    m = load(str(tmp_path / "q"))
    from mlx_engine.drafters.mtp import load_head

    head = load_head(m.model, m.path, m.config)
    assert any(isinstance(x, nn.QuantizedLinear) and x.bits == 8 for _, x in head.named_modules())
    assert head.vocab_subset is not None and head.vocab_subset.shape == (160,)
    plain = generate(capsys, tmp_path / "q", "--drafter", "none")
    spec = generate(capsys, tmp_path / "q", "--drafter", "mtp", "--num-draft", "2")
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0


def test_a_head_in_its_own_shard_is_kept(tmp_path, capsys):
    """Qwen3.6-35B-A3B-FP8 keeps its head in mtp.safetensors (named in the index; mlx-lm reads model*)."""
    write_real(tmp_path / "fp8", "qwen3_5_moe/fp8-per-expert")
    code, err = convert(capsys, "--hf-path", tmp_path / "fp8", "--mlx-path", tmp_path / "out", "--mtp-bits", "0")
    assert code == 0, err
    info = json.loads((tmp_path / "out" / "mtp.json").read_text())
    assert info["family"] == "qwen3_5_moe" and info["quantization"] is None
    assert generate(capsys, tmp_path / "out", "--drafter", "mtp")["tokens"] == \
        generate(capsys, tmp_path / "fp8", "--drafter", "none")["tokens"]


def test_mtp_from_adds_a_head_to_an_existing_conversion(tmp_path, capsys):
    orig = write_checkpoint(tmp_path / "orig", "deepseek_v3", seed=1, shards=2)
    code, err = convert(capsys, "--hf-path", orig, "--mlx-path", tmp_path / "q4", "-q", "--q-group-size", "32")
    assert code == 0, err
    for f in ("mtp.safetensors", "mtp.json"):  # as mlx-community publishes it: no head
        (tmp_path / "q4" / f).unlink()
    code, err = convert(capsys, "--mlx-path", tmp_path / "q4", "--mtp-from", orig)
    assert code == 0 and "8-bit" in err, err
    assert json.loads((tmp_path / "q4" / "mtp.json").read_text())["quantization"]["group_size"] == 32
    plain = generate(capsys, tmp_path / "q4", "--drafter", "none")
    assert generate(capsys, tmp_path / "q4", "--drafter", "mtp", "--num-draft", "2")["tokens"] == plain["tokens"]
    code, err = convert(capsys, "--mlx-path", tmp_path / "q4", "--mtp-from", orig)  # twice: refused
    assert code == 2 and "already has an MTP head" in err


def test_mtp_from_while_converting(tmp_path, capsys):
    nohead = write_checkpoint(tmp_path / "nohead", "mimo", seed=2, with_head=False,
                              head_file=tmp_path / "head.safetensors")
    code, err = convert(capsys, "--hf-path", nohead, "--mlx-path", tmp_path / "x")
    assert code == 2 and "--mtp-from" in err and not (tmp_path / "x").exists()
    code, err = convert(capsys, "--hf-path", nohead, "--mlx-path", tmp_path / "y", "--mtp-from", tmp_path / "head.safetensors")
    assert code == 0, err
    assert json.loads((tmp_path / "y" / "mtp.json").read_text())["family"] == "mimo"
    code, err = convert(capsys, "--hf-path", nohead, "--mlx-path", tmp_path / "z", "--allow-missing-head")
    assert code == 0 and "no MTP head" in err and not (tmp_path / "z" / "mtp.safetensors").exists()


def bad_sources(root):
    good = write_checkpoint(root / "good", "qwen3_5", seed=3)
    trunc = root / "trunc"
    shutil.copytree(good, trunc)
    with open(trunc / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    garbage = root / "garbage"
    shutil.copytree(good, garbage)
    (garbage / "config.json").write_text("{not json")
    unknown = root / "unknown"
    shutil.copytree(good, unknown)
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    shard = write_checkpoint(root / "shard", "qwen3_5", seed=3, shards=2)
    (shard / "model-00002-of-00002.safetensors").unlink()
    (root / "empty").mkdir()
    (root / "file.txt").write_text("hello")
    quantized = root / "quantized"
    assert main(["convert", "--hf-path", str(good), "--mlx-path", str(quantized), "-q", "--q-group-size", "32"]) == 0
    return good, [
        (["--hf-path", trunc], "truncated"),
        (["--hf-path", garbage], "config.json is not readable JSON"),
        (["--hf-path", unknown], "no_such_family"),
        (["--hf-path", shard], "model-00002-of-00002.safetensors"),
        (["--hf-path", root / "empty"], "no config.json"),
        (["--hf-path", root / "file.txt"], "is a file"),
        (["--hf-path", root / "nowhere" / "model"], "not found"),
        (["--hf-path", quantized, "-q"], "already quantized"),
        (["--hf-path", good, "--q-bits", "7"], "--q-bits"),
        (["--hf-path", good, "--q-group-size", "48"], "--q-group-size"),
        (["--hf-path", good, "--mtp-bits", "-1"], "--mtp-bits"),
        (["--hf-path", good, "--mtp-from", root / "no-head-here.safetensors"], "no-head-here.safetensors"),
    ]


def test_bad_inputs_are_one_line_errors_before_any_work(tmp_path, capsys):
    good, cases = bad_sources(tmp_path / "src")
    capsys.readouterr()
    for i, (args, words) in enumerate(cases):
        out = tmp_path / f"out{i}"
        code, err = convert(capsys, *args, "--mlx-path", out)
        assert code == 2 and err.startswith("error: ") and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not out.exists(), args
    (tmp_path / "exists").mkdir()
    (tmp_path / "a-file").write_text("")
    for target, words in ((tmp_path / "exists", "already exists"), (tmp_path / "a-file" / "out", "not writable")):
        code, err = convert(capsys, "--hf-path", good, "--mlx-path", target)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    # an invalid --mtp-bits is its error alone, without the low-bits warning first
    code, err = convert(capsys, "--hf-path", good, "--mlx-path", tmp_path / "out7", "--mtp-bits", "7")
    assert code == 2 and err == "error: --mtp-bits must be 0 (float) or one of 2, 3, 4, 5, 6, 8, got 7\n", err
