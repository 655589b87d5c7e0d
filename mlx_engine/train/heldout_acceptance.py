"""Depth-1 greedy acceptance of MTP head files on held-out prompts, without running the engine.

    python -m mlx_engine.train.heldout_acceptance HEAD.safetensors [HEAD2 ...] [--prompts mlx_engine/train/data/prompts_eval.jsonl]
        [--max-tokens 96] [--cache /tmp/heldout.safetensors]

At temperature 0 a depth-1 draft is accepted iff the head's argmax (over its draft vocabulary) from
(Emb(t_{p+1}), h_p), with the head's cache over every earlier slot built from the target's true hidden
states (the engine re-evaluates accepted slots), equals the target's greedy token t_{p+2}. So one causal
pass of the head over prompt + greedy answer gives exactly the engine's depth-1 acceptance (up to
float16 storage of the hidden states), in seconds instead of minutes of decoding. Counted: drafts of
answer tokens 2.. (the first answer token comes from the prefill).
"""

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"  # prompts and corpora, shipped as package data


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("heads", nargs="+")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default=str(DATA / "prompts_eval.jsonl"))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--cache", default="/tmp/heldout.safetensors", help="greedy answers + hidden states, reused")
    a = p.parse_args(argv)

    import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    import numpy as np

    from mlx_engine.models.default import default_model_path
    from mlx_engine.drafters.mtp import load_mtp_drafter
    from mlx_engine.models import load
    from mlx_engine.target.model import Target
    from mlx_engine.train.corpus import _hidden, generate_corpus, read_corpus, save_corpus

    m = load(a.model or str(default_model_path()))
    target = Target(m.model)
    tok = m.tokenizer
    prompts = [json.loads(x)["prompt"] for x in open(a.prompts) if x.strip()]
    ids = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)) for q in prompts]
    cache = Path(a.cache)
    if cache.exists():
        answers = read_corpus(cache)
    else:
        answers = generate_corpus(target, ids, a.max_tokens, 0.0, len(ids), set(tok.eos_token_ids))
        save_corpus(cache, answers)
    # full sequences (prompt + answer) and the target's hidden states over them, one pass each
    seqs = []
    for pr, (t, _) in zip(ids, answers):
        full = pr[:-1] + t.tolist()  # t starts with the last prompt token
        h = _hidden(target, mx.array(full, dtype=mx.int32)[None], None)[0]
        greedy = mx.argmax(target.lm_head(h), axis=-1)
        mx.eval(h, greedy)
        seqs.append((full, len(pr), h, np.array(greedy)))
    for path in a.heads:
        drafter = load_mtp_drafter(m.model, m.path, m.config, mtp_weights=path)
        layer = drafter.head.layers[0]
        hits = n = 0
        for full, n_prompt, h, greedy in seqs:
            x = mx.array(full[1:], dtype=mx.int32)  # slot p: (t_{p+1}, h_p)
            out = layer(drafter._embed(x), h[:-1], drafter.head.make_cache()[0])
            draft = np.array(mx.argmax(drafter._logits(0, out, []), axis=-1))
            # slot p drafts t_{p+2}; the target's choice there is greedy[p+1]. Answer tokens from the 2nd on:
            # p + 2 >= n_prompt + 1
            lo, hi = n_prompt - 1, len(full) - 2
            hits += int((draft[lo:hi] == greedy[lo + 1 : hi + 1]).sum())
            n += hi - lo
        print(f"{path}: depth-1 acceptance {hits / n:.3f} over {n} drafts", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
