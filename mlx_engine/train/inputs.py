"""The trainers' inputs checked before any work: the output folder, the corpus files, the prompts file.

Every check raises `TrainInputError` with one line naming the flag, the file and what is wrong; the
commands print it as `error: ...` and exit with status 2. The checks read files only (no model, no
tokenizer): they run before the model loads and long before a corpus is generated or encoded. What
needs the model (token ids inside its vocabulary, a corpus's hidden size) is checked right after it
loads (`check_token_ids`, `check_hidden_size`), still before the work.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".jsonl", ".txt")
CORPUS_KEYS = {"tokens": "ids", "prompt_ids": "ids", "response_ids": "ids", "prompt": "str", "response": "str",
               "text": "str"}
ROW_FORMS = "tokens, prompt_ids+response_ids, prompt+response or text"
SAFETENSORS_CORPUS = ("tokens", "hidden", "offsets")


class TrainInputError(ValueError):
    """A flag or file a trainer cannot use; reported as one `error:` line, exit status 2."""


def writable_dir(path: str | Path, flag: str = "--out", shown: str | Path | None = None) -> Path:
    """The output folder, created if needed, with a file written and removed there to prove it can hold
    the results (a read-only place, a path under a file, a full disk: refused now, not after the run).
    `shown`: the path the error names (the file asked for, when `path` is its folder)."""
    out = Path(path).expanduser()
    shown = out if shown is None else shown
    in_the_way = next((a for a in (out, *out.parents) if a.exists() and not a.is_dir()), None)
    if in_the_way is not None:
        raise TrainInputError(f"{flag} {shown}: {in_the_way} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise TrainInputError(f"{flag} {shown}: cannot write there ({e.strerror or e})") from None
    return out


def _existing_file(path: str | Path, flag: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise TrainInputError(f"{flag} {p}: no such file")
    if not p.is_file():
        raise TrainInputError(f"{flag} {p}: is a folder, not a file")
    try:
        with p.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise TrainInputError(f"{flag} {p}: cannot be read ({e.strerror or e})") from None
    return p


def _read_text(p: Path, flag: str) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrainInputError(f"{flag} {p}: not UTF-8 text (byte {e.start})") from None


def _json_rows(p: Path, flag: str):
    """(line number, object) for every non-blank line of a .jsonl file."""
    for n, line in enumerate(_read_text(p, flag).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise TrainInputError(f"{flag} {p} line {n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise TrainInputError(f"{flag} {p} line {n}: expected a JSON object, got {type(row).__name__}")
        yield n, row


def _row_form(row: dict) -> tuple[str, ...] | None:
    for form in (("tokens",), ("prompt_ids", "response_ids"), ("prompt", "response"), ("text",)):
        if all(k in row for k in form):
            return form
    return None


def _check_field(value, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_jsonl_corpus(p: Path, flag: str = "--corpus") -> int:
    """Every row of a .jsonl corpus has one of the forms the trainers read; returns the row count."""
    rows = 0
    for n, row in _json_rows(p, flag):
        form = _row_form(row)
        if form is None:
            keys = ", ".join(sorted(row)) or "none"
            raise TrainInputError(f"{flag} {p} line {n}: a row needs {ROW_FORMS} (its keys: {keys})")
        for key in form:
            if not _check_field(row[key], CORPUS_KEYS[key]):
                want = "a list of token ids" if CORPUS_KEYS[key] == "ids" else "a string"
                raise TrainInputError(f"{flag} {p} line {n}: '{key}' must be {want}")
        rows += 1
    if not rows:
        raise TrainInputError(f"{flag} {p}: no rows")
    return rows


def safetensors_keys(p: Path, flag: str = "--corpus") -> dict:
    """The tensors (name -> {dtype, shape, ...}) a .safetensors file's header declares, read without
    loading it; a file that is not one is refused."""
    try:
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > min(p.stat().st_size - 8, 100 * 2**20):
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, ValueError, struct.error) as e:
        raise TrainInputError(f"{flag} {p}: not a readable .safetensors file ({e})") from None
    return {k: v for k, v in header.items() if k != "__metadata__"}


def check_corpus_files(files: list[str], safetensors: bool = True, flag: str = "--corpus") -> list[Path]:
    """Each corpus file exists and holds what its suffix says: a .safetensors corpus written by
    train-mtp (tokens, hidden, offsets; only where `safetensors`), .jsonl rows of a known form, or .txt
    text. Returns the paths."""
    paths = []
    for f in files:
        p = _existing_file(f, flag)
        if p.suffix == ".safetensors":
            if not safetensors:
                raise TrainInputError(
                    f"{flag} {p}: a train-mtp corpus holds only the final hidden state; this trainer reads "
                    ".jsonl/.txt corpora (the target re-encodes them to read its layer features)")
            missing = [k for k in SAFETENSORS_CORPUS if k not in safetensors_keys(p, flag)]
            if missing:
                raise TrainInputError(f"{flag} {p}: not a train-mtp corpus (no {', '.join(missing)} tensor)")
        elif p.suffix == ".jsonl":
            check_jsonl_corpus(p, flag)
        elif p.suffix == ".txt":
            if not _read_text(p, flag).strip():
                raise TrainInputError(f"{flag} {p}: empty")
        else:
            kinds = ".safetensors, .jsonl or .txt" if safetensors else ".jsonl or .txt"
            raise TrainInputError(f"{flag} {p}: unknown corpus format {p.suffix or '(no suffix)'!r} (expected {kinds})")
        paths.append(p)
    return paths


def read_prompts(path: str | Path, flag: str = "--prompts") -> list[str]:
    """The prompts of a .jsonl file of {"prompt": "..."} rows (at least one)."""
    p = _existing_file(path, flag)
    prompts = []
    for n, row in _json_rows(p, flag):
        if not isinstance(row.get("prompt"), str):
            raise TrainInputError(f"{flag} {p} line {n}: a row needs a \"prompt\" string")
        prompts.append(row["prompt"])
    if not prompts:
        raise TrainInputError(f"{flag} {p}: no prompts")
    return prompts


def check_checkpoint(folder: Path, files=("head.safetensors", "optimizer.safetensors")) -> None:
    """A checkpoint `--resume` would read is whole: state.json with its step, the arrays' files readable
    (no checkpoint at all is fine: the run starts afresh, and says so)."""
    state = folder / "state.json"
    if not state.exists():
        return
    try:
        step = json.loads(state.read_text()).get("step")
    except (OSError, ValueError, AttributeError) as e:
        raise TrainInputError(f"--resume: {state} cannot be read ({e})") from None
    if not isinstance(step, int) or step < 0:
        raise TrainInputError(f"--resume: {state} holds no step count")
    for name in files:
        if not (folder / name).is_file():
            raise TrainInputError(f"--resume: {folder / name} is missing (an incomplete checkpoint)")
        safetensors_keys(folder / name, "--resume")


def check_token_ids(ids, vocab: int, where: str) -> None:
    """Token ids of a corpus row (or a whole stored corpus) lie in the model's vocabulary."""
    ids = np.asarray(ids, dtype=np.int64)
    outside = ids[(ids < 0) | (ids >= vocab)]
    if outside.size:
        raise TrainInputError(f"{where}: token id {int(outside[0])} outside the model's vocabulary (0..{vocab - 1})")


def check_hidden_size(seqs, hidden: int | None, where: str) -> None:
    """A stored corpus's hidden states have the model's hidden size (it was written for this model);
    `hidden` None: the model does not say, nothing to check."""
    for _, h in seqs[:1] if hidden else ():
        if h.ndim != 2 or h.shape[1] != hidden:
            raise TrainInputError(f"{where}: hidden states of size {h.shape[-1]}, the model's are {hidden} "
                                  "(a corpus written for another model)")
