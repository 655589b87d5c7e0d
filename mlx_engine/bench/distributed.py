"""`python -m mlx_engine.bench distributed`: plain and speculative decoding of one target in 1 process and
sharded across 2 (or 4) processes, at several link latencies: decode tok/s and collectives per token.

The ranks run on this machine over MLX's ring backend on loopback, started as mlx.launch starts them (a
ring hostfile, MLX_RANK); a latency > 0 delays every send() on the link by that many milliseconds, through
a small LD_PRELOAD library compiled here with the system's C compiler (Linux; a real link between Macs has
its own). Per cell, rank 0 reports the median over trials of decode tok/s, collectives per generated token
(its own: the model's and the engine's), tokens per verify pass (E) and acceptance; plain and speculative
runs alternate inside a cell so a drift of the machine's load favours neither.

Default target: a random deepseek_v3 (8 layers, hidden 256, 8 experts, vocab 8192; built once in the
cache folder), whose greedy output repeats itself, so prompt lookup (ngram, the default drafter) drafts
well there: this measures what the link does to each mode, not a real model's acceptance.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..args import ArgumentParser, count, fail, float_list, int_list, interrupted

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
static ssize_t (*real_send)(int, const void *, size_t, int);
static long delay_us = -1;
ssize_t send(int fd, const void *buf, size_t len, int flags) {
    if (!real_send) real_send = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    if (delay_us < 0) { const char *e = getenv("MLX_ENGINE_LINK_DELAY_US"); delay_us = e ? atol(e) : 0; }
    if (delay_us > 0) { struct timespec t = {delay_us / 1000000, (delay_us % 1000000) * 1000}; nanosleep(&t, 0); }
    return real_send(fd, buf, len, flags);
}
"""
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8]
BENCH_MODEL = dict(model_type="deepseek_v3", vocab_size=8192, hidden_size=256, num_hidden_layers=8,
                   intermediate_size=512, moe_intermediate_size=128, num_attention_heads=8, num_key_value_heads=8,
                   n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0,
                   kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
                   topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
                   moe_layer_freq=1, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=4096)


def _cache() -> Path:
    from ..models.default import cache_dir

    return cache_dir() / "bench-distributed"


def shim_library() -> Path:
    """The LD_PRELOAD library that delays send() (compiled once)."""
    out = _cache() / "link_delay.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".c")
        src.write_text(SHIM)
        r = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-ldl"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot compile the link-delay library ({r.stderr.strip()[:300]})")
    return out


def bench_model() -> Path:
    """The default target: a random deepseek_v3 folder (MLX layout, weight index, a word-level tokenizer)."""
    folder = _cache() / "random-deepseek_v3"
    if (folder / "config.json").exists():
        return folder
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_cls, args_cls = _get_classes(BENCH_MODEL)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(BENCH_MODEL))
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(BENCH_MODEL["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0", "unk_token": "t0"}))
    save_config(dict(BENCH_MODEL), folder / "config.json")  # last: its presence means the folder is complete
    return folder


# -- one rank ----------------------------------------------------------------------------------------
def worker(spec: dict, out: Path) -> int:
    """One rank of a cell: plain and speculative generations, alternating; rank 0 writes the results."""
    from ..core.engine import Engine, GenerationConfig
    from ..drafters.registry import DrafterOptions, make_drafter

    n = spec["processes"]
    if n > 1:
        from ..distributed import DistributedEngine, init, load_sharded

        group = init()
        rank = group.rank()
        loaded = load_sharded(spec["model"], spec["mode"], group)
    else:
        from ..models import load

        rank, loaded = 0, load(spec["model"])
    engines = {}
    for mode in ("plain", "spec"):
        drafter = None
        if mode == "spec" and rank == 0:
            drafter = make_drafter(spec["drafter"], loaded, DrafterOptions(draft_model=spec.get("draft_model")))
        if n > 1:
            engines[mode] = DistributedEngine(loaded.model, drafter, group=group)
        else:
            engines[mode] = Engine(loaded.model, drafter)
    k = spec["num_draft"]
    results = {"plain": [], "spec": []}
    for trial in range(spec["trials"] + 1):  # the first: a warm-up, not kept
        for mode in (("plain", "spec") if trial % 2 == 0 else ("spec", "plain")):
            cfg = GenerationConfig(max_tokens=spec["max_tokens"] if trial else 8, num_draft=0 if mode == "plain" else k,
                                   reuse_cache=False)
            engine = engines[mode]
            for _ in engine.generate(spec["prompt"], cfg):
                pass
            s = engine.stats
            if trial:
                per_token = getattr(s, "collectives_per_token", 0.0)
                results[mode].append({"tok_s": s.decode_tps, "collectives_per_token": per_token,
                                      "E": s.mean_accepted_length, "acceptance": s.acceptance_rate,
                                      "generated": s.generated})
    if rank == 0:
        out.write_text(json.dumps(results))
    return 0


# -- the cells -----------------------------------------------------------------------------------------
def run_cell(spec: dict, n: int, delay_ms: float, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "spec.json").write_text(json.dumps({**spec, "processes": n}))
        env = {**os.environ, "MLX_ENGINE_DIST_BACKEND": "ring"}
        if n > 1:
            import socket

            socks = [socket.socket() for _ in range(n)]
            for s in socks:
                s.bind(("127.0.0.1", 0))
            hosts = [[f"127.0.0.1:{s.getsockname()[1]}"] for s in socks]
            for s in socks:
                s.close()
            (tmp / "hosts.json").write_text(json.dumps(hosts))
            env["MLX_HOSTFILE"] = str(tmp / "hosts.json")
        if delay_ms > 0:
            env["LD_PRELOAD"] = str(shim_library())
            env["MLX_ENGINE_LINK_DELAY_US"] = str(int(delay_ms * 1000))
        cmd = [sys.executable, "-m", "mlx_engine.bench.distributed", "--worker", str(tmp / "spec.json"),
               str(tmp / "out.json")]
        procs = [subprocess.Popen(cmd, env={**env, "MLX_RANK": str(r)}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for r in range(n)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the cell with {n} processes and {delay_ms} ms did not finish in {timeout:.0f} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if procs[0].returncode != 0 or not (tmp / "out.json").exists():
            raise RuntimeError(f"rank 0 of the cell ({n} processes, {delay_ms} ms) failed: "
                               f"{procs[0].stderr.read()[-1500:]}")
        return json.loads((tmp / "out.json").read_text())


def summarize(n: int, delay: float, mode: str, trials: list[dict], plain: list[dict] | None) -> dict:
    med = {k: statistics.median(t[k] for t in trials) for k in ("tok_s", "collectives_per_token", "E", "acceptance")}
    row = {"processes": n, "link_delay_ms": delay, "mode": mode, **{k: round(v, 3) for k, v in med.items()}}
    if plain:
        row["speedup"] = round(statistics.median(s["tok_s"] / p["tok_s"] for s, p in zip(trials, plain)), 3)
    return row


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'procs':>5} {'delay ms':>8} {'mode':>6} {'tok/s':>8} {'coll/tok':>8} {'E':>5} {'accept':>6} "
          f"{'vs plain':>8}")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        print(f"{r['processes']:>5} {r['link_delay_ms']:>8g} {r['mode']:>6} {r['tok_s']:>8.1f} "
              f"{r['collectives_per_token']:>8.2f} {r['E']:>5.2f} {r['acceptance']:>6.2f} {sp:>8}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(json.loads(Path(argv[1]).read_text()), Path(argv[2]))
    ap = ArgumentParser(prog="python -m mlx_engine.bench distributed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target folder or hub id (default: a random deepseek_v3, see --help's intro)")
    ap.add_argument("--distributed", default="pipeline", choices=("pipeline", "tensor"), help="sharding (pipeline)")
    ap.add_argument("--drafter", default="ngram", help="drafter of the speculative runs (ngram)")
    ap.add_argument("--draft-model", help="the draft model for --drafter draft")
    ap.add_argument("--num-draft", default="4", help="k per cycle, or auto (4)")
    ap.add_argument("--processes", type=int_list(1), default=[1, 2], help="process counts (1,2)")
    ap.add_argument("--latencies", type=float_list(0.0), default=[0.0, 2.0],
                    help="extra delay of every send() on the link, in ms (0,2); 1 process has no link")
    ap.add_argument("--max-tokens", type=count(2), default=64, help="tokens per generation (64)")
    ap.add_argument("--trials", type=count(1), default=3, help="timed trials per cell, after a warm-up (3)")
    ap.add_argument("--timeout", type=count(10), default=600, help="seconds a cell may take (600)")
    ap.add_argument("--out", help="write the rows as JSON here too")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return e.code
    k = args.num_draft if args.num_draft == "auto" else int(args.num_draft) if args.num_draft.isdigit() else None
    if k is None:
        return fail(f"--num-draft must be an integer >= 0 or auto, got {args.num_draft!r}")
    if args.drafter == "draft" and not args.draft_model:
        return fail("--drafter draft needs --draft-model PATH")
    try:
        model = args.model or str(bench_model())
        if any(d > 0 for d in args.latencies) and max(args.processes) > 1:
            shim_library()
        spec = {"model": model, "mode": args.distributed, "drafter": args.drafter, "draft_model": args.draft_model,
                "num_draft": k, "max_tokens": args.max_tokens, "trials": args.trials, "prompt": PROMPT}
        rows = []
        for n in args.processes:
            for delay in (args.latencies if n > 1 else [0.0]):
                print(f"{n} process{'es' if n > 1 else ''}, link delay {delay:g} ms ...", file=sys.stderr, flush=True)
                res = run_cell(spec, n, delay, args.timeout)
                rows.append(summarize(n, delay, "plain", res["plain"], None))
                rows.append(summarize(n, delay, "spec", res["spec"], res["plain"]))
    except RuntimeError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return interrupted()
    print_rows(rows)
    print(f"\n(target {model}, {args.distributed} sharding, drafter {args.drafter} k={args.num_draft}; "
          f"coll/tok: collectives rank 0 issued per generated token)")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
