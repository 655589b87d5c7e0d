"""Loading models: a local folder (MLX or Hugging Face layout), a Hugging Face hub repo, or a GGUF file.

On the CPU, floating-point weights are cast to float32: MLX's CPU matmuls are fast only in fp32 with
OpenBLAS, and speculative decoding only pays there with fp32 weights (docs/getting-started.md, "On Linux CPU").
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .config import context_length  # noqa: F401  (the model's context window, from its config)


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message says why and what was tried."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    path: Path

    @property
    def context_length(self) -> int | None:
        """The model's context window (None when its config names none)."""
        return context_length(self.config)

    @property
    def vocab_size(self) -> int:
        """The model's output size (its config's; the tokenizer's when the config names none)."""
        return int((self.config.get("text_config") or self.config).get("vocab_size", 0)) or len(
            self.tokenizer.get_vocab())


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))


def resolve(path_or_repo: str) -> Path:
    """A local path as is, or a hub repo id downloaded (or found in the local hub cache)."""
    p = Path(path_or_repo).expanduser()
    if p.exists():
        return p
    if p.suffix == ".gguf" or not _looks_like_repo_id(path_or_repo):
        raise ModelLoadError(f"model not found: {path_or_repo} (no such file or folder)")
    import os

    from huggingface_hub import snapshot_download

    try:  # README.md: its front matter names the base model (a conversion's MTP head lives there)
        return Path(
            snapshot_download(
                path_or_repo, endpoint=os.environ.get("HF_ENDPOINT") or None,
                allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja",
                                "README.md"],
            )
        )
    except Exception as e:  # network errors, missing repo, gated repo...
        raise ModelLoadError(
            f"model not found: {path_or_repo} is not a local path and could not be fetched from the hub ({type(e).__name__}: {e})"
        ) from e


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Cast floating-point parameters (not quantized ones) to dtype."""

    def cast(x):
        return x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x

    model.update(tree_map(cast, model.parameters()))
    return model


def default_dtype() -> mx.Dtype | None:
    """float32 on CPU; keep the checkpoint's dtype on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def _could_not_load(path: Path, e: Exception) -> str:
    """The loader's message, prefixed with the model's path unless it names a file of the model already."""
    return str(e) if str(path) in str(e) else f"could not load {path}: {e}"


def default_model() -> str:
    """The embedded default, SmolLM2-135M-Instruct with its trained MTP head (built in the cache on first
    use: mlx_engine.models.default)."""
    from .default import default_model_path

    try:
        return str(default_model_path())
    except Exception as e:  # no registry reachable, a broken cache...
        raise ModelLoadError(f"the embedded default model is not available ({type(e).__name__}: {e}); "
                             f"pass a model path, hub id or .gguf file") from e


def load(path_or_repo: str | None = None, dtype: mx.Dtype | None | str = "auto", lazy: bool = False) -> LoadedModel:
    """Load model + tokenizer (None: the embedded default model). dtype: "auto" (fp32 on CPU), None (as
    stored) or an mx dtype."""
    from mlx_lm.utils import load_tokenizer

    from .hf import load_model  # mlx-lm's, with MTP tensors set aside before sanitize

    if dtype == "auto":
        dtype = default_dtype()
    path = resolve(default_model() if path_or_repo is None else path_or_repo)
    if path.is_file() and path.suffix == ".gguf":
        from .gguf import load_gguf

        try:
            model, tokenizer, config = load_gguf(path, dtype=dtype)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelLoadError(_could_not_load(path, e)) from e
        return LoadedModel(model, tokenizer, config, path)
    if path.is_file():
        raise ModelLoadError(f"{path} is a file but not a .gguf; expected a model folder or a GGUF file")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not a model folder")
    from .hf import check_complete, weight_files

    try:
        for f in weight_files(path):
            check_complete(f)
        model, config, _ = load_model(path, lazy=True)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        if dtype is not None:
            cast_floats(model, dtype)
        if not lazy:
            mx.eval(model.parameters())
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelLoadError(_could_not_load(path, e)) from e
    except RuntimeError as e:  # MLX's reader: a truncated or corrupt weights file
        raise ModelLoadError(f"could not load {path}: a weights file is truncated or corrupt ({e})") from e
    return LoadedModel(model, tokenizer, config, path)


def parameter_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
