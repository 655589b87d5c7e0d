"""Measure a trained head (MTP, EAGLE-3, DFlash, or any drafter kind) on held-out prompts
(mlx_engine/train/data/prompts_eval.jsonl) with the engine.

    python -m mlx_engine.train.eval_head [--drafter mtp|eagle3|ngram+mtp|...] [--head mtp.safetensors]
        [--eagle3 DIR] [--ks 1,2,3] [--temp 0] [--max-tokens 96] [--out results.json]

Per prompt, in one process and rotating the order: plain greedy decoding (num_draft=0) and MTP with
num_draft=k. Reports acceptance at depth 1 (accepted_at[0]/drafted_at[0], summed over prompts), mean
accepted length (tokens per verify pass incl. the bonus token), decode tok/s per mode (median over
prompts) and the median of the per-prompt speedups; checks that every MTP output equals plain greedy.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"  # prompts and corpora, shipped as package data


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--head", default=None, help="MTP head file (default: the one next to the model)")
    p.add_argument("--drafter", default="mtp", help="drafter kind (drafters/registry.py): mtp, eagle3, dflash, ngram+mtp, ...")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 checkpoint folder for --drafter eagle3 / ngram+eagle3")
    p.add_argument("--dflash", default=None, help="DFlash checkpoint folder for --drafter dflash")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (> 0: lossless in distribution only)")
    p.add_argument("--prompts", default=str(DATA / "prompts_eval.jsonl"))
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from mlx_engine import Engine, GenerationConfig, SamplingConfig
    from mlx_engine.drafters.registry import DrafterOptions, make_drafter
    from mlx_engine.models.default import default_model_path
    from mlx_engine.models import load

    path = a.model or str(default_model_path())
    m = load(path)
    drafter = make_drafter(a.drafter, m, DrafterOptions(mtp_weights=a.head, eagle3=a.eagle3, dflash=a.dflash))
    sub = getattr(drafter, "vocab_subset", None)
    print(f"drafter {a.drafter}: draft vocabulary {'full' if sub is None else sub.size}", flush=True)
    sampling = SamplingConfig(temperature=a.temp)
    prompts = [json.loads(x)["prompt"] for x in open(a.prompts) if x.strip()]
    if a.limit:
        prompts = prompts[: a.limit]
    ks = [int(k) for k in a.ks.split(",")]
    stop = frozenset(m.tokenizer.eos_token_ids)
    modes = [0] + ks
    res = {k: {"tps": [], "speedup": [], "d1": 0, "a1": 0, "gen": 0, "cycles": 0, "acc_at": [], "drafted_at": []}
           for k in modes}
    mismatches = 0
    subset = None if sub is None else set(sub.tolist())
    covered = [0, 0]
    plain_engine, mtp_engine = Engine(m.model), Engine(m.model, drafter)
    # warm-up (compile caches, allocator)
    ids0 = m.tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True)
    for k in modes:
        list((mtp_engine if k else plain_engine).generate(ids0, GenerationConfig(max_tokens=8, num_draft=k)))
    for i, q in enumerate(prompts):
        ids = m.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        outs, tps = {}, {}
        order = modes[i % len(modes):] + modes[: i % len(modes)]
        for k in order:
            eng = mtp_engine if k else plain_engine
            cfg = GenerationConfig(max_tokens=a.max_tokens, num_draft=k, stop_tokens=stop, sampling=sampling, seed=i)
            outs[k] = [t for s in eng.generate(ids, cfg) for t in s.tokens]
            st = eng.stats
            tps[k] = st.decode_tps
            r = res[k]
            r["tps"].append(st.decode_tps)
            r["gen"] += st.generated - 1
            r["cycles"] += st.cycles
            for j, (acc, dr) in enumerate(zip(st.accepted_at, st.drafted_at)):
                while len(r["acc_at"]) <= j:
                    r["acc_at"].append(0)
                    r["drafted_at"].append(0)
                r["acc_at"][j] += acc
                r["drafted_at"][j] += dr
        if subset is not None:
            covered[0] += sum(t in subset for t in outs[0][1:])
            covered[1] += len(outs[0]) - 1
        for k in ks:
            res[k]["speedup"].append(tps[k] / tps[0] if tps[0] else 0.0)
            if a.temp == 0 and outs[k] != outs[0]:
                mismatches += 1
        print(f"[{i + 1}/{len(prompts)}] {len(outs[0])} tokens  plain {tps[0]:.1f} tok/s  "
              + "  ".join(f"k={k} {tps[k]:.1f} tok/s" for k in ks), flush=True)
    summary = {"drafter": a.drafter, "temperature": a.temp, "prompts": len(prompts), "max_tokens": a.max_tokens, "lossless_mismatches": mismatches,
               "plain_tps_median": statistics.median(res[0]["tps"]),
               "subset_coverage_of_plain_output": round(covered[0] / covered[1], 4) if covered[1] else None}
    for k in ks:
        r = res[k]
        per_pos = [x / d if d else 0.0 for x, d in zip(r["acc_at"], r["drafted_at"])]
        summary[f"k{k}"] = {
            "acceptance_depth1": round(per_pos[0], 3) if per_pos else 0.0,
            "acceptance_per_position": [round(x, 3) for x in per_pos],
            "mean_accepted_length": round(r["gen"] / r["cycles"], 3) if r["cycles"] else 0.0,
            "tps_median": round(statistics.median(r["tps"]), 2),
            "speedup_median": round(statistics.median(r["speedup"]), 3),
        }
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
