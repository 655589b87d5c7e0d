"""A long prompt's prefill with each drafter against none, paired (issue 39's "<= 1.15x" goal).

    .venv/bin/python scripts/prefill_paired.py [LENGTH=4000] [MODES=none,mtp] [REPEATS=2] [EAGLE3_DIR]

The agent session of LENGTH tokens (bench/agent_session.py) fed alone into a fresh BatchEngine (what `serve`
runs) per mode, the modes alternated REPEATS times in one process (this machine's speed moves up to ~14%
between runs: across separate runs one mode's figures are not comparable). Printed per run: the time to
the session's first token and the time until its drafter drafts (its prompt fed to the drafter too).
"""

import sys
import time

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
from mlx_engine.bench.longctx import encode, sized_session
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.drafters.registry import DrafterOptions, make_drafter
from mlx_engine.models import load
from mlx_engine.models.default import default_model_path


def main(length: int, modes: list[str], repeats: int, eagle3: str | None) -> None:
    m = load(str(default_model_path()))
    tok = m.tokenizer
    long = encode(tok, sized_session(tok, length)["messages"])
    for _ in range(repeats):
        for mode in modes:
            drafter = None if mode == "none" else make_drafter(mode, m, DrafterOptions(
                eagle3=eagle3 if "eagle3" in mode else None))
            engine = BatchEngine(m.model, drafter, prefix_cache_bytes=0)
            engine.add("long", long, 4)
            t0, first = time.perf_counter(), None
            while True:
                outs = engine.step()
                if first is None and any(o.seq_id == "long" and o.tokens for o in outs):
                    first = time.perf_counter() - t0
                if first is not None and not engine.prefilling():
                    break
            print(f"{mode:10s} {len(long)} tokens: first token {first:.2f} s, drafting at "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 4000, (a[1] if len(a) > 1 else "none,mtp").split(","),
         int(a[2]) if len(a) > 2 else 2, a[3] if len(a) > 3 else None)
