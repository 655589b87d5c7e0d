"""`python -m mlx_engine cache [list|clear] [--dir DIR]`: what the prefix cache keeps on disk, and removing it.

    list    one line per model the folder holds entries for (its fingerprint, the model and drafter its
            manifest names, entries, bytes, the last use), then the total
    clear   remove the entries (all, or one fingerprint's with --fingerprint), and say how much was freed

The folder is the one `serve` uses (core/disk_prefix.py's default, MLX_ENGINE_CACHE_DIR, or --dir).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .core.disk_prefix import default_folder
from .target_model import disk_files


def add_cache_args(p) -> None:
    p.add_argument("action", nargs="?", default="list", choices=("list", "clear"),
                   help="list (default): what the folder holds; clear: remove it")
    p.add_argument("--dir", default=None, help=f"the prefix cache folder (default {default_folder()})")
    p.add_argument("--fingerprint", default=None, help="clear: only this model's entries (a name from list)")


def _models(folder: Path) -> list[dict]:
    out = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        entries = [p for p in sub.iterdir() if disk_files.parse_name(p.name)]
        stats = [p.stat() for p in entries]
        try:
            manifest = json.loads((sub / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = {}
        out.append({"fingerprint": sub.name, "model": manifest.get("model", "?"), "drafter": manifest.get("drafter"),
                    "entries": len(entries), "bytes": sum(s.st_size for s in stats),
                    "last_used": max((s.st_mtime for s in stats), default=None), "path": sub})
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def run_cache(args) -> int:
    folder = Path(args.dir).expanduser() if args.dir else default_folder()
    if not folder.is_dir():
        print(f"{folder}: no prefix cache here yet")
        return 0
    models = _models(folder)
    if args.action == "list":
        for m in models:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(m["last_used"])) if m["last_used"] else "-"
            print(f"{m['fingerprint']}  {m['model']:<14} drafter {str(m['drafter']):<10} {m['entries']:>6} entries  "
                  f"{_gib(m['bytes']):>10}  last used {used}")
        print(f"{folder}: {sum(m['entries'] for m in models)} entries, {_gib(sum(m['bytes'] for m in models))}")
        return 0
    chosen = [m for m in models if args.fingerprint in (None, m["fingerprint"])]
    if args.fingerprint and not chosen:
        print(f"error: {folder} holds no fingerprint {args.fingerprint!r} (see `python -m mlx_engine cache list`)")
        return 2
    for m in chosen:
        shutil.rmtree(m["path"], ignore_errors=True)
    print(f"removed {sum(m['entries'] for m in chosen)} entries, {_gib(sum(m['bytes'] for m in chosen))} "
          f"from {folder}")
    return 0
