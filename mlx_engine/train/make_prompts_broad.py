"""Broader training prompts from text that ships with Python itself: the standard library's source code
and docstrings, and the language reference (pydoc_data.topics). All of it is under the PSF licence and
on every machine that runs this, so the corpus stays offline and licence-clean.

    python -m mlx_engine.train.make_prompts_broad [--n 1600] [--seed 3]   # -> data/prompts_broad.jsonl

Kinds of prompt (what a chat model is asked in practice, and where a drafter meets long shared spans):
- code: explain a function, add a docstring, write a test, rewrite it with one small change (rename a
  variable, add type hints, turn a loop into a comprehension), find possible bugs;
- prose: summarise, simplify, list the key points of, or rewrite a paragraph of the reference or of a
  module docstring, or answer a question about it.
Functions of 6-40 lines and paragraphs of 200-900 characters; each source is used once.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

DATA = Path(__file__).parent / "data"

CODE_TASKS = [
    "Explain what this Python function does, step by step:\n\n```python\n{code}\n```",
    "Add a clear docstring to this function and return the whole function:\n\n```python\n{code}\n```",
    "Write two pytest tests for this function:\n\n```python\n{code}\n```",
    "Rewrite this function with type hints added. Keep everything else the same:\n\n```python\n{code}\n```",
    "Rename the variable `{var}` to `{new}` in this function and return the full code:\n\n```python\n{code}\n```",
    "What could go wrong with this function? List possible bugs or edge cases:\n\n```python\n{code}\n```",
    "Summarize in one sentence what this code is for:\n\n```python\n{code}\n```",
    "Rewrite this function so it is easier to read, without changing what it does:\n\n```python\n{code}\n```",
]
PROSE_TASKS = [
    "Summarize the following text in two or three sentences:\n\n{text}",
    "Explain this passage in simple words for a beginner:\n\n{text}",
    "List the key points of this text:\n\n{text}",
    "Rewrite this paragraph so it is shorter and clearer:\n\n{text}",
    "Read this text and write one question it answers, then answer it:\n\n{text}",
    "Fix any awkward wording in this paragraph and return the improved version:\n\n{text}",
]
NEW_NAMES = ["result", "value", "item", "data", "count", "total", "name", "key", "index", "buffer"]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "lib2to3", "site-packages", "turtledemo", "tkinter", "ensurepip", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(s in p.parts for s in skip))


def functions(path: Path) -> list[tuple[str, list[str]]]:
    """(source, local names) of the file's functions of 6-40 lines."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            n = node.end_lineno - node.lineno + 1
            if 6 <= n <= 40:
                code = ast.get_source_segment(src, node)
                if code and len(code) < 1800:
                    names = sorted({x.id for x in ast.walk(node) if isinstance(x, ast.Name)
                                    and isinstance(x.ctx, ast.Store) and len(x.id) > 1})
                    out.append((_dedent(code, node.col_offset), names, ast.get_docstring(node) is not None))
    return out


def _dedent(code: str, col: int) -> str:
    """get_source_segment gives the first line without its indentation and the others with it."""
    lines = code.splitlines()
    return "\n".join([lines[0]] + [line[col:] if line[:col].strip() == "" else line for line in lines[1:]])


def paragraphs(text: str) -> list[str]:
    out = []
    for para in text.split("\n\n"):
        p = " ".join(line.strip() for line in para.splitlines()).strip()
        wordy = sum(c.isalpha() or c.isspace() for c in p) / max(1, len(p))
        if 200 <= len(p) <= 900 and p[0].isalpha() and "::=" not in p and wordy > 0.9:
            out.append(p)
    return out


def prose_sources(files: list[Path]) -> list[str]:
    from pydoc_data import topics

    paras = [p for t in topics.topics.values() for p in paragraphs(t)]
    for path in files:
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            paras += paragraphs(doc)
    return sorted(set(paras))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1600, help="prompts to write (half code, half prose)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", default=str(DATA / "prompts_broad.jsonl"))
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    files = stdlib_files()
    funcs = [f for path in files for f in functions(path)]
    prose = prose_sources(files)
    rng.shuffle(funcs)
    rng.shuffle(prose)
    rows = []
    for i, (code, names, has_doc) in enumerate(funcs[: a.n // 2]):
        task = CODE_TASKS[i % len(CODE_TASKS)]
        if ("{var}" in task and not names) or ("docstring" in task and has_doc):
            task = CODE_TASKS[0]
        var = rng.choice(names) if names else ""
        new = next((n for n in rng.sample(NEW_NAMES, len(NEW_NAMES)) if n not in names), "renamed")
        rows.append({"prompt": task.format(code=code, var=var, new=new), "kind": "code"})
    for i, text in enumerate(prose[: a.n - len(rows)]):
        rows.append({"prompt": PROSE_TASKS[i % len(PROSE_TASKS)].format(text=text), "kind": "prose"})
    rng.shuffle(rows)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} prompts ({sum(r['kind'] == 'code' for r in rows)} code, from {len(funcs)} functions of "
          f"{len(files)} files; {sum(r['kind'] == 'prose' for r in rows)} prose, from {len(prose)} paragraphs) -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
