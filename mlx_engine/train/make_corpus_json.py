"""The target's own JSON answers to schema-extraction prompts, each decoded under its grammar: a corpus for
`train-mtp --corpus` (rows with prompt_ids + response_ids; the target re-encodes them).

    python -m mlx_engine.train.make_corpus_json --out corpus_json.jsonl [--prompts mlx_engine/train/data/prompts_json_train.jsonl]
        [--max-tokens 256] [--temp 0] [--limit N] [--minutes M]

Prompts are built exactly as `python -m mlx_engine.bench --suite json` builds its own (bench/structured.py
load_structured: the schema shown in the system message, the grammar from the response_format), and each
answer is decoded by the engine with the grammar drafting its forced tokens (lossless: the answer the target
writes under the grammar). Rows are appended as they finish, so an interrupted run keeps what it made, and a
run started again skips the prompts already answered.
"""

import argparse
import json
import sys
import time
from pathlib import Path

DATA = Path(__file__).parent / "data"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=str(DATA / "prompts_json_train.jsonl"))
    p.add_argument("--out", required=True, help=".jsonl written row by row")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--minutes", type=float, default=0.0)
    a = p.parse_args(argv)

    import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
    from mlx_engine.bench.structured import load_structured
    from mlx_engine.core.engine import Engine, GenerationConfig
    from mlx_engine.models import load
    from mlx_engine.models.default import default_model_path
    from mlx_engine.sampling import SamplingConfig

    m = load(a.model or str(default_model_path()))
    rows = [json.loads(x) for x in open(a.prompts) if x.strip()]
    if a.limit:
        rows = rows[: a.limit]
    out = Path(a.out)
    done = {json.loads(x)["id"] for x in open(out) if x.strip()} if out.exists() else set()
    stop = frozenset(m.tokenizer.eos_token_ids)
    engine = Engine(m.model, None)
    todo = [(i, r) for i, r in enumerate(rows) if r["id"] not in done]
    prompts = load_structured("json", [r for _, r in todo], m)  # one grammar tokenizer for all rows
    t0, n_tok = time.time(), 0
    with open(out, "a") as f:
        for (i, r), sp in zip(todo, prompts):
            cfg = GenerationConfig(max_tokens=a.max_tokens, sampling=SamplingConfig(temperature=a.temp),
                                   seed=a.seed + i, stop_tokens=stop, grammar=sp.grammar, grammar_drafts=True)
            answer = [t for step in engine.generate(sp.tokens, cfg) for t in step.tokens]
            n_tok += len(answer)
            f.write(json.dumps({"id": r["id"], "temp": a.temp, "prompt_ids": sp.tokens, "response_ids": answer,
                                "response": m.tokenizer.decode([t for t in answer if t not in stop])}) + "\n")
            f.flush()
            el = time.time() - t0
            print(f"{i + 1}/{len(rows)}  {n_tok} tokens  {n_tok / el:.1f} tok/s  {el / 60:.1f} min", flush=True)
            if a.minutes and el > a.minutes * 60:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
