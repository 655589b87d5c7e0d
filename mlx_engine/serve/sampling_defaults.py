"""The sampling a request gets for the values it does not name: the checkpoint's generation_config.json
(models/generation_config.py) over the server's own defaults (greedy, no penalties). A value the request names
wins, field by field (OpenAI, Responses and Anthropic bodies alike: Turn.named holds what the body set; a JSON
null is not naming it). `--no-generation-config` keeps the server's defaults."""

from __future__ import annotations

import dataclasses

from ..models.generation_config import SAMPLING_KEYS
from ..sampling import SamplingConfig


def checked(recommended: dict) -> tuple[dict, list[str]]:
    """The checkpoint's values the sampler takes, and a line per value it refuses (out of range): those are
    left at the server's default and said at start."""
    kept, refused = {}, []
    for key, value in recommended.items():
        try:
            SamplingConfig(**{key: value})
        except ValueError as e:
            refused.append(f"{key} {value}: {e}")
            continue
        kept[key] = value
    return kept, refused


def effective(recommended: dict) -> dict:
    """Every sampling value a request that names none gets: the server's default where the checkpoint names none."""
    server = SamplingConfig()
    return {key: recommended.get(key, getattr(server, key)) for key in SAMPLING_KEYS}


def apply(sampling: SamplingConfig, named, recommended: dict) -> SamplingConfig:
    """`sampling` with each recommended value the request did not name."""
    fill = {k: v for k, v in recommended.items() if k not in named}
    return dataclasses.replace(sampling, **fill) if fill else sampling
