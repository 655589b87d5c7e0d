"""Train a DFlash block drafter (drafters/dflash.py, z-lab's DFlashDraftModel layout) for a target that has
none, on the target's own answers (the shared self-distillation corpora in train/data).

    python -m mlx_engine train-dflash --out DIR [--model M] [--corpus FILES] [--steps N] [--block-size B]
        [--layers N] [--target-layers i,j,..] [--anchors A] [--batch S] [--vocab-subset N]

The drafter: fc + hidden_norm over the concatenated outputs of the chosen target layers (the context), N
Qwen3-style layers whose queries are the block [x_a, mask x (B-1)] at positions a..a+B-1 and whose keys /
values are the context rows of positions < a plus the block itself (bidirectional inside the block), final
norm, then the target's frozen output layer. It learns the target's next B-1 tokens after x_a: the corpus
answers are the target's greedy answers, so cross-entropy on them is self-distillation at temperature 0.

Training as DFlash trains: many anchors a per sequence in one pass (each block sees only the context before
its anchor and its own rows, a sparse mask), the loss of block row j weighted exp(-(j-1)/gamma) (early
rows decide the accepted length), anchors only where the labels are answer tokens. The target runs once
over the corpus (no grad); its layer features are kept in float16. `--vocab-subset N` takes the training
softmax over the N most frequent corpus tokens (the drafter still scores the full vocabulary when it runs).
The layers start as copies of the target's last layers (same shapes), q/k norms at 1.

Output: DIR/config.json + DIR/model.safetensors, a DFlash checkpoint: `--drafter dflash --dflash DIR`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .. import _platform  # noqa: F401  OpenBLAS before mlx

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from ..args import ArgumentParser, HelpFormatter, count, finite  # noqa: E402
from ..drafters.dflash import DFlashModel  # noqa: E402
from ..target.hidden import HiddenRequest  # noqa: E402
from .batches import choose_subset, schedule  # noqa: E402
from .corpus import _text_rows, log  # noqa: E402


def default_layer_ids(n_layers: int, n: int = 4) -> tuple[int, ...]:
    """n target layers spread from layer 1 to layer n_layers - 2 (as z-lab's checkpoints pick them)."""
    if n == 1:
        return (n_layers - 2,)
    return tuple(int(round(1 + i * (n_layers - 3) / (n - 1))) for i in range(n))


def drafter_config(target_args: dict, layer_ids, n_layers: int, block_size: int, mask_token_id: int) -> dict:
    H = target_args["hidden_size"]
    nh = target_args["num_attention_heads"]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "num_hidden_layers": n_layers, "intermediate_size": target_args["intermediate_size"],
        "num_attention_heads": nh, "num_key_value_heads": target_args.get("num_key_value_heads", nh),
        "head_dim": target_args.get("head_dim") or H // nh, "rms_norm_eps": target_args.get("rms_norm_eps", 1e-6),
        "rope_theta": target_args.get("rope_theta", 10000.0), "max_position_embeddings":
        target_args.get("max_position_embeddings", 8192), "vocab_size": target_args["vocab_size"],
        "attention_bias": False, "layer_types": ["full_attention"] * n_layers, "block_size": block_size,
        "num_target_layers": target_args["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id},
    }


def init_from_target(model: DFlashModel, target) -> None:
    """Each drafter layer starts as a copy of one of the target's last layers (names and shapes agree for
    Llama / Qwen targets); q/k norms 1, fc small random, the final norm the target's."""
    layers = target.layers[-len(model.layers):]
    for mine, theirs in zip(model.layers, layers):
        src = dict(tree_flatten(theirs.parameters()))
        own = dict(tree_flatten(mine.parameters()))
        mine.load_weights([(k, v) for k, v in src.items() if k in own and own[k].shape == v.shape], strict=False)
    model.norm.weight = mx.array(target.inner.norm.weight)


def encode(target, seqs: list[list[int]], layer_ids, progress=log) -> list[np.ndarray]:
    """The chosen target layers' outputs for every token of every sequence (float16), one pass each."""
    req = HiddenRequest(layers=tuple(layer_ids), final=False)
    out, t0 = [], time.perf_counter()
    for i, s in enumerate(seqs):
        _, h = target.forward(mx.array(s, dtype=mx.int32), target.make_cache(), req)
        out.append(np.array(h.astype(mx.float16)))
        if progress and (i + 1) % 100 == 0:
            progress(f"encoded {i + 1}/{len(seqs)} sequences ({time.perf_counter() - t0:.0f} s)")
    return out


def _rope(x, pos, base: float):
    """Non-traditional RoPE (rotate halves) at per-row positions: x [S, heads, R, D], pos [S, R]."""
    D = x.shape[-1]
    inv = 1.0 / base ** (mx.arange(0, D, 2, dtype=mx.float32) / D)
    ang = pos[:, None, :, None].astype(mx.float32) * inv
    c, s = mx.cos(ang), mx.sin(ang)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def block_forward(model: DFlashModel, feats, ctx_pos, emb, blk_pos, mask, base: float):
    """The drafter over many blocks at once. feats [S, L, F] context features (positions ctx_pos [S, L]),
    emb [S, R, H] block inputs (positions blk_pos [S, R]), mask [S, R, L + R] (what each block row sees).
    -> final-normed block hidden [S, R, H]. Same arithmetic as DFlashModel.__call__ at inference."""
    ctx = model.hidden_norm(model.fc(feats))
    h = emb
    S, R, _ = emb.shape
    L = ctx.shape[1]
    for layer in model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_norm(a.q_proj(x).reshape(S, R, a.nh, a.D)).transpose(0, 2, 1, 3)
        both = mx.concatenate([ctx, x], axis=1)
        k = a.k_norm(a.k_proj(both).reshape(S, L + R, a.nkv, a.D)).transpose(0, 2, 1, 3)
        v = a.v_proj(both).reshape(S, L + R, a.nkv, a.D).transpose(0, 2, 1, 3)
        q = _rope(q, blk_pos, base)
        k = _rope(k, mx.concatenate([ctx_pos, blk_pos], axis=1), base)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=a.D**-0.5, mask=mask[:, None])
        h = h + a.o_proj(o.transpose(0, 2, 1, 3).reshape(S, R, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def cached_features(out: Path, target, rows, layer_ids, src: str) -> list[np.ndarray]:
    """encode(), kept in OUT/cache/features.safetensors for a rerun on the same sequences and layers."""
    path = out / "cache" / "features.safetensors"  # not beside the checkpoint's own safetensors
    sig = hashlib.sha1(json.dumps([src, list(layer_ids), rows]).encode()).hexdigest()
    offsets = np.cumsum([0] + [len(r) for r in rows])
    if path.is_file():
        w, meta = mx.load(str(path), return_metadata=True)
        if meta.get("signature") == sig:
            h = np.array(w["features"])
            log(f"features of {len(rows)} sequences read from {path}")
            return [h[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    log(f"encoding {len(rows)} sequences ({offsets[-1]} tokens) with target layers {tuple(layer_ids)}")
    feats = encode(target, rows, layer_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), {"features": mx.array(np.concatenate(feats))}, metadata={"signature": sig})
    return feats


def make_batch(rng, data, idx, seq_len: int, anchors: int, B: int, mask_id: int, sub_index: np.ndarray):
    """One window of up to `seq_len` context rows per sequence, `anchors` blocks in it (anchors where the
    labels are answer tokens; each block sees the context rows before its anchor and its own rows).
    -> numpy arrays (feats, ctx_pos, block_ids, blk_pos, mask, labels, weights)."""
    S, A, L = len(idx), anchors, seq_len
    F = data[0][1].shape[1]
    feats = np.zeros((S, L, F), np.float16)
    ctx_pos = np.zeros((S, L), np.int32)
    ids = np.full((S, A, B), mask_id, np.int32)
    blk_pos = np.zeros((S, A, B), np.int32)
    mask = np.zeros((S, A * B, L + A * B), bool)
    labels = np.zeros((S, A, B - 1), np.int32)
    valid = np.zeros((S, A, B - 1), np.float32)
    for b in range(A):  # every block row sees its own block (both ways), whatever else it sees
        mask[:, b * B : (b + 1) * B, L + b * B : L + (b + 1) * B] = True
    for i, j in enumerate(idx):
        toks, h, start = data[j]
        n = len(toks)
        lo = max(start, 1)  # anchors a with answer tokens as labels (a+1..), and some context before a
        w_min = max(0, lo - L)
        w0 = int(rng.integers(w_min, max(w_min, n - 2 - L // 2) + 1))  # context rows: positions w0..w0+m-1
        a_lo, a_hi = max(lo, w0), min(n - 2, w0 + L)
        if a_hi < a_lo:
            continue
        m = min(L, n - w0)
        feats[i, :m] = h[w0 : w0 + m]
        ctx_pos[i, :m] = np.arange(w0, w0 + m)
        for b, a in enumerate(rng.integers(a_lo, a_hi + 1, size=A)):
            a = int(a)
            ids[i, b, 0] = toks[a]
            blk_pos[i, b] = a + np.arange(B)
            mask[i, b * B : (b + 1) * B, : min(m, a - w0)] = True  # the context before the anchor
            tgt = toks[a + 1 : a + B]
            labels[i, b, : len(tgt)] = sub_index[tgt]
            valid[i, b, : len(tgt)] = sub_index[tgt] >= 0
    labels = np.maximum(labels, 0)
    return feats, ctx_pos, ids.reshape(S, A * B), blk_pos.reshape(S, A * B), mask, labels, valid


class Trainer:
    def __init__(self, model: DFlashModel, target, data, subset: np.ndarray | None, args):
        self.model, self.target, self.data, self.args = model, target, data, args
        vocab = target.vocab_size
        self.subset = subset
        self.sub_index = np.full(vocab, -1, np.int64)
        self.sub_index[subset if subset is not None else np.arange(vocab)] = np.arange(
            len(subset) if subset is not None else vocab)
        W = target_output_matrix(target)
        self.W = W[mx.array(subset)] if subset is not None else W
        self.base = float(model.rope.base) if hasattr(model.rope, "base") else float(args.rope_theta)
        self.opt = optim.AdamW(learning_rate=schedule(args.lr, args.steps, args.warmup), weight_decay=0.0)
        self.B = model.settings["block_size"]
        j = np.arange(self.B - 1)
        self.row_w = mx.array(np.exp(-j / args.gamma).astype(np.float32))
        self.rng = np.random.default_rng(args.seed)
        self.step = 0

    def loss(self, model, feats, ctx_pos, ids, blk_pos, mask, labels, valid):
        emb = self.target.embed_tokens(ids).astype(mx.float32) * model.settings["input_embedding_scale"]
        h = block_forward(model, feats.astype(mx.float32), ctx_pos, emb, blk_pos, mask, self.base)
        S = h.shape[0]
        h = h.reshape(S, -1, self.B, h.shape[-1])[:, :, 1:]  # rows 1..B-1 of each block
        logits = h @ self.W.T
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        w = valid * self.row_w
        top1 = ((mx.argmax(logits, axis=-1) == labels) * valid).sum() / mx.maximum(valid.sum(), 1)
        return (ce * w).sum() / mx.maximum(w.sum(), 1e-6), top1

    def train_step(self):
        a = self.args
        idx = self.rng.integers(0, len(self.data), size=a.batch)
        batch = [mx.array(x) for x in make_batch(self.rng, self.data, idx, a.seq_len, a.anchors, self.B,
                                                  self.model.settings["mask_token_id"], self.sub_index)]
        fn = nn.value_and_grad(self.model, lambda m, *b: self.loss(m, *b)[0])
        loss, grads = fn(self.model, *batch)
        if a.clip:
            grads, _ = optim.clip_grad_norm(grads, a.clip)
        self.opt.update(self.model, grads)
        mx.eval(self.model.parameters(), self.opt.state, loss)
        self.step += 1
        return float(loss)

    def evaluate(self, data, n: int = 32):
        rng = np.random.default_rng(12345)
        idx = rng.integers(0, len(data), size=min(n, len(data)))
        batch = [mx.array(x) for x in make_batch(rng, data, idx, self.args.seq_len, self.args.anchors, self.B,
                                                  self.model.settings["mask_token_id"], self.sub_index)]
        loss, top1 = self.loss(self.model, *batch)
        return float(loss), float(top1)


def target_output_matrix(target) -> mx.array:
    text = target.text
    if hasattr(text, "lm_head"):
        return text.lm_head.weight
    return target.embed_tokens.weight


def save(model: DFlashModel, cfg: dict, out: Path, info: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    (out / "train.json").write_text(json.dumps(info, indent=1))
    return out / "model.safetensors"


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m mlx_engine train-dflash", formatter_class=HelpFormatter,
                       description="Train a DFlash block drafter for a target on its own answers. Writes a DFlash "
                                   "checkpoint folder OUT (config.json + model.safetensors): --drafter dflash --dflash OUT.")
    p.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output folder (required)")
    data = Path(__file__).parent / "data"
    p.add_argument("--corpus", nargs="+", default=[str(data / "corpus_greedy.jsonl")],
                   help=".jsonl corpora of the target's answers (prompt_ids + response_ids rows; default: the shipped "
                        "greedy corpus)")
    p.add_argument("--target-layers", default=None, help="comma-separated target layer ids (default: 4 spread)")
    p.add_argument("--layers", type=count(1), default=2, help="drafter layers")
    p.add_argument("--block-size", type=count(2), default=8, help="block size B (B-1 drafts per pass)")
    p.add_argument("--mask-token", type=int, default=0, help="mask token id (default 0)")
    p.add_argument("--steps", type=count(1), default=300)
    p.add_argument("--batch", type=count(1), default=8, help="windows per step")
    p.add_argument("--seq-len", type=count(2), default=128, help="context rows per window")
    p.add_argument("--anchors", type=count(1), default=8, help="blocks per window")
    p.add_argument("--gamma", type=finite(0.1), default=4.0, help="loss weight of block row j: exp(-(j-1)/gamma)")
    p.add_argument("--lr", type=finite(0.0), default=1e-3)
    p.add_argument("--warmup", type=count(0), default=20)
    p.add_argument("--clip", type=finite(0.0), default=1.0)
    p.add_argument("--vocab-subset", type=count(0), default=8192, help="training softmax over N tokens (0 = all)")
    p.add_argument("--max-sequences", type=count(0), default=0, help="use the first N corpus sequences (0 = all)")
    p.add_argument("--heldout", type=finite(0.0), default=0.05, help="fraction of sequences held out for eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=count(1), default=10)
    p.add_argument("--minutes", type=finite(0.0), default=0.0, help="stop after this wall time (0 = no limit)")
    return p


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code
    from ..models import load
    from ..target.model import Target

    try:
        wanted = tuple(int(x) for x in args.target_layers.split(",")) if args.target_layers else None
    except ValueError:
        log(f"error: --target-layers {args.target_layers!r}: comma-separated integers expected")
        return 2
    for f in args.corpus:
        if not Path(f).is_file():
            log(f"error: corpus file {f} does not exist")
            return 2
    src = args.model
    if src is None:
        from ..models.default import default_model_path

        src = str(default_model_path())
    t0 = time.perf_counter()
    m = load(src)
    m.model.freeze()
    target = Target(m.model)
    targs = dict(m.config)
    n_t = targs["num_hidden_layers"]
    layer_ids = wanted or default_layer_ids(n_t)
    if any(not -n_t <= i < n_t for i in layer_ids):
        log(f"error: --target-layers {layer_ids}: the target has {n_t} layers")
        return 2
    rows, starts = [], []
    for f in args.corpus:
        r, s = _text_rows(Path(f), m.tokenizer)
        rows += r
        starts += s
    keep = [i for i, r in enumerate(rows) if len(r) >= args.block_size + 2]
    rows, starts = [rows[i] for i in keep], [starts[i] for i in keep]
    if not rows:
        log("error: the corpus has no sequence long enough")
        return 2
    if args.max_sequences:
        rows, starts = rows[: args.max_sequences], starts[: args.max_sequences]
    feats = cached_features(Path(args.out), target, rows, layer_ids, src)
    data = [(np.array(r, np.int64), h, s) for r, h, s in zip(rows, feats, starts)]
    n_eval = max(1, int(len(data) * args.heldout))
    order = np.random.default_rng(args.seed).permutation(len(data))
    heldout, train = [data[i] for i in order[:n_eval]], [data[i] for i in order[n_eval:]]
    vocab = target.vocab_size
    stop = set(getattr(m.tokenizer, "eos_token_ids", None) or [])
    subset = (choose_subset([(t, None) for t, _, _ in train], args.vocab_subset, vocab, always=stop)
              if args.vocab_subset and args.vocab_subset < vocab else None)
    cfg = drafter_config(targs, layer_ids, args.layers, args.block_size, args.mask_token)
    mx.random.seed(args.seed)
    model = DFlashModel(cfg)
    init_from_target(model, target)
    args.rope_theta = cfg["rope_theta"]
    trainer = Trainer(model, target, train, subset, args)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"drafter: {n_params / 1e6:.2f}M parameters, {args.layers} layers, block {args.block_size}; "
        f"{len(train)} train / {len(heldout)} held-out sequences; encoding took {time.perf_counter() - t0:.0f} s")
    t_train = time.perf_counter()
    ev = trainer.evaluate(heldout)
    history = [[0, None, ev[0], ev[1]]]  # [step, train loss, held-out loss, held-out top-1]
    log(f"step 0: held-out loss {ev[0]:.3f}, top-1 {ev[1]:.3f}")
    try:
        while trainer.step < args.steps:
            loss = trainer.train_step()
            if trainer.step % args.log_every == 0 or trainer.step == args.steps:
                ev = trainer.evaluate(heldout)
                history.append([trainer.step, loss, ev[0], ev[1]])
                log(f"step {trainer.step}: loss {loss:.3f}, held-out loss {ev[0]:.3f}, top-1 {ev[1]:.3f} "
                    f"({time.perf_counter() - t_train:.0f} s)")
            if args.minutes and time.perf_counter() - t_train > 60 * args.minutes:
                log(f"--minutes {args.minutes}: stopping at step {trainer.step}")
                break
    except KeyboardInterrupt:
        log(f"interrupted at step {trainer.step}: writing the drafter as it is")
    info = {"model": src, "corpus": args.corpus, "steps": trainer.step, "history": history,
            "train_minutes": round((time.perf_counter() - t_train) / 60, 2),
            "args": {k: v for k, v in vars(args).items()}}
    path = save(model, cfg, Path(args.out), info)
    log(f"wrote {path}; use: --drafter dflash --dflash {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
