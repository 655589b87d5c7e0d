"""Settings that persist between runs: <config dir>/settings.json.

The config dir is $MLX_ENGINE_CONFIG_DIR when set (tests point it at a temporary folder), else
$XDG_CONFIG_HOME/mlx-engine, else the platform's user config dir (~/.config/mlx-engine on Linux,
~/Library/Application Support/mlx-engine on macOS).
"""

import json
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar

APP_NAME = "mlx-engine"
from mlx_engine.drafters.registry import KINDS as DRAFTERS  # noqa: E402


def config_dir() -> Path:
    if os.environ.get("MLX_ENGINE_CONFIG_DIR"):
        return Path(os.environ["MLX_ENGINE_CONFIG_DIR"]).expanduser()
    if os.environ.get("XDG_CONFIG_HOME"):
        return Path(os.environ["XDG_CONFIG_HOME"]).expanduser() / APP_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_NAME
    return Path.home() / ".config" / APP_NAME


def settings_path() -> Path:
    return config_dir() / "settings.json"


K_MAX = 16
K_ORDER = ("auto", *range(1, K_MAX + 1))  # what F3 / F4 step through: below 1 is auto


def step_k(k: int | str, delta: int) -> int | str:
    """The draft length one F3 (delta -1) or F4 (+1) press away: auto, 1, 2, ..., 16, held at the ends."""
    i = K_ORDER.index(k) if k in K_ORDER else 0
    return K_ORDER[max(0, min(len(K_ORDER) - 1, i + delta))]


@dataclass
class Settings:
    # any registry kind; the default measured fastest on the chat and edit suites (bench/results/*-v3.json);
    # a model without an MTP head falls back to ngram
    drafter: str = "ngram+mtp"
    draft_model: str | None = None
    num_draft: int | str = "auto"  # k, or "auto" (drafts k = 1 from the first cycle, then what measures fastest)
    temperature: float = 0.0
    speculation: bool = True  # off = plain decoding (k = 0), toggled live
    color_drafts: bool = False  # off: Markdown; on: plain text with accepted-draft tokens coloured
    max_tokens: int = 1024
    restored: ClassVar[dict] = {}  # (per instance, set by load) settings read from the file that differ from the defaults

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            self.drafter = "ngram"
        if self.num_draft != "auto":
            try:
                self.num_draft = max(1, min(K_MAX, int(self.num_draft)))
            except (TypeError, ValueError):
                self.num_draft = "auto"
        try:
            self.temperature = max(0.0, min(2.0, round(float(self.temperature), 2)))
        except (TypeError, ValueError):
            self.temperature = 0.0
        try:
            self.max_tokens = max(1, int(self.max_tokens))
        except (TypeError, ValueError):
            self.max_tokens = 1024
        self.speculation = bool(self.speculation)
        self.color_drafts = bool(self.color_drafts)

    @classmethod
    def load(cls, path: Path | None = None) -> "Settings":
        """Read settings; a missing or broken file gives the defaults (never raises)."""
        path = path or settings_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        if not isinstance(data, dict):
            return cls()
        known = {f.name for f in fields(cls)}
        settings, default = cls(**{k: v for k, v in data.items() if k in known}), cls()
        settings.restored = {f.name: getattr(settings, f.name) for f in fields(cls)
                             if f.name in data and getattr(settings, f.name) != getattr(default, f.name)}
        return settings

    def save(self, path: Path | None = None) -> str | None:
        """Write settings; returns an error message instead of raising."""
        path = path or settings_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
            tmp.replace(path)
        except OSError as e:
            return f"could not save settings to {path}: {e}"
        return None
