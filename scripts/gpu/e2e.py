"""End to end on a GPU (issue 30): 128 greedy tokens of a random Llama-3-8B-shaped model (4-bit, bf16) on a
repetitive prompt, mlx-lm plain against the engine's paths (stock, fixed-row passes, the kernels), each plain
and with n-gram drafts at k = 2, 4; every output checked against its own path's plain output and mlx-lm's.
Each path prints as it finishes and e2e.json under --out is rewritten after it (a timeout keeps the rest).

    source .gpu/setup.sh; python3 scripts/gpu/e2e.py --out $OUT [--paths stock,fixed,kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.getcwd())

from mlx_engine import Engine, GenerationConfig, NgramDrafter  # noqa: E402
from mlx_engine.bench.shapes import build  # noqa: E402

TOKENS = 128
MODES = {"stock": False, "fixed": "fixed", "kernels": "kernels"}


def mlx_lm_plain(model, prompt):
    from mlx_lm.generate import generate_step

    toks, t1 = [], None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=TOKENS):
        toks.append(int(tok))
        if t1 is None:
            t1 = time.perf_counter()
    return toks, (TOKENS - 1) / (time.perf_counter() - t1)


def run_path(model, mode, prompt, reference):
    """Plain and n-gram k = 2, 4 over one patched model, three rounds; the last round is reported."""
    engines = {k: Engine(model, None if k == 0 else NgramDrafter(), batch_invariant=mode) for k in (0, 2, 4)}
    rows, plain = {}, None
    for rnd in range(3):
        for k, eng in engines.items():
            cfg = GenerationConfig(max_tokens=TOKENS, num_draft=k, reuse_cache=False)
            toks = [t for st in eng.generate(prompt, cfg) for t in st.tokens]
            plain = toks if k == 0 else plain
            if rnd == 2:
                st = eng.stats.to_dict()
                rows[f"k={k}"] = dict(decode_tok_s=st.get("decode_tps"), drafted=st.get("drafted"),
                                      accepted=st.get("accepted"), equal_to_plain=toks == plain,
                                      equal_to_mlx_lm=toks == reference)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--paths", default="stock,fixed,kernels", help="comma-separated: stock, fixed, kernels")
    args = ap.parse_args()
    print("MLX", mx.__version__, mx.default_device(), flush=True)
    res = {}

    def save():
        with open(os.path.join(args.out, "e2e.json"), "w") as f:
            json.dump(res, f, indent=1)

    model = build("llama-8b")
    vocab = model.args.vocab_size
    prompt = [int(t) for t in mx.random.randint(0, vocab, (16,), key=mx.random.key(9)).tolist()] * 4
    for _ in range(2):
        mlx_lm_plain(model, prompt)
    reference, tps = mlx_lm_plain(model, prompt)
    res["mlx_lm_plain_tok_s"] = tps
    print(f"mlx-lm plain: {tps:.1f} tok/s", flush=True)
    save()
    for i, path in enumerate(p for p in args.paths.split(",") if p):
        if i and MODES[path]:  # a patched model stays patched: each invariant path gets a fresh copy
            model = build("llama-8b")
        t0 = time.perf_counter()
        res[path] = run_path(model, MODES[path], prompt, reference)
        if path == "fixed":
            res[path]["plan"] = getattr(model, "_fixed_rows_plan", None)
        for name, row in res[path].items():
            print(path, name, row, flush=True)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        save()


if __name__ == "__main__":
    main()
