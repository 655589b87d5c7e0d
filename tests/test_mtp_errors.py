"""Clear errors: no head, unsupported family, a head file that does not fit; a separate head file."""

import pytest

import tiny_models
from hf_writer import write_checkpoint
from mlx_engine.drafters.mtp import (
    HeadMismatchError,
    MissingHeadError,
    MTPWeightsError,
    UnsupportedFamilyError,
    load_mtp_drafter,
)
from test_mtp_helpers import generate, load_hf, make
from reference import mlx_lm_greedy


def test_model_without_heads(tmp_path_factory):
    folder = make(tmp_path_factory, "deepseek_v3", with_head=False)
    model, config = load_hf(folder)
    with pytest.raises(MissingHeadError, match=r"deepseek_v3.*no MTP head weights.*--mtp-weights"):
        load_mtp_drafter(model, folder, config)
    assert issubclass(MissingHeadError, ValueError)


def test_unsupported_family(tmp_path):
    model, config = tiny_models.build("llama")
    with pytest.raises(UnsupportedFamilyError, match=r"'llama'.*supported: "):
        load_mtp_drafter(model, tmp_path, config)


def test_missing_weights_file(tmp_path_factory, tmp_path):
    folder = make(tmp_path_factory, "mimo")
    model, config = load_hf(folder)
    with pytest.raises(MissingHeadError, match="does not exist"):
        load_mtp_drafter(model, folder, config, mtp_weights=tmp_path / "nope.safetensors")


def test_separate_head_file(tmp_path):
    """A checkpoint without head + the head as a separate file (--mtp-weights): works, exact."""
    folder = write_checkpoint(tmp_path / "m", "qwen3_5", with_head=False, head_file=tmp_path / "head.safetensors")
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config, mtp_weights=tmp_path / "head.safetensors")
    assert generate(model, drafter, 2, n=32) == mlx_lm_greedy(model, [3, 17, 42, 9, 200, 11, 5, 77, 128, 64, 31, 2, 99, 150, 7, 8], 32)


def test_head_file_that_does_not_fit(tmp_path):
    folder = write_checkpoint(tmp_path / "m", "qwen3_5", with_head=False)
    # a head written for a model with a different width
    write_checkpoint(tmp_path / "other", "qwen3_5", with_head=False, head_file=tmp_path / "head.safetensors",
                     intermediate_size=96)
    model, config = load_hf(folder)
    with pytest.raises(HeadMismatchError, match=r"qwen3_5.*does not fit.*mlp"):
        load_mtp_drafter(model, folder, config, mtp_weights=tmp_path / "head.safetensors")


def test_head_file_of_another_family(tmp_path):
    folder = write_checkpoint(tmp_path / "m", "mimo", with_head=False)
    write_checkpoint(tmp_path / "other", "qwen3_5", with_head=False, head_file=tmp_path / "head.safetensors")
    model, config = load_hf(folder)
    with pytest.raises(MTPWeightsError, match="mimo"):
        load_mtp_drafter(model, folder, config, mtp_weights=tmp_path / "head.safetensors")
