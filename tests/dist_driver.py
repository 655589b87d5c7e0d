"""One rank of a sharded run in the tests: `python tests/dist_driver.py SPEC.json OUT_DIR`, on every rank.

SPEC: {"model", "mode", optional "draft_model" / "mtp_weights" / "eagle3" / "dflash", "timeout", "runs": [...]}
Each run: {"name", "drafter", "num_draft", "temp", "seed", "max_tokens", "prompt", optional "top_p",
"repetition_penalty", "schema" (a JSON schema: the run is constrained by it), "close_after" (rank 0 stops reading after that many steps), "die_after" /
"hang_after" (rank 1 kills / stops itself after that many steps), "one_process" (rank 0 also decodes
it with the unsharded model in this process)}. Each rank writes OUT_DIR/rank{r}.json: per run the
tokens it emitted, the collectives it counted, its host reads, cycles, drafts; rank 0 also the
one-process tokens, and "logits": the largest difference between the sharded and the one-process logits
of the first prompt (and the top-2 gap of the one-process logits where greedy tokens first differ).
"""

import json
import os
import signal
import sys
from pathlib import Path

import mlx_engine  # noqa: F401  (OpenBLAS first)
import mlx.core as mx

from mlx_engine import host
from mlx_engine.core.engine import Engine, GenerationConfig
from mlx_engine.distributed import DistributedEngine, init, load_sharded
from mlx_engine.drafters import registry
from mlx_engine.drafters.registry import DrafterOptions
from mlx_engine.grammar import grammar_tokenizer, json_schema
from mlx_engine.models import load
from mlx_engine.sampling import SamplingConfig


def config(run: dict, loaded) -> GenerationConfig:
    sampling = SamplingConfig(temperature=run.get("temp", 0.0), top_p=run.get("top_p", 1.0),
                              repetition_penalty=run.get("repetition_penalty", 1.0))
    grammar = None
    if "schema" in run:  # structured output: built on every rank, as a server's request would be
        eos = list(loaded.tokenizer.eos_token_ids)
        grammar = json_schema(run["schema"], grammar_tokenizer(loaded.tokenizer, loaded.vocab_size, eos))
    return GenerationConfig(max_tokens=run.get("max_tokens", 16), num_draft=run.get("num_draft", 3),
                            sampling=sampling, seed=run.get("seed", 0), grammar=grammar,
                            stop_tokens=frozenset(loaded.tokenizer.eos_token_ids) if grammar else frozenset())


def make_drafter(spec: dict, kind: str, loaded):
    parts = kind.split("+")
    opts = DrafterOptions(draft_model=spec.get("draft_model") if "draft" in parts else None,
                          mtp_weights=spec.get("mtp_weights") if "mtp" in parts else None,
                          eagle3=spec.get("eagle3") if "eagle3" in parts else None,
                          dflash=spec.get("dflash") if "dflash" in parts else None)
    return registry.make_drafter(kind, loaded, opts)


def gap_at_first_difference(model, prompt: list[int], ours: list[int], theirs: list[int]):
    """Where two greedy outputs first differ: the top-2 gap of `model`'s logits there (a float tie is ~1e-6)."""
    j = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if j is None:
        return None
    logits = model(mx.array([prompt + theirs[:j]]))[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return {"position": j, "gap": top[1] - top[0]}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    group = init()
    rank = group.rank()
    loaded = load_sharded(spec["model"], spec["mode"], group)
    one = load(spec["model"]) if rank == 0 else None
    result = {"runs": {}, "rank": rank, "size": group.size()}
    prompt0 = spec["runs"][0]["prompt"]
    probe = DistributedEngine(loaded.model, None, group=group, timeout=spec.get("timeout", 30))
    sharded_logits, _ = probe.target.forward(mx.array(prompt0), probe.target.make_cache())
    mx.eval(sharded_logits)
    if rank == 0:
        ref = one.model(mx.array([prompt0]))[0]
        result["logits"] = {"max_abs_diff": mx.abs(ref - sharded_logits).max().item()}
    for run in spec["runs"]:
        kind = run.get("drafter", "none")
        drafter = make_drafter(spec, kind, loaded) if rank == 0 else None
        engine = DistributedEngine(loaded.model, drafter, group=group, timeout=spec.get("timeout", 30))
        tokens, reads0, steps = [], host.counts["read"], 0
        gen = engine.generate(run["prompt"], config(run, loaded))
        for step in gen:
            tokens += step.tokens
            steps += 1
            if rank == 1 and run.get("die_after") == steps:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and run.get("hang_after") == steps:
                os.kill(os.getpid(), signal.SIGSTOP)
            if rank == 0 and run.get("close_after") == steps:
                gen.close()
                break
        s = engine.stats
        entry = {"tokens": tokens, "collectives": engine.last_collectives, "reads": host.counts["read"] - reads0,
                 "cycles": s.cycles, "drafted": s.drafted, "accepted": s.accepted, "steps": steps,
                 "generated": s.generated, "forced": s.forced, "text": loaded.tokenizer.decode([t for t in tokens if t not in loaded.tokenizer.eos_token_ids]),
                 "target_key": engine._target_key.tolist()}  # where its key sequence is
        if rank == 0 and run.get("one_process"):
            ref = Engine(one.model, make_drafter(spec, kind, one) if kind != "none" else None)
            ref_tokens = [t for st in ref.generate(run["prompt"], config(run, one)) for t in st.tokens]
            entry["one_process"] = ref_tokens
            entry["gap"] = gap_at_first_difference(one.model, run["prompt"], tokens, ref_tokens)
        result["runs"][run["name"]] = entry
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from mlx_engine.distributed import DistributedError

    try:
        sys.exit(main())
    except DistributedError as e:  # as the commands report it
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
