"""mkdocs hooks for the manual (mkdocs.yml `hooks:`).

`<!-- mutants -->` on a page becomes the table of `make mutants`' deliberate bugs, read from
scripts/mutants.py's own list when the site is built, so the page never lists a mutant that is gone or
misses a new one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARKER = "<!-- mutants -->"
REPO = Path(__file__).resolve().parents[1]


def mutants():
    spec = importlib.util.spec_from_file_location("_mutants_for_docs", REPO / "scripts" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod.MUTANTS


def mutants_table() -> str:
    rows = mutants()
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [f"{len(rows)} mutants, as `make mutants ARGS=--list` lists them:", "",
             "| mutant | file | the bug | tests that must go red |", "|---|---|---|---|"]
    lines += [f"| `{m.name}` | `{m.file}` | {cell(m.bug)} | `{cell(' '.join(m.tests))}` |" for m in rows]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, mutants_table()) if MARKER in markdown else markdown
