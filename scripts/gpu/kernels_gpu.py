"""The new batch-invariant kernels on a CUDA GPU (issue 12): correctness first, then a launch-size sweep,
then forward and end-to-end timings.

Run on the device machine: `source .gpu/setup.sh; python3 scripts/gpu/kernels_gpu.py --out $OUT`.
Writes kernels.json (every figure) and prints short tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import traceback

import mlx.core as mx

sys.path.insert(0, os.getcwd())

from mlx_engine import kernels  # noqa: E402
from mlx_engine.kernels import batch_attention as A  # noqa: E402
from mlx_engine.kernels import batch_qmm as Q  # noqa: E402
from mlx_engine.kernels import gather_qmm as G  # noqa: E402

RES: dict = {}


def section(name):
    def deco(fn):
        def run(*a, **k):
            print(f"\n== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                RES[name] = fn(*a, **k)
            except Exception as e:  # keep going: one broken part must not hide the others
                traceback.print_exc()
                RES[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        return run
    return deco


def med_ms(fn, trials=9, warmup=2):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(trials):
        mx.synchronize()
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


# ---------------------------------------------------------------------------------------------------
# correctness


@section("compile")
def compile_times():
    """First call (NVRTC compile + run) against the second (run) of each kernel the engine uses."""
    out = {}
    x, w, s, b, gs, bits = Q.make_case(4, 4096, 4096, 64, 4, seed=1, dtype=mx.bfloat16)
    q = mx.random.normal((1, 32, 4, 128)).astype(mx.bfloat16)
    kv = mx.random.normal((1, 8, 600, 128)).astype(mx.bfloat16)
    g = G.make_gather_case(4, 8, 128, 2048, 768, 64, 4, seed=2, dtype=mx.bfloat16)
    mx.eval(x, w, s, b, q, kv, *g[:5])
    for name, fn in (("batch_qmm", lambda: Q.qmm_cuda(x, w, s, b, gs, bits)),
                     ("batch_attention", lambda: A.attention_cuda(q, kv, kv, 0.088, True)),
                     ("gather_qmm", lambda: G.gather_cuda(*g))):
        t0 = time.perf_counter()
        mx.eval(fn())
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(fn())
        out[name] = dict(first_s=first, second_s=time.perf_counter() - t0)
        print(name, out[name], flush=True)
    return out


@section("registry")
def registry():
    return {op: kernels.backend(op) for op in kernels.ops()}


@section("qmm_correct")
def qmm_correct():
    out = []
    for dtype, bits, gs in ((mx.bfloat16, 4, 64), (mx.bfloat16, 8, 64), (mx.float16, 4, 32), (mx.float32, 4, 128), (mx.bfloat16, 4, 128)):
        x, w, s, b, _, _ = Q.make_case(16, 4096, 512, gs, bits, seed=bits * gs, dtype=dtype)
        alone = mx.concatenate([Q.qmm_cuda(x[i : i + 1], w, s, b, gs, bits) for i in range(16)])
        bad = [M for M in range(1, 17) if not mx.array_equal(Q.qmm_cuda(x[:M], w, s, b, gs, bits), alone[:M]).item()]
        ref = Q.qmm_reference(x, w, s, b, gs, bits)
        stock = mx.quantized_matmul(x, w, s, b, True, gs, bits)
        row = dict(dtype=str(dtype), bits=bits, gs=gs, rows_not_bit_identical=bad, rel_err_ref=rel(alone, ref),
                   rel_err_stock=rel(alone, stock))
        print(row, flush=True)
        out.append(row)
    return out


@section("gather_correct")
def gather_correct():
    out = []
    for dtype, bits, per_pair in ((mx.bfloat16, 4, False), (mx.bfloat16, 4, True)):
        for tokens in (1, 3, 16):
            args = G.make_gather_case(tokens, 8, 64, 2048, 256, 64, bits, seed=tokens, dtype=dtype, per_pair=per_pair)
            x, w, s, b, idx, gs, bits_, xdiv, toks = args
            y = G.gather_cuda(*args)
            ref = G.gather_reference(*args)
            topk = 8
            bad = []
            for t in range(tokens):
                pairs = slice(t * topk, (t + 1) * topk)
                xt = x[t : t + 1] if xdiv > 1 else x[pairs]
                if not mx.array_equal(G.gather_cuda(xt, w, s, b, idx[pairs], gs, bits_, xdiv, 1), y[pairs]).item():
                    bad.append(t)
            row = dict(dtype=str(dtype), bits=bits, per_pair=per_pair, tokens=tokens, tokens_not_bit_identical=bad,
                       rel_err_ref=rel(y, ref), distinct=len(set(idx.tolist())))
            print(row, flush=True)
            out.append(row)
    return out


@section("attention_correct")
def attention_correct():
    from mlx_lm.models.cache import KVCache

    out = []
    for (Hq, Hk, D, DV, DP, dtype) in ((32, 8, 128, 128, 0, mx.bfloat16), (8, 1, 512, 512, 64, mx.bfloat16),
                                        (4, 2, 64, 64, 0, mx.float32)):
        for N in (5, 1100):
            # a real KV cache: keys / values are views of a longer buffer
            cache = KVCache()
            kk = mx.random.normal((1, Hk, N, D), key=mx.random.key(N)).astype(dtype)
            vv = mx.random.normal((1, Hk, N, DV), key=mx.random.key(N + 1)).astype(dtype)
            kv, vv = cache.update_and_fetch(kk, vv)
            kp = mx.random.normal((1, Hk, N, DP), key=mx.random.key(N + 2)).astype(dtype) if DP else None
            L = min(16, N)
            q = mx.random.normal((1, Hq, L, D), key=mx.random.key(3)).astype(dtype)
            qp = mx.random.normal((1, Hq, L, DP), key=mx.random.key(4)).astype(dtype) if DP else None
            scale = (D + DP) ** -0.5
            o = A.attention_cuda(q, kv, vv, scale, True, qp, kp)
            ref = A.attention_reference(q, kv, vv, scale, True, qp, kp)
            bad = []
            for i in range(L):
                n = N - L + i + 1
                oi = A.attention_cuda(q[:, :, i : i + 1], kv[:, :, :n], vv[:, :, :n], scale, True,
                                      qp[:, :, i : i + 1] if DP else None, kp[:, :, :n] if DP else None)
                if not mx.array_equal(oi[:, :, 0], o[:, :, i]).item():
                    bad.append(i)
            stock = None
            if not DP:
                stock = rel(o, mx.fast.scaled_dot_product_attention(q, kv, vv, scale=scale, mask="causal"))
            row = dict(Hq=Hq, Hk=Hk, D=D, DP=DP, dtype=str(dtype), N=N, rows_not_bit_identical=bad,
                       rel_err_ref=rel(o, ref), rel_err_stock=stock)
            print(row, flush=True)
            out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------
# speed


def weight_pool(N, K, bits=4, gs=64, dtype=mx.bfloat16, E=None, budget=400 << 20):
    def make(i):
        key = mx.random.key(100 + i)
        shape = (N, K * bits // 32) if E is None else (E, N, K * bits // 32)
        w = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=key)
        w = (w << 16) | w
        s = (mx.random.uniform(0.5, 1.5, shape[:-1] + (K // gs,), key=key) * 0.003).astype(dtype)
        return (w, s, -8 * s)

    first = make(0)
    n = max(2, min(48, budget // sum(a.nbytes for a in first)))
    pool = [first] + [make(i) for i in range(1, n)]
    mx.eval(pool)
    return pool


@section("qmm_sweep")
def qmm_sweep():
    shapes = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
    out = []
    for (N, K) in shapes:
        pool = weight_pool(N, K)
        wbytes = sum(a.nbytes for a in pool[0])
        for M in (1, 2, 4, 8, 16):
            x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.bfloat16)
            mx.eval(x)
            stock = med_ms(lambda: mx.eval([mx.quantized_matmul(x, w, s, b, True, 64, 4) for w, s, b in pool])) / len(pool) * 1e3
            best = None
            times = {}
            for R, SG in itertools.product((2, 4), (2, 4, 8)):
                k = Q.kernel("cuda")

                def fused():
                    outs = []
                    for w, s, b in pool:
                        spec = Q.launch_spec(x, w, s, b, 64, 4, cols=R, warps=SG)
                        outs.append(k(**spec.kwargs())[0])
                    mx.eval(outs)

                t = med_ms(fused) / len(pool) * 1e3
                times[f"R{R}_SG{SG}"] = t
                if best is None or t < best[0]:
                    best = (t, R, SG)
            planned = Q.plan(N, K, M)
            row = dict(N=N, K=K, M=M, stock_us=stock, best_us=best[0], best_R=best[1], best_SG=best[2],
                       planned=planned, planned_us=times.get(f"R{planned[0]}_SG{planned[1]}"), times=times,
                       best_GBs=wbytes / best[0] / 1e3, stock_GBs=wbytes / stock / 1e3)
            print(f"N={N:6d} K={K:5d} M={M:2d} stock {stock:7.1f} us ({row['stock_GBs']:5.0f} GB/s)  best {best[0]:7.1f} us "
                  f"R={best[1]} SG={best[2]} ({row['best_GBs']:5.0f} GB/s)  planned {planned} {row['planned_us']}", flush=True)
            out.append(row)
    return out


@section("attention_sweep")
def attention_sweep():
    out = []
    Hq, Hk, D = 32, 8, 128
    for N in (512, 4096):
        ks = [mx.random.normal((1, Hk, N + 16, D), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(8)]
        vs = [mx.random.normal((1, Hk, N + 16, D), key=mx.random.key(50 + i)).astype(mx.bfloat16) for i in range(8)]
        mx.eval(ks, vs)
        for L in (1, 8):
            q = mx.random.normal((1, Hq, L, D), key=mx.random.key(L)).astype(mx.bfloat16)
            kk = [k[:, :, : N + L] for k in ks]
            vv = [v[:, :, : N + L] for v in vs]
            mask = "causal" if L > 1 else None
            stock = med_ms(lambda: mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask) for k, v in zip(kk, vv)])) / 8 * 1e3
            times = {}
            kern = A._kernel("cuda")
            for SG, KB in itertools.product((4, 8), (2, 4)):
                def fused():
                    mx.eval([kern(**A.launch_spec(q, k, v, D**-0.5, True, warps=SG, keys=KB).kwargs())[0] for k, v in zip(kk, vv)])
                times[f"SG{SG}_KB{KB}"] = med_ms(fused) / 8 * 1e3
            best = min(times, key=times.get)
            row = dict(N=N, L=L, stock_us=stock, best=best, best_us=times[best], default_us=times.get(f"SG{A.warps_for(D)}_KB{A.KEYS_PER_ITER}"), times=times)
            print(f"attention keys={N} L={L:2d}: stock {stock:7.1f} us  best {best} {times[best]:7.1f} us  default {row['default_us']:7.1f} us", flush=True)
            out.append(row)
    return out


@section("gather_speed")
def gather_speed():
    out = []
    E, topk = 128, 8
    for (N, K) in ((768, 2048), (2048, 768)):
        pool = weight_pool(N, K, E=E, budget=600 << 20)
        for L in (1, 4, 8, 16):
            per_pair = K == 768  # down_proj: one x row per pair
            x = mx.random.normal((L * (topk if per_pair else 1), K), key=mx.random.key(L)).astype(mx.bfloat16)
            idx = mx.concatenate([mx.random.permutation(E, key=mx.random.key(1000 + 31 * L + i))[:topk] for i in range(L)]).astype(mx.uint32)
            mx.eval(x, idx)
            x4 = x.reshape(L, 1, 1, K) if not per_pair else x.reshape(L, topk, 1, K)
            ids = idx.reshape(L, topk)
            stock = med_ms(lambda: mx.eval([mx.gather_qmm(x4, w, s, b, rhs_indices=ids, transpose=True, group_size=64, bits=4) for w, s, b in pool])) / len(pool) * 1e3
            xdiv = 1 if per_pair else topk
            fused = med_ms(lambda: mx.eval([G.gather_cuda(x, w, s, b, idx, 64, 4, xdiv, L) for w, s, b in pool])) / len(pool) * 1e3
            row = dict(N=N, K=K, L=L, stock_us=stock, fused_us=fused, distinct=len(set(idx.tolist())))
            print(row, flush=True)
            out.append(row)
    return out


def forward(name, layers, lengths):
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_engine.target_model.batch_invariant import make_batch_invariant
    from mlx_engine.bench.shapes import build, describe

    model = build(name, layers=layers)
    res = {"shape": describe(name, layers)}

    def times(call):
        toks = mx.random.randint(0, model.args.vocab_size, (1, 512 + max(lengths)), key=mx.random.key(1))
        cache = make_prompt_cache(model)
        mx.eval(model(toks[:, :512], cache=cache))
        out = {}
        for L in lengths:
            chunk = toks[:, 512 : 512 + L]

            def step():
                mx.eval(call(chunk, cache))
                trim_prompt_cache(cache, L)

            out[L] = med_ms(step, 7)
        return out

    res["stock"] = times(lambda t, c: model(t, cache=c))
    print("stock    ", {L: round(v, 2) for L, v in res["stock"].items()}, flush=True)
    make_batch_invariant(model)
    res["invariant"] = times(lambda t, c: model(t, cache=c))
    print("invariant", {L: round(v, 2) for L, v in res["invariant"].items()}, flush=True)
    t1 = res["stock"][1]
    print("ratios t(L)/stock t(1): stock", [round(res["stock"][L] / t1, 2) for L in lengths],
          " invariant", [round(res["invariant"][L] / t1, 2) for L in lengths], flush=True)
    # verify rows == single rows, bit for bit, on this device
    toks = mx.random.randint(0, model.args.vocab_size, (1, 64 + 8), key=mx.random.key(5))
    a, b = make_prompt_cache(model), make_prompt_cache(model)
    mx.eval(model(toks[:, :64], cache=a), model(toks[:, :64], cache=b))
    full = model(toks[:, 64:], cache=a)[0]
    singles = mx.concatenate([model(toks[:, 64 + i : 65 + i], cache=b)[0] for i in range(8)])
    res["verify_equals_singles"] = bool(mx.array_equal(full, singles).item())
    print("8-token verify == 8 single steps, bit for bit:", res["verify_equals_singles"], flush=True)
    del model
    mx.clear_cache()
    return res


@section("e2e")
def e2e():
    from mlx_lm.generate import generate_step

    from mlx_engine import Engine, GenerationConfig, NgramDrafter
    from mlx_engine.bench.shapes import build

    model = build("llama-8b")
    prompt = [int(t) for t in mx.random.randint(0, 128256, (64,), key=mx.random.key(9)).tolist()]
    prompt = prompt[:16] * 4  # repetitive
    n = 128
    out = {}

    def mlx_lm_plain():
        t0 = time.perf_counter()
        toks = []
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
            toks.append(int(tok))
            if len(toks) == 1:
                t1 = time.perf_counter()
        return toks, (n - 1) / (time.perf_counter() - t1)

    toks_stock, tps = mlx_lm_plain()
    mlx_lm_plain()
    toks_stock, tps = mlx_lm_plain()
    out["mlx_lm_plain_tok_s"] = tps
    print(f"mlx-lm plain (stock): {tps:.1f} tok/s", flush=True)
    engines = {"plain": Engine(model, None), "ngram k=2": Engine(model, NgramDrafter()), "ngram k=4": Engine(model, NgramDrafter())}
    ks = {"plain": 0, "ngram k=2": 2, "ngram k=4": 4}
    ref = None
    for rep in range(3):
        for name, eng in engines.items():
            cfg = GenerationConfig(max_tokens=n, num_draft=ks[name], reuse_cache=False)
            toks = [t for s in eng.generate(prompt, cfg) for t in s.tokens]
            st = eng.stats.to_dict()
            if name == "plain":
                ref = toks
            if rep == 2:
                out[name] = dict(decode_tok_s=st.get("decode_tps"), acceptance=st.get("acceptance_rate"),
                                 drafted=st.get("drafted"), accepted=st.get("accepted"), equal_to_plain=toks == ref,
                                 batch_invariant=eng.batch_invariant)
                print(name, out[name], flush=True)
    out["engine_plain_equals_mlx_lm_stock_tokens"] = ref == toks_stock
    return out


def run_steps(steps, json_name: str) -> None:
    """Parse --out / --only, run the (name, section) steps in order, rewriting --out/json_name after each
    (a step that fails or a timeout keeps what the earlier ones measured)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="", help="comma-separated sections")
    args = ap.parse_args()
    print("MLX", mx.__version__, mx.default_device(), flush=True)
    only = set(filter(None, args.only.split(",")))
    t0 = time.perf_counter()
    for name, fn in steps:
        if only and name not in only:
            continue
        fn()
        RES["elapsed_s"] = time.perf_counter() - t0
        with open(os.path.join(args.out, json_name), "w") as f:
            json.dump(RES, f, indent=1, default=str)
    print("done", flush=True)


def main():
    steps = [
        ("compile", compile_times), ("registry", registry), ("qmm_correct", qmm_correct), ("gather_correct", gather_correct),
        ("attention_correct", attention_correct), ("qmm_sweep", qmm_sweep), ("attention_sweep", attention_sweep),
        ("gather_speed", gather_speed),
        ("forward", section("forward")(lambda: forward("llama-8b", None, [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]))),
        ("forward_moe", section("forward_moe")(lambda: forward("qwen3-30b-a3b", 12, [1, 2, 4, 8, 16]))),
        ("e2e", e2e),
    ]
    run_steps(steps, "kernels.json")


if __name__ == "__main__":
    main()
