"""Depth-1 greedy acceptance of MTP head files on held-out prompts, without running the engine.

    python -m mlx_engine.train.heldout_acceptance HEAD.safetensors [HEAD2 ...] [--prompts mlx_engine/train/data/prompts_eval.jsonl]
        [--max-tokens 96] [--cache /tmp/heldout.safetensors]

At temperature 0 a depth-1 draft is accepted iff the head's argmax (over its draft vocabulary) from
(Emb(t_{p+1}), h_p), with the head's cache over every earlier slot built from the target's true hidden
states (the engine re-evaluates accepted slots), equals the target's greedy token t_{p+2}. So one causal
pass of the head over prompt + greedy answer gives exactly the engine's depth-1 acceptance (up to
float16 storage of the hidden states), in seconds instead of minutes of decoding. Counted: drafts of
answer tokens 2.. (the first answer token comes from the prefill).

`--eagle3 DIR [...]`: EAGLE-3 checkpoints, measured per depth 1..--depth the same way: the training-time-test
unroll (train/eagle3.py `unroll`, tested equal to the drafter's run-time draft logits) over the whole
sequence, fed the target's greedy tokens; a depth-j draft counts as accepted iff the drafts of depths
1..j all equal the target's greedy tokens (what the engine accepts at temperature 0 in a cycle that
starts at that slot). Printed: P(accepted at depth j) over every anchor slot that has a depth-j target.
"""

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"  # prompts and corpora, shipped as package data


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("heads", nargs="*", help="MTP head files (depth 1)")
    p.add_argument("--eagle3", nargs="*", default=[], help="EAGLE-3 checkpoint folders (per depth)")
    p.add_argument("--depth", type=int, default=4, help="depths measured for --eagle3")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default=str(DATA / "prompts_eval.jsonl"))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--cache", default="/tmp/heldout.safetensors", help="greedy answers + hidden states, reused")
    p.add_argument("--answers", default=None, help="a .jsonl of prompt_ids + response_ids rows measured instead of "
                   "--prompts' greedy answers (e.g. answers decoded under a grammar: train/make_corpus_json.py); a "
                   "draft is accepted iff it is the answer's own token (under a grammar: the masked argmax)")
    p.add_argument("--grammar-prompts", default=None,
                   help="with --answers: the rows (bench json-suite form, matched by id) whose grammars split the "
                        "count into positions the grammar forces (drafted by the grammar itself) and free ones (where "
                        "the head drafts under a grammar)")
    a = p.parse_args(argv)

    import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    import numpy as np

    from mlx_engine.models.default import default_model_path
    from mlx_engine.drafters.mtp import load_mtp_drafter
    from mlx_engine.models import load
    from mlx_engine.target_model.model import Target
    from mlx_engine.train.corpus import _hidden, generate_corpus, read_corpus, save_corpus

    m = load(a.model or str(default_model_path()))
    target = Target(m.model)
    tok = m.tokenizer
    cache = Path(a.cache)
    if a.answers:
        rows = [json.loads(x) for x in open(a.answers) if x.strip()]
        ids = [r["prompt_ids"] for r in rows]
        answers = [(np.array(r["prompt_ids"][-1:] + r["response_ids"]), None) for r in rows]
    else:
        prompts = [json.loads(x)["prompt"] for x in open(a.prompts) if x.strip()]
        ids = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in prompts]
        if cache.exists():
            answers = read_corpus(cache)
        else:
            answers = generate_corpus(target, ids, a.max_tokens, 0.0, len(ids), set(tok.eos_token_ids))
            save_corpus(cache, answers)
    # full sequences (prompt + answer) and the target's hidden states over them, one pass each
    seqs = []
    for pr, (t, _) in zip(ids, answers):
        full = list(pr[:-1]) + [int(x) for x in t]  # t starts with the last prompt token
        h = _hidden(target, mx.array(full, dtype=mx.int32)[None], None)[0]
        greedy = mx.argmax(target.lm_head(h), axis=-1)
        mx.eval(h, greedy)
        # the reference at slot p: the token p + 1 the target chose (an answer's own token under a grammar)
        seqs.append((full, len(pr), h, np.array(full[1:] + [-1]) if a.answers else np.array(greedy)))
    free = forced_positions(m, a.answers, a.grammar_prompts) if a.grammar_prompts else None
    for path in a.heads:
        drafter = load_mtp_drafter(m.model, m.path, m.config, mtp_weights=path)
        layer = drafter.head.layers[0]
        hits = n = 0
        split = {True: [0, 0], False: [0, 0]}  # free?: [accepted, drafted]
        for j, (full, n_prompt, h, greedy) in enumerate(seqs):
            x = mx.array(full[1:], dtype=mx.int32)  # slot p: (t_{p+1}, h_p)
            out = layer(drafter._embed(x), h[:-1], drafter.head.make_cache()[0])
            draft = np.array(mx.argmax(drafter._logits(0, out, []), axis=-1))
            # slot p drafts t_{p+2}; the target's choice there is greedy[p+1]. Answer tokens from the 2nd on:
            # p + 2 >= n_prompt + 1
            lo, hi = n_prompt - 1, len(full) - 2
            ok = draft[lo:hi] == greedy[lo + 1 : hi + 1]
            hits += int(ok.sum())
            n += hi - lo
            if free is not None:  # slot p drafts answer token p + 2 - n_prompt
                for q, good in zip(free[j][1:], ok):
                    split[q][0] += int(good)
                    split[q][1] += 1
        line = f"{path}: depth-1 acceptance {hits / n:.3f} over {n} drafts"
        if free is not None:
            line += "".join(f"; {name} {a_ / max(d, 1):.3f} over {d}" for name, (a_, d) in
                            (("free", split[True]), ("forced", split[False])))
        print(line, flush=True)
    for path in a.eagle3:
        print(f"{path}: " + eagle3_per_depth(path, m, target, seqs, a.depth), flush=True)
    return 0


def forced_positions(m, answers: str, grammar_prompts: str) -> list[list[bool]]:
    """Per answer row: for each answer token, True where the grammar forced nothing before it (a free
    position, where a model drafter drafts under a grammar), False inside a forced run."""
    from mlx_engine.bench.structured import load_structured

    by_id = {r["id"]: r for r in (json.loads(x) for x in open(grammar_prompts) if x.strip())}
    stop = set(m.tokenizer.eos_token_ids)
    rows = [json.loads(x) for x in open(answers) if x.strip()]
    out = []
    for r, sp in zip(rows, load_structured("json", [by_id[r["id"]] for r in rows], m)):  # one grammar tokenizer
        matcher, free = sp.grammar.matcher(False), []
        for t in r["response_ids"]:
            free.append(not matcher.forced())
            if t not in stop:
                matcher.consume([t])
        out.append(free)
    return out


def eagle3_per_depth(path, m, target, seqs, depth: int) -> str:
    import mlx.core as mx
    import numpy as np

    from mlx_engine.drafters.eagle3 import load_eagle3_drafter
    from mlx_engine.train.eagle3 import encode_features, unroll

    drafter = load_eagle3_drafter(path, m.model)
    head, req = drafter.head, drafter.hidden_request
    ids = np.array(head.target_ids())
    hits, n = np.zeros(depth), np.zeros(depth)
    for full, n_prompt, _, greedy in seqs:
        [(_, feats)] = encode_features(target, [full], [0], req)
        N = len(full)
        f = mx.array(feats).astype(mx.float32)[None]
        # step j of anchor p is fed t_{p+j+1}: the sequence's tokens (greedy answer), padded at the end
        toks = np.array(full + [0] * depth)
        es = mx.stack([drafter._embed(mx.array(toks[j + 1 : j + 1 + N]))[None] for j in range(depth)])
        draft = [ids[np.array(mx.argmax(s[0], axis=-1))] for s in unroll(head, f, es)]
        ok = np.ones(N, dtype=bool)
        for j in range(depth):
            ok &= np.concatenate([draft[j][: N - 1 - j] == greedy[1 + j :], np.zeros(1 + j, bool)])
            lo, hi = n_prompt - 1, N - 2 - j  # anchors whose depth-j target is an answer token from the 2nd on
            if hi > lo:
                hits[j] += ok[lo:hi].sum()
                n[j] += hi - lo
    return "  ".join(f"depth {j + 1}: {hits[j] / n[j]:.3f} ({int(n[j])})" for j in range(depth) if n[j])


if __name__ == "__main__":
    sys.exit(main())
