"""Step times around a short request that joins a long row decoding its last tokens (issue 39's maxima).

    .venv/bin/python scripts/turn_end_steps.py [LENGTH=4000]

A BatchEngine (what `serve` runs), prefix tree on (4 GB) and off: the agent session of LENGTH tokens is fed
alone until its first token, then a "hi" request joins while it decodes its last 5 tokens. Printed per
step: (seconds, rows after the step, rows that finished in it). The first steps after the join are the join
itself (the long row copied into a two-row cache) and the short prompt fed beside the decoding long row
(padded to the chunk's width at the long row's depth).
"""

import sys
import time

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
from mlx_engine.bench.longctx import encode, sized_session
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.models import load
from mlx_engine.models.default import default_model_path


def main(length: int) -> None:
    m = load(str(default_model_path()))
    tok = m.tokenizer
    long = encode(tok, sized_session(tok, length)["messages"])
    short = encode(tok, [{"role": "user", "content": "hi"}])
    for tree_gb in (4.0, 0.0):
        eng = BatchEngine(m.model, None, prefix_cache_bytes=int(tree_gb * 2**30))
        eng.add("long", long, 6)
        while not any(o.seq_id == "long" and o.tokens for o in eng.step()):
            pass
        eng.add("short", short, 40)
        log = []
        while eng.running():
            t = time.perf_counter()
            outs = eng.step()
            log.append((round(time.perf_counter() - t, 3), len(eng.seqs), [o.seq_id for o in outs if o.finished]))
        print(f"prefix tree {tree_gb:g} GB, long row {len(long)} tokens: {log[:8]}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
