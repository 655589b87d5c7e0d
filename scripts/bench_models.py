"""Two bench model folders of the architectures agents' models bring, random weights, with a tokenizer.

    .venv/bin/python scripts/bench_models.py OUT_DIR

OUT_DIR/hybrid  mlx-lm's qwen3_5 (a text_config of qwen3_5_text, the VLM checkpoints' layout): GatedDeltaNet
                layers with a full-attention layer every 4th, 16 layers, hidden 512, dense MLP;
OUT_DIR/window  gpt_oss: sliding-window (128) and full-attention layers alternating, 16 layers, hidden 512,
                8 experts (2 per token), attention sinks.

Both fp32, seeded, vocab 2048, saved with mlx_lm.utils.save_model / save_config beside a byte-level BPE
tokenizer (tests/model_dirs.py's save_tokenizer, its chat template) trained on the repository's own *.py and
*.md files, so the held-out prompts tokenize to a realistic number of tokens. Each folder loads with
`python -m mlx_engine serve --model DIR` and `python -m mlx_lm server --model DIR`. Random weights: tiny
stand-ins for the architectures (their caches, their step's shape), not real models; their greedy outputs
repeat, so prompt / suffix lookup finds drafts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import _get_classes, save_config, save_model  # noqa: E402
from model_dirs import save_tokenizer  # noqa: E402

VOCAB = 2048
SEED = 0
SKIP = ("__pycache__", "build", "dist", "node_modules")  # and hidden folders (.venv, .git), *.egg-info

HYBRID = dict(  # wrapped in a qwen3_5 config below, as tests/tiny_models.py's config() does
    model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=16, intermediate_size=1536,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
    rms_norm_eps=1e-6, tie_word_embeddings=False, vocab_size=VOCAB,
    rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
WINDOW = dict(
    model_type="gpt_oss", hidden_size=512, num_hidden_layers=16, intermediate_size=512, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 8, rms_norm_eps=1e-5, rope_theta=10000,
    vocab_size=VOCAB,
)
MODELS = {"hybrid": {"model_type": "qwen3_5", "text_config": HYBRID}, "window": WINDOW}


def corpus(root: Path = ROOT) -> list[str]:
    """The repository's own *.py and *.md files, in path order (hidden and build folders left out)."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith((".py", ".md")):
                out.append(Path(folder, name).read_text(encoding="utf-8", errors="replace"))
    return out


def save(path: Path, config: dict, texts: list[str]) -> Path:
    """A random fp32 model of `config` (seeded) and the tokenizer trained on `texts`, written into `path`."""
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(SEED)
    model = model_cls(args_cls.from_dict(config))
    model.eval()
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    save_tokenizer(path, VOCAB, texts)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/bench_models.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    texts = corpus()
    print(f"tokenizer corpus: {len(texts)} files, {sum(map(len, texts))} characters", flush=True)
    for name, config in MODELS.items():
        path = save(out / name, config, texts)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"{path}: {config['model_type']}, {size / 2**20:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
