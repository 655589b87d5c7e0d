"""`python -m mlx_engine.bench.batching`: aggregate throughput of continuous batching (core/batch_engine.py),
speculation on and off, for 1, 2, 4, 8 concurrent clients, measured in the engine itself (no HTTP).

Each of C clients sends R requests one after another (a chat prompt of bench/prompts, greedy, stopping at
EOS or --max-tokens); a client's next request joins the running batch as soon as its previous one ends,
so sequences join and leave between steps as in the server. Per cell: requests/s and aggregate tok/s
(completion tokens of all requests / wall time, prefill included). One BatchEngine per mode serves all
cells (its batch policy keeps what it measured, as a server does), after one warm-up request; the modes
run interleaved per cell, in alternating order, so a drift of the machine's load favours none.
Bounded: --max-seconds per cell (a cell cut short says so).
"""

from __future__ import annotations

import json
import sys
import time

from ..args import ArgumentParser, count, fail, int_list, interrupted
from ..drafters.registry import KINDS, DrafterError, make_drafter
from ..models import ModelLoadError
from .report import BenchInputError, writable_file


def run_cell(engine, prompts: list[list[int]], clients: int, per_client: int, max_tokens: int, stop, limit: float):
    todo = {c: list(range(per_client)) for c in range(clients)}
    nxt = 0
    tokens = done = 0
    drafted = accepted = 0
    t0 = time.perf_counter()

    def submit(c):
        nonlocal nxt
        todo[c].pop()
        engine.add((c, nxt), prompts[nxt % len(prompts)], max_tokens, stop_tokens=stop)
        nxt += 1

    for c in range(clients):
        submit(c)
    cut = False
    while engine.running():
        for out in engine.step():
            if out.finished:
                done += 1
                tokens += out.stats["completion_tokens"]
                drafted += out.stats["drafted"]
                accepted += out.stats["accepted"]
                c = out.seq_id[0]
                if todo[c] and not cut:
                    submit(c)
        if time.perf_counter() - t0 > limit and not cut:
            cut = True
            for s in list(engine.seqs):
                engine.cancel(s.id)
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": done, "tokens": tokens, "seconds": round(wall, 2),
            "requests_per_s": round(done / wall, 3), "tok_per_s": round(tokens / wall, 2),
            "acceptance": round(accepted / drafted, 3) if drafted else None, "cut_short": cut}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m mlx_engine.bench.batching", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model (default: the embedded one with its MTP head)")
    ap.add_argument("--drafter", default="mtp", choices=KINDS[1:], help="drafter for speculation on (default mtp)")
    ap.add_argument("--clients", type=int_list(1), default=[1, 2, 4, 8], help="concurrent clients (default 1,2,4,8)")
    ap.add_argument("--requests", type=count(1), default=2, help="requests per client (default 2)")
    ap.add_argument("--max-tokens", type=count(1), default=64, help="max tokens per request (default 64)")
    ap.add_argument("--modes", default="off,auto",
                    help="comma-separated: off, auto, or a fixed k, each optionally with ':inv' (batch-invariant "
                         "decoding, on a second copy of the model) (default off,auto)")
    ap.add_argument("--max-seconds", type=count(1), default=300, help="bound per cell (default 300)")
    ap.add_argument("--suite", default="chat", help="prompt suite in bench/prompts (default chat)")
    ap.add_argument("--repeats", type=count(1), default=1, help="rounds over all cells (default 1)")
    ap.add_argument("--json", help="write the results here too")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag (one `error:` line printed)
        return e.code
    modes = args.modes.split(",")
    for mode in modes:
        k, _, inv = mode.partition(":")
        if not (k in ("off", "auto") or k.isdigit()) or inv not in ("", "inv"):
            return fail(f"--modes: {mode!r} is not off, auto or a k >= 0, optionally with ':inv'")
    try:
        return run(args, modes)
    except (BenchInputError, ModelLoadError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return interrupted()


def drafter_for(kind: str, loaded):
    """The registry's drafter of `kind`; one the model cannot have (no MTP head, ...) is bad input."""
    try:
        return make_drafter(kind, loaded)
    except (DrafterError, ValueError, ImportError) as e:
        raise BenchInputError(f"--drafter {kind}: {e}") from None


def run(args, modes: list[str]) -> int:
    from ..core.batch_engine import BatchEngine
    from ..models import load
    from .suite import load_prompts, suite_file

    suite_file(args.suite)  # the cheap checks before the model loads
    if args.json:
        writable_file(args.json, "--json")
    loaded = load(args.model)
    prompts = load_prompts(args.suite, 16, loaded.tokenizer)
    stop = frozenset(getattr(loaded.tokenizer, "eos_token_ids", None) or ())
    copies = {"": (loaded, drafter_for(args.drafter, loaded))}  # the patch is in place: a copy for ':inv'
    engines = {}
    for mode in modes:
        k, _, inv = mode.partition(":")
        if inv not in copies:
            again = load(args.model)
            copies[inv] = (again, drafter_for(args.drafter, again))
        model, drafter = copies[inv][0].model, copies[inv][1]
        nd = 0 if k == "off" else ("auto" if k == "auto" else int(k))
        engines[mode] = BatchEngine(model, None if k == "off" else drafter, num_draft=nd,
                                    max_batch=max(args.clients), batch_invariant=bool(inv))
        if engines[mode].supported is not None:
            print(f"error: {engines[mode].supported}", file=sys.stderr)
            return 2
        run_cell(engines[mode], prompts[-1:], 1, 1, 16, stop, args.max_seconds)  # warm-up
    results = []
    for rep in range(args.repeats):
        for j, c in enumerate(args.clients):
            # modes interleaved, their order alternating: a machine whose load drifts favours none
            for mode in (modes if (j + rep) % 2 == 0 else modes[::-1]):
                engine = engines[mode]
                before = dict(engine.k_steps)
                r = run_cell(engine, prompts, c, args.requests, args.max_tokens, stop, args.max_seconds)
                r["mode"], r["repeat"] = mode, rep
                r["steps_by_k"] = {k: n - before.get(k, 0) for k, n in sorted(engine.k_steps.items())
                                   if n - before.get(k, 0)}
                results.append(r)
                print(json.dumps(r), flush=True)
    for mode in modes:
        if mode.partition(":")[0] == "auto":
            print(json.dumps({"mode": mode, "policy": engines[mode].policy.report()}), flush=True)
    print("\nclients  " + "  ".join(f"{m:>16}" for m in modes) + "   (aggregate tok/s: total tokens / total seconds)")
    for c in args.clients:
        cells = []
        for m in modes:
            rs = [r for r in results if r["clients"] == c and r["mode"] == m]
            cells.append(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs))
        print(f"{c:>7}  " + "  ".join(f"{v:>9.2f} tok/s " for v in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
