"""`python -m mlx_engine.bench.longctx`: long contexts as a coding agent sends them (bench/agent_session.py),
at 2k / 8k / 16k tokens. For each length:

  prefill    cold prefill of the session: tokens/s, and time to first token (TTFT) of that cold turn;
  next turn  TTFT of the agent's next turn (the same conversation + the answer + a short request) served by
             another engine through the shared prefix tree, against the cold turn's;
  decode     greedy decode tok/s of the next turn, plain against each drafter (the prefix from the tree, so
             only the decode is timed), with the output checked equal to plain; one engine per mode for three
             rounds in alternating order, the first (its policy learning) reported apart;
  stall      a chat client's stream (plain decoding, answers of up to --stream-length tokens, one after
             another) while another client's session is prefilled by the batch engine: its median gap
             between tokens before, its largest gap during;
  memory     the target's KV cache holding the turn: bytes in full precision (fp32 here; fp16 by layout),
             and with --kv-bits quantization of the same entries; peak memory of the plain run and of a
             --kv-bits run (lengths listed in --kv-run-lengths: each is another cold prefill).

Greedy throughout. The model's own context window is not enforced here (SmolLM2's is 8,192: the 16k
session runs past what it was trained on; the machinery, not the text, is what is measured).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from ..args import ArgumentParser, count, fail, int_list, interrupted
from ..core.batch_engine import BatchEngine
from ..core.engine import Engine, GenerationConfig
from ..drafters.registry import DrafterError, DrafterOptions, make_drafter
from ..drafters.suffix import private_cache
from ..models import ModelLoadError, load
from ..target_model import cache as cache_ops
from ..target_model.prefix_cache import PrefixCache
from .agent_session import follow_up, python_version, session
from .report import BenchInputError, writable_file

STREAM_PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def load_for_modes(model: str | None, modes: list[str], out: str | None, opts=lambda mode: DrafterOptions()):
    """The model, after the cheap checks: --out writable, and every drafter of `modes` makeable ("none":
    plain) before any work. Raises the errors a bench reports as one line."""
    if out:
        writable_file(out, "--out")
    loaded = load(model)
    for m in modes:
        if m != "none":
            make_drafter(m, loaded, opts(m))
    return loaded


def encode(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def sized_session(tokenizer, length: int) -> dict:
    """The agent session (agent_session.session) whose prompt is about `length` tokens with this tokenizer."""
    return session(lambda msgs: len(encode(tokenizer, msgs)), length)


def generate(engine, prompt, max_tokens, stop=frozenset(), **kw):
    cfg = GenerationConfig(max_tokens=max_tokens, num_draft="auto", stop_tokens=stop, **kw)
    out = [t for s in engine.generate(prompt, cfg) for t in s.tokens]
    return out, engine.stats


def cold_and_next_turn(loaded, tree, prompt, max_tokens, stop):
    """The cold turn through an MTP engine (its hidden rows go to the tree), then the next turn's TTFT
    through a plain engine that only shares the tree."""
    tok = loaded.tokenizer
    first = Engine(loaded.model, make_drafter("mtp", loaded, DrafterOptions()), prefix_tree=tree)
    answer, st = generate(first, prompt["tokens"], max_tokens, stop)
    cold = {"prompt_tokens": len(prompt["tokens"]), "ttft_s": round(st.prompt_time, 3),
            "prefill_tok_s": round(len(prompt["tokens"]) / st.prompt_time, 1)}
    text = tok.decode([t for t in answer if t not in stop])
    nxt = encode(tok, prompt["messages"] + follow_up(text))
    plain = Engine(loaded.model, prefix_tree=tree)
    _, st2 = generate(plain, nxt, 1, stop)
    warm = {"prompt_tokens": len(nxt), "reused_tokens": st2.reused_tokens, "ttft_s": round(st2.prompt_time, 3),
            "ratio_to_cold": round(st2.prompt_time / st.prompt_time, 4)}
    return cold, warm, nxt, plain


def decode_modes(loaded, tree, prompt, modes, max_tokens, rounds=3):
    """Each mode's decode tok/s on the next turn, warm from the tree; outputs checked against plain. One
    engine per mode for all rounds, as an agent's session keeps its engine (its draft policy learns in the
    first round: that round is reported apart); rounds alternate the order of the modes."""
    runs = {m: [] for m in modes}
    suffix_caches = []  # a suffix mode's own cache, emptied before each run: no run drafts from an earlier one's answer
    engines = {m: Engine(loaded.model, None if m == "plain" else
                         private_cache(make_drafter(m, loaded, DrafterOptions()), suffix_caches),
                         prefix_tree=tree) for m in modes}
    reference = None
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else list(reversed(modes))):
            for c in suffix_caches:
                c.clear()
            out, st = generate(engines[mode], prompt, max_tokens)  # no stop: every run decodes max_tokens
            if mode == "plain" and reference is None:
                reference = out
            runs[mode].append({"tokens": out, "decode_tok_s": st.decode_tps, "acceptance": st.acceptance_rate,
                               "tokens_per_verify": st.mean_accepted_length, "reused": st.reused_tokens})
    result = {}
    plain_tps = statistics.mean(x["decode_tok_s"] for x in runs["plain"][1:])
    plain_first = runs["plain"][0]["decode_tok_s"]
    for mode, xs in runs.items():
        later = xs[1:]  # the policy has learnt this text and this context range
        tps = statistics.mean(x["decode_tok_s"] for x in later)
        result[mode] = {"decode_tok_s": round(tps, 2), "speedup": round(tps / plain_tps, 3),
                        "first_round_speedup": round(xs[0]["decode_tok_s"] / plain_first, 3),
                        "acceptance": round(statistics.mean(x["acceptance"] for x in later), 3),
                        "tokens_per_verify": round(statistics.mean(x["tokens_per_verify"] for x in later), 3),
                        "equal_to_plain": all(x["tokens"] == reference for x in xs)}
    return result


def stall(loaded, long_prompt, warmup=16, stream_length=256):
    """Gaps between a plain stream's tokens before and while another prompt is prefilled beside it, until
    that prompt's second token (its first comes when its prompt is in; the second once it decodes in the
    batch: the window holds every step its prefill and its joining cost).

    The stream is a chat client's: answers of up to `stream_length` tokens, the next request sent when one
    ends (gaps are taken within an answer; its first token, which waits for its own prompt, is not a gap).
    One endless stream would instead grow its own context through the whole prefill (6,000 tokens of it
    beside an 8k session here) and slow by its own attention, not by the prefill beside it."""
    engine = BatchEngine(loaded.model, None, prefix_cache_bytes=0)
    stream = encode(loaded.tokenizer, STREAM_PROMPT)
    answers = 0

    def ask() -> str:
        nonlocal answers
        answers += 1
        engine.add(f"stream{answers}", stream, stream_length, num_draft=0)
        return f"stream{answers}"

    sid = ask()
    times, added, first_long, long_tokens = [], None, None, 0  # times: (when, tokens, answer)
    while first_long is None:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.seq_id == sid and o.tokens:
                times.append((now, len(o.tokens), sid))
            if o.seq_id == sid and o.finished:
                sid = ask()
            if o.seq_id == "long":
                long_tokens += len(o.tokens)
                if long_tokens >= 2 or o.finished:
                    first_long = now
        if added is None and len(times) >= warmup:
            added = time.perf_counter()
            engine.add("long", long_prompt, 4)
    engine.reset()
    gaps = [(b, (b - a) / n) for (a, _, x), (b, n, y) in zip(times, times[1:]) if x == y]
    before = [g for t, g in gaps if t <= added]
    during = [g for t, g in gaps if added < t <= first_long]
    median = statistics.median(before)
    return {"prefill_s": round(first_long - added, 1), "stream_length": stream_length, "answers": answers,
            "median_gap_s": round(median, 4),
            "median_gap_during_s": round(statistics.median(during), 4) if during else None,
            "max_gap_during_s": round(max(during), 4) if during else None,
            "max_over_median": round(max(during) / median, 2) if during else None,
            "p99_over_median": round(sorted(during)[int(0.99 * (len(during) - 1))] / median, 2) if during else None,
            "gaps_over_3x": sum(g > 3 * median for g in during), "stream_tokens_during": len(during)}


def kv_memory(engine, kv_bits: int, group: int) -> dict:
    """Bytes of the engine's KV cache, and of the same entries quantized (a quantized cache's exact layout:
    each token's entries are quantized alone)."""
    full = cache_ops.kv_bytes(engine.cache)
    quant = 0
    for c in engine.cache:
        for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :]):
            quant += sum(x.nbytes for _, x in tree_flatten(mx.quantize(a, group_size=group, bits=kv_bits)))
    dtype_bytes = engine.cache[0].keys.dtype.size
    fp16 = full * 2 // dtype_bytes
    return {"positions": engine.cache[0].offset, "kv_bytes": full, "kv_bytes_fp16": fp16,
            f"kv_bytes_{kv_bits}bit": quant, f"ratio_{kv_bits}bit_to_fp16": round(quant / fp16, 4)}


def kv_run(loaded, prompt, kv_bits, group, max_tokens):
    """A real --kv-bits run: cold prefill + decode, its peak memory."""
    mx.reset_peak_memory()
    engine = Engine(loaded.model, kv_bits=kv_bits, kv_group_size=group)
    _, st = generate(engine, prompt, max_tokens)
    return {"peak_bytes": mx.get_peak_memory(), "kv_bytes": cache_ops.kv_bytes(engine.cache),
            "prefill_tok_s": round(len(prompt) / st.prompt_time, 1), "decode_tok_s": round(st.decode_tps, 2)}


def run_length(loaded, length, args) -> dict:
    tok = loaded.tokenizer
    stop = frozenset(getattr(tok, "eos_token_ids", None) or ())
    s = sized_session(tok, length)
    prompt = {"messages": s["messages"], "tokens": encode(tok, s["messages"])}
    if args.stall_only:
        return {"length": length, "session_files": s["files"],
                "stall": stall(loaded, prompt["tokens"], stream_length=args.stream_length)}
    tree = PrefixCache(args.prefix_cache_gb * 2**30, with_hidden=True)
    mx.reset_peak_memory()
    cold, warm, nxt, plain_engine = cold_and_next_turn(loaded, tree, prompt, args.max_tokens, stop)
    out = {"length": length, "session_files": s["files"], "asks": s["asks"]["function"], "cold": cold,
           "next_turn": warm}
    out["decode"] = decode_modes(loaded, tree, nxt, args.modes, args.max_tokens)
    out["memory"] = kv_memory(plain_engine, args.kv_bits, args.kv_group_size)
    out["memory"]["peak_bytes_full_precision_run"] = mx.get_peak_memory()
    if length in args.kv_run_lengths:
        out["memory"]["kv_bits_run"] = kv_run(loaded, nxt, args.kv_bits, args.kv_group_size, args.max_tokens)
    if length in args.stall_lengths:
        out["stall"] = stall(loaded, prompt["tokens"], stream_length=args.stream_length)
    return out


def int_list_or_none(text: str) -> list[int]:
    return [] if text.strip().lower() == "none" else int_list(256)(text)


def print_row(r) -> None:
    d = r["decode"]
    modes = " ".join(f"{m} {x['decode_tok_s']:.1f} ({x['speedup']:.2f}x{'' if x['equal_to_plain'] else ' NOT EQUAL'})"
                     for m, x in d.items())
    st = r.get("stall")
    stall_txt = f" | stall max/median {st['max_over_median']}x" if st else ""
    mem = r["memory"]
    q = next(v for k, v in mem.items() if k.startswith("ratio_"))
    print(f"{r['length']:>6} | prefill {r['cold']['prefill_tok_s']} tok/s, TTFT cold {r['cold']['ttft_s']} s, next "
          f"turn {r['next_turn']['ttft_s']} s ({r['next_turn']['ratio_to_cold']:.1%}) | {modes}{stall_txt} | "
          f"KV {mem['kv_bytes'] / 2**20:.0f} MiB, quantized/fp16 {q:.1%}", flush=True)


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m mlx_engine.bench.longctx", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: the embedded SmolLM2-135M-Instruct with its MTP head)")
    p.add_argument("--lengths", type=int_list(256), default=[2048, 8192, 16384], help="session lengths in tokens")
    p.add_argument("--modes", default="plain,ngram,suffix,mtp,ngram+mtp",
                   help="decode modes (plain first); with --agent-server, drafters (none for plain decoding)")
    p.add_argument("--max-tokens", type=count(2), default=64, help="tokens decoded per turn (default 64)")
    p.add_argument("--stall-lengths", type=int_list_or_none, default=[2048, 8192],
                   help="lengths whose prefill is run beside a stream (default 2048,8192; none: no stall runs)")
    p.add_argument("--kv-run-lengths", type=int_list_or_none, default=[2048, 8192],
                   help="lengths given a real --kv-bits run (another cold prefill each; none: no such run)")
    p.add_argument("--stall-only", action="store_true", help="run only the stall part at each of --lengths")
    p.add_argument("--stream-length", type=count(16), default=256,
                   help="the stall part's chat client: tokens per answer before it asks again (default 256)")
    p.add_argument("--kv-bits", type=int, choices=cache_ops.KV_BITS, default=4)
    p.add_argument("--kv-group-size", type=int, choices=cache_ops.KV_GROUP_SIZES, default=64)
    p.add_argument("--prefix-cache-gb", type=float, default=4.0, help="the shared prefix tree's budget (GiB)")
    p.add_argument("--agent-server", action="store_true",
                   help="the agent-server run instead (bench/agent_server.py): short requests arriving while the "
                        "sessions of --lengths are fed cold and from the prefix tree, per drafter of --modes "
                        "(default none,mtp,suffix,suffix+mtp; add eagle3 with --eagle3)")
    p.add_argument("--short-rate", type=float, default=4.0, help="--agent-server: short requests a minute (Poisson)")
    p.add_argument("--short-max-tokens", type=count(1), default=8, help="--agent-server: tokens each short one asks")
    p.add_argument("--seed", type=int, default=0, help="--agent-server: the arrivals' seed")
    p.add_argument("--eagle3", help="--agent-server: an EAGLE-3 checkpoint folder for the eagle3 mode")
    p.add_argument("--prefill-budget", type=float, default=1.0,
                   help="--agent-server: serve's --prefill-budget (seconds a chunk may take while none decodes)")
    p.add_argument("--out", help="write the results here as JSON")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code
    if args.agent_server:
        return agent_server_main(args, p)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or args.modes[0] != "plain":
        return fail("--modes must start with plain (the reference of every speedup)")
    try:
        if args.out:
            writable_file(args.out, "--out")
        loaded = load(args.model)
        for m in args.modes[1:]:
            make_drafter(m, loaded, DrafterOptions())  # a mode that cannot run is refused before any work
    except (BenchInputError, ModelLoadError, DrafterError, ValueError) as e:
        return fail(str(e))
    results = {"model": str(loaded.path), "python_version": python_version(), "mlx": mx.__version__,
               "source": "CPython standard library sources (PSF-2.0), bench/agent_session.py", "runs": []}
    try:
        for length in args.lengths:
            r = run_length(loaded, length, args)
            results["runs"].append(r)
            if args.stall_only:
                print(f"{length:>6} | stall: {r['stall']}", flush=True)
            else:
                print_row(r)
            save(results, args.out)
    except KeyboardInterrupt:
        return interrupted()
    return 0


def save(results: dict, path: str | None) -> None:
    """The results so far to --out (after each run: an interrupted bench keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def agent_server_main(args, parser) -> int:
    from .agent_server import run_mode

    modes = [m.strip() for m in args.modes.split(",") if m.strip()] \
        if args.modes != parser.get_default("modes") else ["none", "mtp", "suffix", "suffix+mtp"]
    if args.eagle3 and "eagle3" not in modes:
        modes.append("eagle3")
    lengths = args.lengths if args.lengths != parser.get_default("lengths") else [8192]
    if args.short_rate < 0:
        return fail("--short-rate must be >= 0")
    if not 0 < args.prefill_budget <= 60:
        return fail("--prefill-budget must be in (0, 60] seconds")
    def opts(mode: str) -> DrafterOptions:
        return DrafterOptions(eagle3=args.eagle3 if "eagle3" in mode else None)
    try:
        loaded = load_for_modes(args.model, modes, args.out, opts)
    except (BenchInputError, ModelLoadError, DrafterError, ValueError) as e:
        return fail(str(e))
    tok = loaded.tokenizer
    window = (loaded.config or {}).get("max_position_embeddings")
    results = {"model": str(loaded.path), "python_version": python_version(), "mlx": mx.__version__,
               "short_rate_per_min": args.short_rate, "short_max_tokens": args.short_max_tokens,
               "max_tokens": args.max_tokens, "seed": args.seed, "prefill_budget_s": args.prefill_budget,
               "runs": []}
    try:
        for length in lengths:
            if window and length + args.max_tokens > window:
                print(f"{length}: skipped (the model's context window is {window})", flush=True)
                continue
            s = sized_session(tok, length)
            tokens = encode(tok, s["messages"])
            more = lambda answer: encode(tok, s["messages"] + follow_up(tok.decode(answer)))  # noqa: E731
            for mode in modes:
                r = {"length": length, **run_mode(loaded, mode, tokens, more, args, opts(mode))}
                results["runs"].append(r)
                c, n = r["cold"], r["next"]
                print(f"{length:>6} {mode:<11} idle short TTFT {r['idle_short_ttft_s']:.2f}s | cold: TTFT "
                      f"{c['ttft_s']}s drafting at {c['drafter_ready_s']}s, shorts {c['shorts']} max "
                      f"{c['short_ttft_max_s']}s ({c['short_ttft_max_over_idle']}x idle) | next: TTFT {n['ttft_s']}s "
                      f"({r['next_over_cold_ttft']}x cold) drafting at {n['drafter_ready_s']}s, shorts {n['shorts']} "
                      f"max {n['short_ttft_max_s']}s", flush=True)
                save(results, args.out)
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
