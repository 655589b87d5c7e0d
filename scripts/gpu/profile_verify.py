"""Profile of the verify forward on a GPU (issue 12, step 1): where the batch-invariant path loses.

Run on the device machine: `source .gpu/setup.sh; python3 scripts/gpu/profile_verify.py --out $OUT`.
Prints and writes (JSON) for the llama-8b and qwen3-30b-a3b shapes (random 4-bit weights):
  * forward t(L) for L = 1..16 over a 512-token cache: stock, batch-invariant (all), linears only,
    attention only; the number of graph nodes (~ kernel launches) per forward;
  * per-op: quantized matmul of each linear shape at M = 1, 2, 4, 8, 16 rows, stock vs batch_qmm
    (weights rotated through a pool larger than L2, so the time is DRAM time);
  * attention of one layer at L = 1..16 over 512 keys: stock SDPA vs invariant_attention;
  * rms_norm, rope and the launch overhead of a trivial custom kernel vs a stock op.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, os.getcwd())

from mlx_engine import kernels  # noqa: E402
from mlx_engine.target import batch_invariant as bi  # noqa: E402
from mlx_engine.bench.shapes import build, describe  # noqa: E402


def med_ms(fn, trials=7, warmup=2):
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


def forward_times(model, lengths, prefill=512, trials=7, call=None):
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    call = call or (lambda toks, cache: model(toks, cache=cache))
    vocab = model.args.vocab_size
    toks = mx.random.randint(0, vocab, (1, prefill + max(lengths)), key=mx.random.key(1))
    cache = make_prompt_cache(model)
    mx.eval(model(toks[:, :prefill], cache=cache))
    out = {}
    for L in lengths:
        chunk = toks[:, prefill : prefill + L]

        def step():
            mx.eval(call(chunk, cache))
            trim_prompt_cache(cache, L)

        out[L] = med_ms(step, trials)
    return out


def graph_nodes(model, L, prefill=64):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    toks = mx.random.randint(0, model.args.vocab_size, (1, prefill + L), key=mx.random.key(2))
    mx.eval(model(toks[:, :prefill], cache=cache))
    y = model(toks[:, prefill:], cache=cache)
    path = "/tmp/graph.dot"
    mx.export_to_dot(path, y)
    with open(path) as f:
        text = f.read()
    mx.eval(y)
    import collections
    import re

    labels = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))
    views = {"Slice", "Squeeze", "ExpandDims", "Broadcast", "Reshape", "Transpose", "AsStrided", "Unflatten", "Flatten"}
    return {"primitives": sum(labels.values()), "non_view": sum(n for k, n in labels.items() if k not in views),
            "top": dict(labels.most_common(12))}


def pool(make, budget_bytes=400 << 20):
    items = [make(0)]
    size = sum(a.nbytes for a in items[0])
    n = max(2, min(64, budget_bytes // max(1, size)))
    items += [make(i) for i in range(1, n)]
    mx.eval(items)
    return items


def qmm_table(shapes, rows, bits=4, gs=64, dtype=mx.bfloat16):
    from mlx_engine.kernels.batch_qmm import qmm_cuda

    table = []
    for (N, K) in shapes:
        def make(i, N=N, K=K):
            key = mx.random.key(100 + i)
            w = mx.random.randint(0, 1 << 16, (N, K * bits // 32), dtype=mx.uint32, key=key)
            w = (w << 16) | w
            s = (mx.random.uniform(0.5, 1.5, (N, K // gs), key=key) * 0.003).astype(dtype)
            return (w, s, -8 * s)

        ws = pool(make)
        for M in rows:
            x = mx.random.normal((M, K), key=mx.random.key(M)).astype(dtype)
            mx.eval(x)
            stock = lambda: mx.eval([mx.quantized_matmul(x, w, s, b, True, gs, bits) for (w, s, b) in ws])
            fused = lambda: mx.eval([qmm_cuda(x, w, s, b, gs, bits) for (w, s, b) in ws])
            ts = med_ms(stock) / len(ws) * 1e3
            tf = med_ms(fused) / len(ws) * 1e3
            wbytes = sum(a.nbytes for a in ws[0])
            table.append(dict(N=N, K=K, M=M, stock_us=ts, batch_qmm_us=tf, weight_MB=wbytes / 1e6,
                              stock_GBs=wbytes / ts / 1e3, batch_qmm_GBs=wbytes / tf / 1e3))
            print(f"qmm N={N:6d} K={K:5d} M={M:2d}: stock {ts:8.1f} us  batch_qmm {tf:8.1f} us  "
                  f"({wbytes / ts / 1e3:6.0f} / {wbytes / tf / 1e3:6.0f} GB/s)", flush=True)
    return table


def gather_table(E, topk, N, K, rows, bits=4, gs=64, dtype=mx.bfloat16):
    table = []
    key = mx.random.key(7)
    w = mx.random.randint(0, 1 << 16, (E, N, K * bits // 32), dtype=mx.uint32, key=key)
    s = (mx.random.uniform(0.5, 1.5, (E, N, K // gs), key=key) * 0.003).astype(dtype)
    b = -8 * s
    mx.eval(w, s, b)
    for L in rows:
        x = mx.random.normal((L, 1, 1, K), key=mx.random.key(L)).astype(dtype)
        idx = mx.stack([mx.random.permutation(E, key=mx.random.key(1000 + L * 31 + i))[:topk] for i in range(L)])
        idx = idx.astype(mx.uint32)
        mx.eval(x, idx)
        reps = 20
        f = lambda: mx.eval([mx.gather_qmm(x + i, w, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits) for i in range(reps)])
        t = med_ms(f) / reps * 1e3
        uniq = len(set(idx.reshape(-1).tolist()))
        table.append(dict(L=L, E=E, topk=topk, N=N, K=K, stock_us=t, unique_experts=uniq))
        print(f"gather_qmm E={E} top{topk} N={N} K={K} L={L:2d}: stock {t:8.1f} us ({uniq} distinct experts)", flush=True)
    return table


def attention_table(Hq, Hk, D, N, rows, dtype=mx.bfloat16, layers=32):
    table = []
    ks = [mx.random.normal((1, Hk, N + 16, D), key=mx.random.key(i)).astype(dtype) for i in range(layers)]
    vs = [mx.random.normal((1, Hk, N + 16, D), key=mx.random.key(100 + i)).astype(dtype) for i in range(layers)]
    mx.eval(ks, vs)
    for L in rows:
        q = mx.random.normal((1, Hq, L, D), key=mx.random.key(L)).astype(dtype)
        mx.eval(q)
        mask = "causal" if L > 1 else None
        kk = [k[:, :, : N + L] for k in ks]
        vv = [v[:, :, : N + L] for v in vs]
        stock = lambda: mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask) for k, v in zip(kk, vv)])
        inv = lambda: mx.eval([bi.invariant_attention(q, k, v, scale=D**-0.5, mask=mask) for k, v in zip(kk, vv)])
        ts = med_ms(stock) / layers * 1e3
        ti = med_ms(inv) / layers * 1e3
        table.append(dict(L=L, N=N, Hq=Hq, Hk=Hk, D=D, stock_us=ts, invariant_us=ti))
        print(f"attention Hq={Hq} Hk={Hk} D={D} keys={N}+{L} L={L:2d}: stock {ts:8.1f} us  invariant {ti:8.1f} us", flush=True)
    return table


def misc_table(hidden=4096, dtype=mx.bfloat16):
    out = {}
    x = mx.random.normal((1, hidden), key=mx.random.key(0)).astype(dtype)
    w = mx.ones((hidden,), dtype)
    n = 200

    def chain(op):
        def f():
            y = x
            for _ in range(n):
                y = op(y)
            mx.eval(y)
        return f

    out["rms_norm_us"] = med_ms(chain(lambda y: mx.fast.rms_norm(y, w, 1e-5))) / n * 1e3
    out["add_us"] = med_ms(chain(lambda y: y + 1)) / n * 1e3
    src = "uint i = thread_position_in_grid.x; if (i < x_shape[1]) y[i] = x[i] + T(1);"
    src_cu = "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[1]) y[i] = x[i] + T(1);"
    k = mx.fast.cuda_kernel(name="trivial", input_names=["x"], output_names=["y"], source=src_cu)

    def custom(y):
        return k(inputs=[y], template=[("T", dtype)], grid=(hidden, 1, 1), threadgroup=(256, 1, 1),
                 output_shapes=[y.shape], output_dtypes=[dtype])[0]

    out["custom_kernel_us"] = med_ms(chain(custom)) / n * 1e3
    # python-side cost of building one custom-kernel call (no eval)
    t0 = time.perf_counter()
    for _ in range(n):
        custom(x)
    out["custom_kernel_build_us"] = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        x + 1
    out["stock_op_build_us"] = (time.perf_counter() - t0) / n * 1e6
    print("misc:", json.dumps({k: round(v, 2) for k, v in out.items()}), flush=True)
    return out


def model_profile(name, layers, lengths, trials):
    res = {"shape": describe(name, layers)}
    print("\n==", res["shape"], flush=True)
    t0 = time.perf_counter()
    model = build(name, layers=layers)
    res["build_s"] = time.perf_counter() - t0
    res["nodes"] = {L: graph_nodes(model, L) for L in (1, 4)}
    print("graph nodes per forward:", {L: (v["primitives"], v["non_view"]) for L, v in res["nodes"].items()}, flush=True)
    res["stock"] = forward_times(model, lengths, trials=trials)
    print("stock   ", {L: round(t, 2) for L, t in res["stock"].items()}, flush=True)
    # attention only: the switch and the attention wrapper, no linear swapped
    for name_ in {type(m).__module__ for _, m in model.named_modules()}:
        if name_.startswith("mlx_lm.models."):
            bi._wrap_attention_module(name_)
    bi._install_switch(model)
    res["attention_only"] = forward_times(model, lengths, trials=trials)
    print("attn    ", {L: round(t, 2) for L, t in res["attention_only"].items()}, flush=True)
    bi.make_batch_invariant(model)
    res["invariant"] = forward_times(model, lengths, trials=trials)
    print("inv     ", {L: round(t, 2) for L, t in res["invariant"].items()}, flush=True)
    base_call = type(model).__mro__[1].__call__  # the model's own __call__: switch off, linears swapped
    res["linears_only"] = forward_times(model, lengths, trials=trials, call=lambda t, c: base_call(model, t, cache=c))
    print("linears ", {L: round(t, 2) for L, t in res["linears_only"].items()}, flush=True)
    res["nodes_invariant"] = {L: graph_nodes(model, L) for L in (1, 4)}
    print("graph nodes per forward (invariant):", {L: (v["primitives"], v["non_view"]) for L, v in res["nodes_invariant"].items()}, flush=True)
    del model
    mx.clear_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args()
    print("MLX", mx.__version__, mx.default_device(), "kernels:", kernels.describe(), flush=True)
    res = {"mlx": mx.__version__}
    res["misc"] = misc_table()
    rows = [1, 2, 4, 8, 16]
    res["qmm"] = qmm_table([(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)], rows)
    res["attention"] = attention_table(32, 8, 128, 512, [1, 2, 4, 8, 16])
    res["gather"] = gather_table(128, 8, 768, 2048, [1, 2, 4, 8, 16])
    res["gather"] += gather_table(128, 8, 2048, 768, [1, 4, 8])
    lengths = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
    res["llama-8b"] = model_profile("llama-8b", None, lengths, args.trials)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    res["qwen3-30b-a3b"] = model_profile("qwen3-30b-a3b", 12, lengths, args.trials)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("done")


if __name__ == "__main__":
    main()
