"""A checkpoint's recommended sampling, from its generation_config.json: temperature, top_p, top_k, min_p and the
repetition / presence / frequency penalties, as the values a request that names none of them gets (the server's
own defaults otherwise: greedy). Reasoning models loop without their recommended settings (Qwen3's card:
temperature 0.6, top_p 0.95, top_k 20; "DO NOT use greedy decoding"), and mlx-lm's server does not read the
file (mlx-lm PR #1031 was not merged); vLLM, mlx-vlm and mlx-openai-server do.

Hugging Face's rule is kept: `do_sample: false` means greedy whatever the file's temperature, top_p, top_k and
min_p say, so those are left out (the penalties stay: they act on greedy decoding too)."""

from __future__ import annotations

import json
import math
from pathlib import Path

FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
SAMPLED_ONLY = ("temperature", "top_p", "top_k", "min_p")  # inert under do_sample: false


def sampling_defaults(model_path) -> dict:
    """{key: number} of SAMPLING_KEYS the checkpoint's generation_config.json recommends ({} for a file-less
    model, a .gguf, an unreadable file). Values are as written; serve checks their ranges."""
    folder = Path(str(model_path))
    path = folder / FILE if folder.is_dir() else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    out = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[key] = int(value) if key == "top_k" else float(value)
    if config.get("do_sample") is False:
        out = {k: v for k, v in out.items() if k not in SAMPLED_ONLY}
    return out
