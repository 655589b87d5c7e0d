"""Train a DFlash block drafter for a target by self-distillation (the frozen target's own answers).

    python -m mlx_engine.train.dflash --out DIR [--model M] [--corpus FILES] [--layers 1,10,19,28]
        [--block 8] [--draft-layers 1] [--steps N] [--minutes M]

Writes DIR/config.json + DIR/model.safetensors in z-lab's DFlashDraftModel layout, which
`--drafter dflash --dflash DIR` loads. The corpus rows are read as the MTP trainer reads them
(train/corpus.py `_text_rows`: prompt_ids + response_ids, tokens, prompt + response, text); the target runs
once over each sequence (no grad) keeping the outputs of `--layers` (the context features) and its
final-normed state (the teacher) in float16.

One training example: a sequence's features as context, and m anchors a (response positions): block
[t_a, mask x (B-1)] at positions a..a+B-1 attends the context rows < a plus its own rows (non-causal), the
rows 1..B-1 learn the target's distribution of tokens a+1..a+B-1, softmax(lm_head(h_{a+i-1})), over the
N most frequent tokens (the teacher renormalised there; the drafter scores the full vocabulary at run
time). All anchors of a sequence go in one pass with a block-diagonal mask, as DFlash is trained.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import _platform  # noqa: F401  OpenBLAS before mlx

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from ..args import ArgumentParser, HelpFormatter, count, finite, int_list  # noqa: E402
from ..drafters.dflash import DFlashModel  # noqa: E402
from ..target_model.hidden import HiddenRequest  # noqa: E402
from .batches import choose_subset, schedule  # noqa: E402
from .command import run_trainer  # noqa: E402
from .corpus import _text_rows, log  # noqa: E402
from .inputs import TrainInputError, check_corpus_files, writable_dir  # noqa: E402

DATA = Path(__file__).parent / "data"


def draft_config(target_args, layers, block: int, n_layers: int, mask_id: int) -> dict:
    H = target_args.hidden_size
    nh = target_args.num_attention_heads
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "num_hidden_layers": n_layers, "num_attention_heads": nh,
        "num_key_value_heads": target_args.num_key_value_heads, "head_dim": H // nh,
        "intermediate_size": target_args.intermediate_size, "rms_norm_eps": target_args.rms_norm_eps,
        "rope_theta": float(getattr(target_args, "rope_theta", 10000.0)), "max_position_embeddings": 8192,
        "vocab_size": target_args.vocab_size, "block_size": block, "num_target_layers": target_args.num_hidden_layers,
        "dflash_config": {"target_layer_ids": list(layers), "mask_token_id": mask_id},
    }


def encode(target, seqs, starts, layers):
    """Per sequence: (tokens, features [L, n*H] f16, final [L, H] f16, first anchor)."""
    req = HiddenRequest(layers=tuple(layers), final=True)
    out = []
    for s, st in zip(seqs, starts):
        _, h = target.forward(mx.array(s, dtype=mx.int32), target.make_cache(), req)
        h = h.astype(mx.float16)
        mx.eval(h)
        h = np.array(h)
        H = h.shape[1] // (len(layers) + 1)
        out.append((np.array(s, np.int32), h[:, : len(layers) * H], h[:, len(layers) * H :], max(st, 0)))
    return out


def _rope(x, pos, theta):
    """x [Bt, heads, n, D], pos [Bt, n] -> rotated halves (nn.RoPE non-traditional)."""
    D = x.shape[-1]
    inv = mx.power(theta, -mx.arange(0, D, 2, dtype=mx.float32) / D)
    ang = pos[:, None, :, None].astype(mx.float32) * inv
    c, s = mx.cos(ang), mx.sin(ang)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def train_forward(model: DFlashModel, emb, feats, qpos, mask, theta):
    """emb [Bt, R, H] block rows; feats [Bt, S, nH] context; qpos [Bt, R] positions of the rows; mask
    [Bt, R, S + R] visibility. -> final-normed rows [Bt, R, H]."""
    Bt, R, _ = emb.shape
    S = feats.shape[1]
    c = model.hidden_norm(model.fc(feats))
    cpos = mx.broadcast_to(mx.arange(S)[None], (Bt, S))
    h = emb
    for layer in model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_norm(a.q_proj(x).reshape(Bt, R, a.nh, a.D)).transpose(0, 2, 1, 3)
        kc = a.k_norm(a.k_proj(c).reshape(Bt, S, a.nkv, a.D)).transpose(0, 2, 1, 3)
        kb = a.k_norm(a.k_proj(x).reshape(Bt, R, a.nkv, a.D)).transpose(0, 2, 1, 3)
        keys = mx.concatenate([_rope(kc, cpos, theta), _rope(kb, qpos, theta)], axis=2)
        vals = mx.concatenate([a.v_proj(c).reshape(Bt, S, a.nkv, a.D), a.v_proj(x).reshape(Bt, R, a.nkv, a.D)],
                              axis=1).transpose(0, 2, 1, 3)
        o = mx.fast.scaled_dot_product_attention(_rope(q, qpos, theta), keys, vals, scale=a.D**-0.5,
                                                 mask=mask[:, None])
        h = h + a.o_proj(o.transpose(0, 2, 1, 3).reshape(Bt, R, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def make_batch(data, idx, rng, m: int, B: int, S: int, mask_id: int):
    """Bt sequences (cut to S), m anchors each -> arrays for train_forward + teacher rows + loss weights."""
    toks, feats, qpos, masks, tgt_rows, w = [], [], [], [], [], []
    R = m * B
    for i in idx:
        t, f, h, st = data[i]
        L = min(len(t), S)
        lo, hi = max(st, 1), L - B  # anchor a: a + B - 1 < L
        if hi <= lo:
            lo, hi = 1, max(2, L - B)
        a = np.sort(rng.choice(np.arange(lo, hi), size=m, replace=(hi - lo) < m))
        block = np.full((m, B), mask_id, np.int32)
        block[:, 0] = t[a]
        toks.append(block.reshape(-1))
        pos = (a[:, None] + np.arange(B)[None]).reshape(-1)
        qpos.append(pos)
        ff = np.zeros((S, f.shape[1]), np.float16)
        ff[:L] = f[:L]
        feats.append(ff)
        vis = np.zeros((R, S + R), bool)
        for j in range(m):
            vis[j * B : (j + 1) * B, : a[j]] = True  # context rows before the anchor
            vis[j * B : (j + 1) * B, S + j * B : S + (j + 1) * B] = True  # its own block
        masks.append(vis)
        # row (j, i >= 1) learns token a_j + i: teacher hidden h[a_j + i - 1]
        rows = np.clip(pos - 1, 0, L - 1)
        tgt_rows.append(h[rows])
        ww = np.tile((np.arange(B) > 0).astype(np.float32), m)
        w.append(ww)
    return (mx.array(np.stack(toks)), mx.array(np.stack(feats)), mx.array(np.stack(qpos)),
            mx.array(np.stack(masks)), mx.array(np.stack(tgt_rows)), mx.array(np.stack(w)))


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m mlx_engine train-dflash", description=__doc__.split("\n\n")[0],
                        formatter_class=HelpFormatter)
    ap.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help="output folder: config.json + model.safetensors (required)")
    ap.add_argument("--corpus", default=str(DATA / "corpus_greedy.jsonl"),
                    help="comma-separated .jsonl / .txt corpus files")
    ap.add_argument("--layers", type=int_list(0), default="1,10,19,28",
                    help="target layers whose outputs feed the drafter (comma-separated, each below the layer count)")
    ap.add_argument("--block", type=count(2), default=8, help="block size: the anchor token + block - 1 drafts")
    ap.add_argument("--draft-layers", type=count(1), default=1, help="decoder layers of the drafter")
    ap.add_argument("--anchors", type=count(1), default=16, help="blocks trained per sequence and step")
    ap.add_argument("--batch", type=count(1), default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=count(2), default=256, help="positions of a sequence used, >= --block + 3")
    ap.add_argument("--vocab-subset", type=count(1), default=8192,
                    help="the loss is taken over the N most frequent corpus tokens")
    ap.add_argument("--steps", type=count(0), default=1000, help="training steps (0: nothing is loaded or written)")
    ap.add_argument("--minutes", type=finite(0.0), default=0.0, help="stop after this many minutes (0 = no limit)")
    ap.add_argument("--lr", type=finite(0.0), default=1e-3, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data order")
    return ap


def main(argv=None) -> int:
    return run_trainer(_parser(), train, argv, "no model loaded, no corpus read, nothing written")


def check_inputs(a) -> Path:
    """What can be checked before the model loads; returns the output folder (created, proven writable)."""
    if a.seq_len < a.block + 3:
        raise TrainInputError(f"--seq-len {a.seq_len}: needs at least --block + 3 = {a.block + 3} positions")
    check_corpus_files(a.corpus.split(","), safetensors=False)
    return writable_dir(a.out)


def train(a) -> int:
    from ..models import load
    from ..target_model.model import Target

    out = check_inputs(a)
    loaded = load(a.model)
    target = Target(loaded.model)
    targs = target.text.args
    layers = a.layers
    n_layers = len(target.layers)
    if max(layers) >= n_layers:
        raise TrainInputError(f"--layers {','.join(map(str, layers))}: the target has layers 0..{n_layers - 1}")
    mask_id = int(loaded.tokenizer.eos_token_id or 0)
    cfg = draft_config(targs, layers, a.block, a.draft_layers, mask_id)
    seqs, starts = [], []
    for f in a.corpus.split(","):
        s, st = _text_rows(Path(f), loaded.tokenizer, target.vocab_size)
        seqs += s
        starts += st
    keep = [i for i, s in enumerate(seqs) if len(s) > a.block + 2]  # long enough for one block after an anchor
    if len(keep) < a.batch:
        raise TrainInputError(f"--corpus {a.corpus}: {len(keep)} sequences longer than --block + 2 = {a.block + 2} "
                              f"tokens, fewer than --batch {a.batch}")
    seqs, starts = [seqs[i] for i in keep], [starts[i] for i in keep]
    t0 = time.perf_counter()
    data = [d for d in encode(target, seqs, starts, layers) if len(d[0]) > a.block + 2]
    n_tok = sum(len(d[0]) for d in data)
    log(f"encoded {len(data)} sequences, {n_tok} tokens in {time.perf_counter() - t0:.0f}s")
    subset = choose_subset([(d[0], None) for d in data], a.vocab_subset, targs.vocab_size,
                           always=[int(loaded.tokenizer.eos_token_id or 0)])
    W_out = target.embed_tokens.weight if not hasattr(target.text, "lm_head") else target.text.lm_head.weight
    W_sub = mx.array(np.array(W_out)[subset])  # [N, H] frozen
    mx.random.seed(a.seed)
    model = DFlashModel(cfg)
    model.fc.weight = model.fc.weight * 0.5
    embed = target.embed_tokens
    theta = cfg["rope_theta"]
    opt = optim.AdamW(learning_rate=schedule(a.lr, a.steps, 50), weight_decay=0.01)

    def loss_fn(model, toks, feats, qpos, mask, teacher_h, w):
        emb = mx.stop_gradient(embed(toks))
        y = train_forward(model, emb, feats.astype(mx.float32), qpos, mask, theta)
        logq = nn.log_softmax(y @ W_sub.T, axis=-1)
        p = mx.softmax(mx.stop_gradient(teacher_h.astype(mx.float32) @ W_sub.T), axis=-1)
        kl = (p * (mx.log(p + 1e-9) - logq)).sum(-1)
        agree = (mx.argmax(logq, -1) == mx.argmax(p, -1)).astype(mx.float32)
        return (kl * w).sum() / w.sum(), (agree * w).sum() / w.sum()

    grad = nn.value_and_grad(model, loss_fn)
    rng = np.random.default_rng(a.seed)
    S = min(a.seq_len, max(len(d[0]) for d in data))
    t0 = time.perf_counter()
    step = 0
    for step in range(1, a.steps + 1):
        idx = rng.choice(len(data), size=a.batch, replace=False)
        batch = make_batch(data, idx, rng, a.anchors, a.block, S, mask_id)
        (loss, acc), g = grad(model, *batch)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state, loss, acc)
        if step % 25 == 0 or step == 1:
            log(f"step {step}/{a.steps} kl {loss.item():.3f} top-1 agreement {acc.item():.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
        if a.minutes and time.perf_counter() - t0 > 60 * a.minutes:
            break
    cfg["mlx_engine"] = {"trained_steps": step, "corpus": a.corpus, "seconds": round(time.perf_counter() - t0),
                         "vocab_subset": a.vocab_subset, "anchors": a.anchors, "batch": a.batch, "lr": a.lr}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    log(f"wrote {out}/config.json + model.safetensors ({step} steps); use --drafter dflash --dflash {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
