"""Issue 30's training round: the files around the trainers, on the GPU and back here.

    python3 scripts/gpu/train_round.py prompts --out P.jsonl          # every training prompt file, one list
    python3 scripts/gpu/train_round.py pack C1.jsonl [C2 ...] --out corpus.npz
    python3 scripts/gpu/train_round.py unpack corpus.npz --out DIR    # DIR/corpus-<i>.jsonl, train-* --corpus

make_corpus writes each pass's answers as .jsonl (prompt_ids + response_ids + the decoded text) beside
its .safetensors (with the hidden states, GiBs at this scale: they stay on the GPU machine). `pack` keeps
only the token ids, uint16 (the vocabulary has 49,152 ids), compressed: what comes back through $OUT
(16 MiB a file) and what the next round carries to train EAGLE-3 and DFlash without generating again.
`unpack` gives the .jsonl rows the trainers read (`prompt_ids` + `response_ids`; the target re-encodes them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "mlx_engine" / "train" / "data"
PROMPT_FILES = ("prompts_train.jsonl", "prompts_train2.jsonl", "prompts_broad.jsonl")  # never prompts_eval


def merge_prompts(out: Path) -> int:
    seen, rows = set(), []
    for name in PROMPT_FILES:
        for line in (DATA / name).read_text().splitlines():
            if line.strip():
                q = json.loads(line)["prompt"]
                if q not in seen:
                    seen.add(q)
                    rows.append(json.dumps({"prompt": q}))
    out.write_text("\n".join(rows) + "\n")
    return len(rows)


def pack(files: list[Path], out: Path) -> tuple[int, int]:
    """Token ids of every row -> one .npz: per pass (file) and row, prompt and response lengths."""
    ids, lengths, passes = [], [], []
    for i, f in enumerate(files):
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            p, a = r["prompt_ids"], r["response_ids"]
            ids += p + a
            lengths.append((len(p), len(a)))
            passes.append(i)
    tokens = np.asarray(ids, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise SystemExit(f"error: a token id outside uint16 ({tokens.min()}..{tokens.max()}): not packed")
    np.savez_compressed(out, tokens=tokens.astype(np.uint16), lengths=np.asarray(lengths, dtype=np.int32),
                        passes=np.asarray(passes, dtype=np.int16),
                        names=np.asarray([f.name for f in files]))
    return len(lengths), int(sum(a for _, a in lengths))


def unpack(packed: Path, out: Path) -> list[Path]:
    z = np.load(packed)
    tokens, lengths, passes, names = z["tokens"].astype(np.int64), z["lengths"], z["passes"], z["names"]
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"corpus-{i}.jsonl" for i in range(len(names))]
    handles = [f.open("w") for f in files]
    at = 0
    for (n_p, n_a), i in zip(lengths, passes):
        p, a = tokens[at : at + n_p].tolist(), tokens[at + n_p : at + n_p + n_a].tolist()
        at += n_p + n_a
        handles[i].write(json.dumps({"prompt_ids": p, "response_ids": a}) + "\n")
    for h in handles:
        h.close()
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("prompts").add_argument("--out", type=Path, required=True)
    pk = sub.add_parser("pack")
    pk.add_argument("files", type=Path, nargs="+")
    pk.add_argument("--out", type=Path, required=True)
    up = sub.add_parser("unpack")
    up.add_argument("packed", type=Path)
    up.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.verb == "prompts":
        print(f"{merge_prompts(a.out)} prompts -> {a.out}")
    elif a.verb == "pack":
        rows, answer_tokens = pack(a.files, a.out)
        print(f"{rows} answers, {answer_tokens} answer tokens -> {a.out} ({a.out.stat().st_size / 2**20:.1f} MiB)")
    else:
        print(" ".join(str(f) for f in unpack(a.packed, a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
