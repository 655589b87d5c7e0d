"""`python -m mlx_engine.bench verify`: what a verify pass costs relative to one decode step.

For k + 1 = 1 .. max_len it times the target forward over a KV cache pre-filled with `--prefill`
tokens (the cache is trimmed back after every timed call, so every call sees the same context) and
prints t(k+1) / t(1), the median of `--trials` calls. It then times the acceptance step (greedy and
sampling) for the same vocabulary with the reference ops and, where a GPU backend exists, the fused
kernel. Without `--model` it builds a random llama shaped like SmolLM2-135M (hidden 576, 30 layers,
9 heads / 3 KV heads, vocab 49152, fp32).

`--shape llama-8b` (or qwen3-30b-a3b, smollm2-135m; mlx_engine/bench/shapes.py) builds that random
model on the device (4-bit) and prints stock and batch-invariant t(k+1) side by side, all against stock
t(1): "fused" (make_batch_invariant, the kernels of mlx_engine/kernels) and "fixed:PLAN" (make_fixed_rows:
every pass 16 token rows; `--fixed-plans` picks the plans, default auto); then each t(1) against stock
t(1), and whether each path's 8-token verify pass equals 8 single steps bit for bit. `--sequences B`
adds the batch engine's step: B sequences x (k+1) tokens over a BatchKVCache, stock and fused.
"""

from __future__ import annotations

from .. import _platform  # noqa: F401  (OpenBLAS before mlx, on Linux)

import statistics
import time
from typing import Callable

import mlx.core as mx

from ..args import ArgumentParser, count


def build_default_model(layers: int = 30, hidden: int = 576, vocab: int = 49152, seed: int = 0):
    """A random llama with SmolLM2-135M's shape (fp32)."""
    from mlx_lm.models import llama

    heads = max(1, hidden // 64)
    kv_heads = max(1, heads // 3)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 8 // 3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _median_ms(fn: Callable[[], None], trials: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_verify_forward(model, prefill: int, max_len: int, trials: int, seed: int = 0) -> dict[int, float]:
    """{L: median ms of model(L tokens) over a cache holding `prefill` tokens}."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    vocab = model.args.vocab_size if hasattr(model, "args") else 1000
    key = mx.random.key(seed)
    tokens = mx.random.randint(0, vocab, (1, prefill + max_len), key=key)
    cache = make_prompt_cache(model)
    mx.eval(model(tokens[:, :prefill], cache=cache))
    out = {}
    for L in range(1, max_len + 1):
        chunk = tokens[:, prefill : prefill + L]

        def step():
            mx.eval(model(chunk, cache=cache))
            trim_prompt_cache(cache, L)

        out[L] = _median_ms(step, trials)
    return out


def time_batch_verify(model, sequences: int, prefill: int, max_len: int, trials: int, seed: int = 0) -> dict[int, float]:
    """{L: median ms of one pass of `sequences` sequences x L tokens over a BatchKVCache}: the batch engine's
    verify step. Sequence b holds prefill + 7b tokens (rows of different lengths, as in a served batch); the
    rows are trimmed back after every timed call."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..target_model.batch_cache import append_sequence

    vocab = model.args.vocab_size
    tokens = mx.random.randint(0, vocab, (sequences, prefill + 7 * sequences + max_len), key=mx.random.key(seed))
    batch = []
    for b in range(sequences):
        cache = make_prompt_cache(model)
        mx.eval(model(tokens[b : b + 1, : prefill + 7 * b], cache=cache))
        batch = append_sequence(batch, cache)
    out = {}
    for L in range(1, max_len + 1):
        chunk = tokens[:, -L:]

        def step():
            mx.eval(model(chunk, cache=batch))
            for bc in batch:
                for b in range(sequences):
                    bc.trim_row(b, L)

        out[L] = _median_ms(step, trials)
    return out


def verify_equals_singles(model, n: int = 8, prefill: int = 64) -> bool:
    """Whether an n-token pass over a prefilled cache gives the logits of n single-token passes, bit for bit."""
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size
    toks = mx.random.randint(0, vocab, (1, prefill + n), key=mx.random.key(5))
    a, b = make_prompt_cache(model), make_prompt_cache(model)
    mx.eval(model(toks[:, :prefill], cache=a), model(toks[:, :prefill], cache=b))
    full = model(toks[:, prefill:], cache=a)[0]
    singles = mx.concatenate([model(toks[:, prefill + i : prefill + i + 1], cache=b)[0] for i in range(n)])
    return bool(mx.array_equal(full, singles).item())


def shape_table(name: str, layers: int | None, prefill: int, max_len: int, trials: int, plans=("auto",),
                sequences: int = 1) -> int:
    """Stock against batch-invariant verify cost on a random model of a named shape: the kernels path
    (make_batch_invariant, "fused") and fixed-row passes (make_fixed_rows, 16 rows, one fresh copy of the
    model per plan in `plans`); with sequences > 1 also the batch engine's pass of that many sequences,
    stock and fused."""
    from .. import kernels
    from ..target_model.batch_invariant import make_batch_invariant
    from ..target_model.fixed_rows import make_fixed_rows
    from .shapes import build, describe

    model = build(name, layers=layers)
    print(f"model:   {describe(name, layers)}")
    print(f"device:  {mx.default_device()}")
    times, exact = {"stock": time_verify_forward(model, prefill, max_len, trials)}, {"stock": verify_equals_singles(model)}
    batched = {"stock": time_batch_verify(model, sequences, prefill, max_len, trials)} if sequences > 1 else {}
    make_batch_invariant(model)
    print("kernels: " + ", ".join(f"{op}={b}" for op, b in kernels.describe().items()))
    if all(b == "reference" for b in kernels.describe().values()):
        print("note:    no GPU backend: the fused path runs the CPU references of the kernels")
    times["fused"], exact["fused"] = time_verify_forward(model, prefill, max_len, trials), verify_equals_singles(model)
    if sequences > 1:
        batched["fused"] = time_batch_verify(model, sequences, prefill, max_len, trials)
    for plan in plans:
        del model
        mx.clear_cache()
        model = build(name, layers=layers)
        chosen = make_fixed_rows(model, rows=16, plan=plan)
        label = f"fixed:{chosen}"
        print(f"fixed:   16-row passes, plan {plan!r} -> {chosen!r}")
        times[label], exact[label] = time_verify_forward(model, prefill, max_len, trials), verify_equals_singles(model)
    t1 = times["stock"][1]
    print(f"\nverify forward over a {prefill}-token KV cache, median of {trials} (ratios against stock t(1) = {t1:.2f} ms)")
    print(f"{'k+1':>4} " + " ".join(f"{label + ' ms':>22} {'x':>5}" for label in times))
    for L in times["stock"]:
        print(f"{L:>4} " + " ".join(f"{t[L]:>22.2f} {t[L] / t1:>5.2f}" for t in times.values()))
    print("\nt(1) / stock t(1): " + ", ".join(f"{label} {t[1] / t1:.2f}" for label, t in times.items() if label != "stock"))
    print("8-token verify == 8 single steps, bit for bit: "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in exact.items()))
    if batched:
        b1 = batched["stock"][1]
        print(f"\n{sequences} sequences x (k+1) tokens over a BatchKVCache (the batch engine's step; rows of "
              f"{prefill}..{prefill + 7 * (sequences - 1)} tokens), ratios against stock t(1) = {b1:.2f} ms")
        print(f"{'k+1':>4} " + " ".join(f"{label + ' ms':>22} {'x':>5}" for label in batched))
        for L in batched["stock"]:
            print(f"{L:>4} " + " ".join(f"{t[L]:>22.2f} {t[L] / b1:>5.2f}" for t in batched.values()))
    return 0


def time_acceptance(vocab: int, ks: list[int], trials: int, seed: int = 0) -> list[dict]:
    """Median ms of the acceptance step for each k (k + 1 target rows), reference and fused."""
    from .. import kernels

    reference = kernels.reference("acceptance")
    fused = kernels.get("acceptance") if kernels.backend("acceptance") != "reference" else None
    rows = []
    for k in ks:
        keys = mx.random.split(mx.random.key(seed + k), 3)
        logits = mx.random.normal((k + 1, vocab), key=keys[0])
        probs = mx.softmax(logits, axis=-1)
        draft = mx.argmax(logits[:k], axis=-1).astype(mx.int32) if k else mx.zeros((0,), mx.int32)
        qprobs = mx.softmax(logits[:k] * 0.9, axis=-1) if k else None
        u = mx.random.uniform(shape=(k,), key=keys[1])
        s = mx.random.uniform(key=keys[2])
        mx.eval(logits, probs, draft, qprobs, u, s)
        row = {"k": k}
        for label, fn in (("reference", reference), ("fused", fused)):
            if fn is None:
                row[label] = None
                continue
            row[f"{label}_greedy"] = _median_ms(lambda: mx.eval(fn(logits, draft, None, None, None, True)), trials)
            row[f"{label}_sampled"] = _median_ms(lambda: mx.eval(fn(probs, draft, qprobs, u, s, False)), trials)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m mlx_engine.bench verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local model directory (mlx_lm.load); default: random SmolLM2-135M-shaped llama")
    ap.add_argument("--prefill", type=count(1), default=128, help="tokens in the KV cache before each timed call")
    ap.add_argument("--max-len", type=count(1), default=16, help="largest k + 1 to time")
    ap.add_argument("--trials", type=count(1), default=5, help="timed calls per length (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=count(1), default=30, help="default model: layers")
    ap.add_argument("--hidden", type=count(1), default=576, help="default model: hidden size")
    ap.add_argument("--vocab", type=count(2), default=49152, help="default model: vocabulary")
    ap.add_argument("--shape", help="a random model shaped like a real one (llama-8b, qwen3-30b-a3b, smollm2-135m): "
                    "stock and batch-invariant t(k+1) side by side")
    ap.add_argument("--shape-layers", type=count(1), help="with --shape: fewer layers than the real model")
    ap.add_argument("--sequences", type=count(1), default=1,
                    help="with --shape: also time passes of this many sequences over a batch cache (stock, fused)")
    ap.add_argument("--fixed-plans", default="auto",
                    help="with --shape: fixed-row plans to time, comma-separated (auto, stock, stock-linears, kernels)")
    args = ap.parse_args(argv)
    if args.shape:
        from .shapes import SHAPES

        if args.shape not in SHAPES:
            ap.error(f"unknown --shape {args.shape!r}; known: {', '.join(SHAPES)}")
        from ..target_model.fixed_rows import PLANS

        plans = [p.strip() for p in args.fixed_plans.split(",") if p.strip()]
        bad = [p for p in plans if p not in ("auto",) + PLANS]
        if bad or not plans:
            ap.error(f"--fixed-plans: expected comma-separated plans among auto, {', '.join(PLANS)}, got {args.fixed_plans!r}")
        return shape_table(args.shape, args.shape_layers, args.prefill, args.max_len, args.trials, plans, args.sequences)

    from .. import kernels

    if args.model:
        from mlx_lm import load

        model, _ = load(args.model)
        name = args.model
    else:
        model = build_default_model(args.layers, args.hidden, args.vocab, args.seed)
        name = f"random llama (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32)"
    vocab = model.args.vocab_size if hasattr(model, "args") else args.vocab

    gpu = "metal" if mx.metal.is_available() else ("cuda" if kernels.backend_available("cuda") else None)
    print(f"model:   {name}")
    print(f"device:  {mx.default_device()}  (GPU backend: {gpu or 'none'})")
    print(f"kernels: " + ", ".join(f"{op}={b}" for op, b in kernels.describe().items()))
    if gpu is None:
        print("note:    no Metal/CUDA here: only the reference ops run, fused kernels are not timed")
    print(f"\nverify forward over a {args.prefill}-token KV cache, median of {args.trials}")
    print(f"{'k+1':>4} {'t (ms)':>9} {'t/t(1)':>7}")
    times = time_verify_forward(model, args.prefill, args.max_len, args.trials, args.seed)
    for L, t in times.items():
        print(f"{L:>4} {t:>9.2f} {t / times[1]:>7.2f}")

    ks = [k for k in (0, 1, 3, 7, 15) if k + 1 <= args.max_len]
    print(f"\nacceptance step (V={vocab}), median ms of {max(args.trials, 10)}")
    header = f"{'k':>4} {'ref greedy':>11} {'ref sampled':>12} {'fused greedy':>13} {'fused sampled':>14}"
    print(header)
    for row in time_acceptance(vocab, ks, max(args.trials, 10), args.seed):
        fg = row.get("fused_greedy")
        fs = row.get("fused_sampled")
        fused = f"{fg:>13.3f} {fs:>14.3f}" if fg is not None else f"{'n/a':>13} {'n/a':>14}"
        print(f"{row['k']:>4} {row['reference_greedy']:>11.3f} {row['reference_sampled']:>12.3f} {fused}")
    if gpu is None:
        print("(fused: n/a on CPU, the registry uses the reference)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
