"""Tiny models saved as MLX model folders with a tokenizer, for loading and CLI tests (no downloads)."""

import json
from pathlib import Path

from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tiny_models

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Speculative decoding drafts tokens and verifies them with the target model in one pass.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Once upon a time there was a small model that wanted to be fast.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(path: Path, vocab: int, corpus: list[str] = CORPUS) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"})
    )


def save_tiny(path: Path, family: str = "llama", seed: int = 0, vocab: int = 320, corpus: list[str] = CORPUS, **overrides) -> Path:
    """Write a tiny random model of `family` with a byte-level BPE tokenizer into `path`."""
    model, config = tiny_models.build(family, seed=seed, vocab=vocab, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    save_tokenizer(path, vocab, corpus)
    return path
