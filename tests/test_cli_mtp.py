"""`--drafter mtp` and `convert` through the CLI, on a tiny qwen3_5 checkpoint in Hugging Face layout."""

import json

import pytest

from hf_writer import write_checkpoint
from mlx_engine.__main__ import main
from test_mtp_helpers import PROMPT

ARGS = ["--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "40", "--ignore-eos", "--temp", "0", "--json"]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_5", "qwen3_5", seed=3)


def generate(capsys, model, *extra):
    assert main(["generate", "--model", str(model), *ARGS, *extra]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_mtp_trace_equals_plain_decoding(qwen35, capsys):
    plain = generate(capsys, qwen35, "--drafter", "none")
    for k in ("1", "3"):
        spec = generate(capsys, qwen35, "--drafter", "mtp", "--num-draft", k, "--trace")
        assert spec["tokens"] == plain["tokens"]
        emitted = [t for entry in spec["trace"] for t in entry["emitted"]]
        assert [spec["tokens"][0]] + emitted == plain["tokens"]
        assert spec["stats"]["drafted"] > 0


def test_convert_then_generate(qwen35, tmp_path, capsys):
    out = tmp_path / "mlx"
    assert main(["convert", "--hf-path", str(qwen35), "--mlx-path", str(out)]) == 0
    assert (out / "mtp.safetensors").exists()
    plain = generate(capsys, qwen35, "--drafter", "none")
    spec = generate(capsys, out, "--drafter", "mtp", "--num-draft", "2")
    assert spec["tokens"] == plain["tokens"]


def test_mtp_on_model_without_head_is_a_clear_error(tmp_path, capsys):
    folder = write_checkpoint(tmp_path / "nohead", "qwen3_5", seed=3, with_head=False)
    assert main(["generate", "--model", str(folder), *ARGS, "--drafter", "mtp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "qwen3_5" in err and "Traceback" not in err
