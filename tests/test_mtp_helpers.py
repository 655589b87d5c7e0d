"""Shared pieces of the MTP tests: checkpoints on disk (cached per session), loading, running."""

from pathlib import Path

import mlx.core as mx

from hf_writer import write_checkpoint
from mlx_engine import Engine, GenerationConfig
from mlx_engine.drafters.mtp import MTPDrafter, load_mtp_drafter
from mlx_engine.models.hf import load_model

PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 128, 64, 31, 2, 99, 150, 7, 8]


def engine_model(model):
    """The module the Engine drives: the loaded model itself (Target finds a wrapper's language model)."""
    return model


def load_hf(folder: Path):
    model, config, _ = load_model(folder)
    return model, config


def generate(model, drafter, k: int, n: int = 64, prompt=PROMPT) -> list[int]:
    out = []
    for step in Engine(engine_model(model), drafter).generate(prompt, GenerationConfig(max_tokens=n, num_draft=k)):
        out += step.tokens
    return out


class OracleMTP(MTPDrafter):
    """The real MTP drafter (head runs, caches fill, trims, re-evaluates), but each draft's logits come
    from the full target over the history + drafts so far: every draft is accepted at temperature 0."""

    def _logits(self, i, h, drafted):
        ctx = mx.concatenate([mx.array(self.history, dtype=mx.int32), *drafted])
        return self.target.model(ctx[None])[0, -1:] + 0 * h.sum()


def make(tmp_path_factory, family: str, **kw) -> Path:
    name = family + "".join(f"_{k}{v}" for k, v in sorted(kw.items()))
    folder = tmp_path_factory.getbasetemp() / "hf" / name
    if not (folder / "config.json").exists():
        write_checkpoint(folder, family, **kw)
    return folder
