"""`python -m mlx_engine.bench`: every mode on one model, in one process and one run.

Modes: plain decoding through mlx-lm, plain through the engine, mlx-lm's speculative_generate_step with
a draft model, and the engine with each drafter at fixed k and auto, at each temperature. Each trial runs
every mode on each prompt back to back, in an order that rotates from prompt to prompt, so drift of a
shared machine hits all modes alike; the first trial is a warm-up. Reported: median decode tok/s over
trials; speedups over mlx-lm plain and over engine plain at the same temperature, each the median over
trials of the ratio measured within a trial (paired, so slow drift cancels); the end-to-end speedup over
mlx-lm plain (all tokens over the time from the call, prefill included: mlx-lm computes most of its
second step before it yields the first token, which a decode window starting at the first token misses);
acceptance, E (tokens per verify), C (seconds per cycle in units of one engine-plain token), S = E / C,
acceptance per draft position, peak memory.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..args import ArgumentParser, count, float_list, int_list
from ..drafters.draft_model import DraftModelDrafter
from ..drafters.ngram import NgramDrafter
from ..drafters.suffix import private_cache
from ..core.engine import Engine
from ..models import load
from . import structured
from .modes import Mode, Result, run_engine, run_mlx_lm
from .report import BenchInputError, command, machine, print_structured_table, print_table, writable_file, write_outputs

PROMPTS = Path(__file__).resolve().parents[2] / "bench" / "prompts"
BASELINES = ("mlx-lm plain", "engine plain")
# each suffix mode's own suffix cache (drafters/suffix.py), emptied before each pass over the prompts: a
# request sees the earlier requests of its pass, never its own answer from another trial or temperature
SUFFIX_CACHES: list = []


def default_out() -> Path:
    """Where results go without --out: the user's cache folder, never the source tree."""
    from ..models.default import cache_dir

    return cache_dir() / "bench" / "latest.json"


def truncated_copy(model, n_layers: int):
    """The target's first n layers with its own norm and output head: a draft sharing its tokenizer."""
    from mlx_lm.utils import _get_classes

    args = model.args
    cfg = {**vars(args), "num_hidden_layers": n_layers}
    for key, value in cfg.items():  # per-layer lists (layer_types, ...) follow the layer count
        if isinstance(value, list) and len(value) == args.num_hidden_layers:
            cfg[key] = value[:n_layers]
    model_cls, args_cls = _get_classes(cfg)
    draft = model_cls(args_cls.from_dict(cfg))
    from mlx.utils import tree_flatten

    weights = [(k, v) for k, v in tree_flatten(model.parameters())
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers]
    draft.load_weights(weights)
    mx.eval(draft.parameters())
    return draft


def randomized_head(drafter):
    """The same MTP drafter with a randomly initialised head (norms 1, weights N(0, 0.02)): a useless
    drafter with a real drafter's costs, to check that auto stops drafting when it does not pay."""
    from mlx.utils import tree_map

    key = iter(mx.random.split(mx.random.key(1234), 4096))

    def init(p):
        if not mx.issubdtype(p.dtype, mx.floating):
            return p
        return mx.ones_like(p) if p.ndim == 1 else 0.02 * mx.random.normal(p.shape, key=next(key)).astype(p.dtype)

    drafter.head.update(tree_map(init, drafter.head.parameters()))
    mx.eval(drafter.head.parameters())
    return drafter


def suite_file(suite: str) -> Path:
    path = PROMPTS / f"{suite}.jsonl"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROMPTS.glob("*.jsonl")))
        raise BenchInputError(f"no prompt suite {suite!r} in {PROMPTS} (suites: {known})")
    return path


def suite_rows(suite: str, n: int) -> list[dict]:
    """The first n rows of a suite ({"id", "messages", ...})."""
    return [json.loads(line) for line in suite_file(suite).read_text().splitlines() if line.strip()][:n]


def load_prompts(suite: str, n: int, tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True))
            for r in suite_rows(suite, n)]


def registry_drafters(args, loaded, mtp_ok: bool) -> dict:
    """Drafters built by the registry (drafters/registry.py): the chains, and the kinds whose checkpoint
    is given (--eagle3, --dflash, --assistant)."""
    from ..drafters import registry

    paths = {"eagle3": args.eagle3, "dflash": args.dflash, "gemma4-assistant": args.assistant}
    kinds = ["suffix"] + (["ngram+mtp", "suffix+mtp", "mtp-tree"] if mtp_ok else []) \
        + (["eagle3", "ngram+eagle3"] if args.eagle3 else []) \
        + (["dflash"] if args.dflash else []) + (["gemma4-assistant"] if args.assistant else [])
    out = {}
    for kind in kinds:  # each kind gets its own checkpoint only (the registry refuses another kind's)
        opts = registry.DrafterOptions.for_kind(kind, paths.get(kind.split("+")[-1]), mtp_weights=args.mtp_weights)
        try:
            registry.make_drafter(kind, loaded, opts)  # fail here, before any timing
        except registry.DrafterError as e:
            raise BenchInputError(str(e)) from None
        out[kind] = lambda kind=kind, opts=opts: private_cache(registry.make_drafter(kind, loaded, opts), SUFFIX_CACHES)
    return out


def build_modes(args, model, draft_model, mtp, random_mtp, more: dict | None = None,
                stop: frozenset = frozenset()) -> list[Mode]:
    """stop: the tokens that end an answer in every mode (empty: each runs to --max-tokens)."""
    ks = args.ks
    modes = [Mode("mlx-lm plain", lambda p, n, t, s: run_mlx_lm(model, p, n, t, s, stop=stop), "mlx-lm")]
    for k in ks:
        modes.append(Mode(f"mlx-lm draft k={k}",
                          lambda p, n, t, s, k=k: run_mlx_lm(model, p, n, t, s, draft_model, k, stop=stop), "mlx-lm"))

    def engine_mode(name, drafter, k):
        engine = Engine(model, drafter)
        return Mode(name, lambda p, n, t, s: run_engine(engine, p, n, t, s, k, stop=stop), "engine")

    modes.append(engine_mode("engine plain", None, 0))
    subset = None
    if args.draft_vocab_subset:
        from ..drafters.vocab_subset import load_vocab_subset

        try:
            subset = load_vocab_subset(args.draft_vocab_subset, model.args.vocab_size)
        except (OSError, ValueError) as e:
            raise BenchInputError(f"--draft-vocab-subset: {e}") from None
    drafters = {"draft": lambda: DraftModelDrafter(draft_model, model.args.vocab_size, vocab_subset=subset),
                "ngram": NgramDrafter}
    if mtp is not None:
        drafters["mtp"] = mtp
    drafters.update(more or {})
    for name, make in drafters.items():
        for k in ks:
            modes.append(engine_mode(f"engine {name} k={k}", make(), k))
        modes.append(engine_mode(f"engine {name} auto", make(), "auto"))
    if random_mtp is not None:
        modes.append(engine_mode("engine mtp-random auto", random_mtp(), "auto"))
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    chosen = [m for m in modes if not wanted or any(w in m.name for w in wanted)]
    if not chosen:
        raise BenchInputError(f"--modes {args.modes!r} matches none of: {', '.join(m.name for m in modes)}")
    if not any(m.name in BASELINES for m in chosen):  # every speedup needs a plain run beside it
        print("note: adding 'engine plain' as the baseline of the speedups", file=sys.stderr)
        chosen.insert(0, next(m for m in modes if m.name == "engine plain"))
    return chosen


def summarise(results: list[Result]) -> dict:
    tokens = sum(r.tokens for r in results)
    seconds = sum(r.seconds for r in results)
    cycles = sum(r.cycles for r in results)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    width = max([len(r.drafted_at) for r in results] + [0])
    d_at = [sum(r.drafted_at[i] for r in results if i < len(r.drafted_at)) for i in range(width)]
    a_at = [sum(r.accepted_at[i] for r in results if i < len(r.accepted_at)) for i in range(width)]
    return {
        "tok_s": tokens / seconds if seconds else 0.0,
        # end to end: every token (the first included) over the time from the call, prefill included. mlx-lm
        # computes most of its second step before it yields the first token, outside the decode window
        "e2e_tok_s": (tokens + len(results)) / wall if (wall := sum(r.wall for r in results)) else 0.0,
        "tokens": tokens,
        "seconds_per_cycle": seconds / cycles if cycles else 0.0,
        "E": tokens / cycles if cycles else 0.0,
        "acceptance": accepted / drafted if drafted else None,
        "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(a_at, d_at)],
        "peak_memory_mb": max(r.peak_memory for r in results) / 2**20,
        # structured suites (bench/structured.py): None elsewhere
        "forced_share": sum(r.forced for r in results) / tokens if tokens and any(r.valid is not None for r in results)
        else None,
        "grammar_us_per_token": 1e6 * sum(r.grammar_seconds for r in results) / (tokens + len(results))
        if any(r.valid is not None for r in results) else None,
        "valid": sum(bool(r.valid) for r in results) / len(results) if any(r.valid is not None for r in results)
        else None,
        "finished": sum(bool(r.finished) for r in results) / len(results)
        if any(r.finished is not None for r in results) else None,
        "valid_finished": sum(bool(r.valid) for r in results if r.finished) / n_fin
        if (n_fin := sum(bool(r.finished) for r in results)) else None,
    }


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m mlx_engine.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model (default: the embedded SmolLM2-135M-Instruct, fp32)")
    ap.add_argument("--draft-model", default="layers:6",
                    help="draft model for mlx-lm and --drafter draft: a path, or layers:N = the target's first N layers (default layers:6)")
    ap.add_argument("--draft-vocab-subset",
                    help="engine draft modes score only the token ids of this file's 'vocab_subset' array (e.g. the "
                         "MTP head file); mlx-lm's draft modes always score the full vocabulary")
    ap.add_argument("--mtp-weights", help="MTP head file (default: found next to the model)")
    ap.add_argument("--eagle3", default=None,
                    help="EAGLE-3 checkpoint folder: adds the eagle3 and ngram+eagle3 modes")
    ap.add_argument("--dflash", help="also run engine dflash modes with this DFlash checkpoint folder")
    ap.add_argument("--assistant", help="also run engine gemma4-assistant modes with this Gemma 4 assistant folder")
    ap.add_argument("--random-head", action="store_true", help="also run auto with a randomly initialised MTP head")
    ap.add_argument("--suite", default="chat",
                    help="prompt suite in bench/prompts (chat, code, long, edit, agent; json and tools: structured "
                         "output under each drafter, bench/structured.py; default chat)")
    ap.add_argument("--prompts", type=count(1), default=8, help="prompts from the suite (default 8)")
    ap.add_argument("--max-tokens", type=count(2), default=64,
                    help="tokens per generation, >= 2: decode speed is timed after the first (default 64)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="run every generation to --max-tokens, past the end of the answer (default: stop at the "
                         "model's end-of-turn tokens, as a user's answer does; the same place in every mode at T=0)")
    ap.add_argument("--trials", type=count(1), default=3, help="timed trials, after one warm-up (default 3)")
    ap.add_argument("--warmup-prompts", type=count(1), default=None,
                    help="prompts the warm-up trial runs (default: all); the warm-up only loads and compiles")
    ap.add_argument("--temps", type=float_list(0.0), default=[0.0, 0.7], help="temperatures (default 0,0.7)")
    ap.add_argument("--ks", type=int_list(1), default=[1, 2, 3], help="fixed draft lengths, each >= 1 (default 1,2,3)")
    ap.add_argument("--modes", default="",
                    help="only modes whose names contain one of these (comma-separated); 'engine plain' is added as "
                         "the baseline when neither plain mode is chosen (default: every mode)")
    ap.add_argument("--out", default=None,
                    help=f"JSON results file (default: {default_out()}, outside the source tree)")
    ap.add_argument("--chart", default=None, help="PNG chart (default: next to --out)")
    return ap


def main(argv=None) -> int:
    return command(parser(), run, argv)


def load_draft(spec: str, model):
    if spec.startswith("layers:"):
        n = spec.split(":", 1)[1]
        layers = len(model.layers) if hasattr(model, "layers") else None
        if not n.isdigit() or int(n) < 1 or (layers is not None and int(n) > layers):
            raise BenchInputError(f"--draft-model {spec!r}: layers:N needs 1 <= N <= {layers or 'the layer count'}")
        return truncated_copy(model, int(n))
    return load(spec).model


def run(args, argv) -> int:
    from rich.progress import Progress

    suite_file(args.suite)  # the cheap checks before the model loads: the suite, where the results go
    out = writable_file(args.out or default_out(), "--out")
    chart = writable_file(args.chart or out.with_suffix(".png"), "--chart")
    from .chart import INSTALL

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"note: matplotlib is not installed: no chart this run ({INSTALL})", file=sys.stderr)
    loaded = load(args.model)  # None: the embedded default
    model, tok = loaded.model, loaded.tokenizer
    draft_model = load_draft(args.draft_model, model)
    mtp = random_mtp = None
    try:
        from ..drafters.mtp import load_mtp_drafter

        load_mtp_drafter(model, loaded.path, loaded.config, mtp_weights=args.mtp_weights)
        mtp = lambda: load_mtp_drafter(model, loaded.path, loaded.config, mtp_weights=args.mtp_weights)  # noqa: E731
        if args.random_head:
            random_mtp = lambda: randomized_head(mtp())  # noqa: E731
    except (ImportError, ValueError) as e:
        if args.mtp_weights:  # asked for, so its failure is an error
            raise BenchInputError(str(e)) from None
        print(f"note: no MTP modes ({e})", file=sys.stderr)

    stop = frozenset() if args.ignore_eos else frozenset(getattr(tok, "eos_token_ids", None) or ())
    more = registry_drafters(args, loaded, mtp is not None)
    if args.suite in structured.SUITES:  # each prompt with its grammar; constrained and unconstrained modes
        if args.ignore_eos:
            raise BenchInputError("--ignore-eos: a structured answer ends where its grammar is complete")
        prompts = structured.load_structured(args.suite, suite_rows(args.suite, args.prompts), loaded)
        drafters = {**({"mtp": mtp} if mtp is not None else {}), "ngram": NgramDrafter,
                    "draft": lambda: DraftModelDrafter(draft_model, model.args.vocab_size), **more}
        modes = structured.build_structured_modes(args, model, drafters, stop, tok)
    else:
        prompts = load_prompts(args.suite, args.prompts, tok)
        modes = build_modes(args, model, draft_model, mtp, random_mtp, more, stop)
    temps = args.temps
    results = {(m.name, t): [] for m in modes for t in temps}
    warm = min(args.warmup_prompts or len(prompts), len(prompts))
    total = (args.trials * len(prompts) + warm) * len(modes) * len(temps)
    from rich.console import Console

    console = Console(stderr=True)
    with Progress(console=console) as progress:
        task = progress.add_task("bench", total=total)
        for trial in range(args.trials + 1):
            for temp in temps:
                for cache in SUFFIX_CACHES:
                    cache.clear()
                runs = {m.name: [] for m in modes}
                todo = prompts[: args.warmup_prompts] if trial == 0 and args.warmup_prompts else prompts
                for i, prompt in enumerate(todo):
                    # every mode on this prompt back to back, the order rotating: drift hits all modes alike
                    shift = (i + trial) % len(modes)
                    label = "warm-up (not timed)" if trial == 0 else f"trial {trial}/{args.trials}"
                    what = f"{label} t={temp:g} prompt {i + 1}/{len(todo)}"
                    progress.update(task, description=what)
                    if not console.is_terminal:  # a log file: one line per prompt
                        print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)
                    for mode in modes[shift:] + modes[:shift]:
                        runs[mode.name].append(mode.run(prompt, args.max_tokens, temp, 1000 * trial + i))
                        progress.advance(task, 1)
                if trial > 0:
                    for name, r in runs.items():
                        results[(name, temp)].append(r)

    rows = []
    for temp in temps:
        per_mode = {name: [summarise(runs) for runs in results[(name, temp)]] for name in (m.name for m in modes)}

        def paired(name, base, key="tok_s"):  # median over trials of the ratio within a trial
            if base not in per_mode:
                return None
            return statistics.median(a[key] / b[key] if b[key] else 0.0 for a, b in zip(per_mode[name], per_mode[base]))

        plain = statistics.median(t["tok_s"] for t in per_mode["engine plain"]) if "engine plain" in per_mode else None
        for name, trials in per_mode.items():
            med = statistics.median(t["tok_s"] for t in trials)
            best = min(trials, key=lambda t: abs(t["tok_s"] - med))
            c = best["seconds_per_cycle"] * plain if plain and best["seconds_per_cycle"] else 0.0
            rows.append({"mode": name, "temp": temp, **best, "tok_s": med, "tok_s_trials": [t["tok_s"] for t in trials],
                         "speedup_vs_mlx_lm_plain": paired(name, "mlx-lm plain"),
                         "speedup_vs_engine_plain": paired(name, "engine plain"),
                         "e2e_tok_s": statistics.median(t["e2e_tok_s"] for t in trials),
                         "e2e_speedup_vs_mlx_lm_plain": paired(name, "mlx-lm plain", "e2e_tok_s"),
                         "C": c, "S": best["E"] / c if c else 0.0})
            if args.suite in structured.SUITES:  # against masks-only decoding, and the same drafter unconstrained
                free = name.replace("grammar+", "").replace(" constrained", "")
                rows[-1]["speedup_vs_plain_constrained"] = paired(name, "engine plain constrained")
                rows[-1]["speedup_vs_unconstrained"] = paired(name, free) if free != name else None
    print_table(rows)
    if args.suite in structured.SUITES:
        print_structured_table(rows)

    report = {"command": "python -m mlx_engine.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "model": str(loaded.path),
              "args": vars(args), "prompts": len(prompts), "results": rows}
    write_outputs(report, out, chart)
    return 0
