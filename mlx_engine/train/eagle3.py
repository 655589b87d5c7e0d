"""Train an EAGLE-3 head for a target by self-distillation from the frozen target, with training-time test.

    python -m mlx_engine train-eagle3 --model M --out DIR [--corpus FILES] [--steps N] [--ttt D] [--resume] ...

Same corpus, progress lines, checkpoints and --resume as train-mtp (train/mtp.py, train/corpus.py,
train/batches.py); what differs:

- Features: the target's residual stream at boundaries (2, L//2, L-3) (drafters/eagle3.py) plus its
  final-normed state (the teacher), captured in one pass of the frozen target over each whole sequence
  (prompt included) and cached as DIR/eagle3_corpus.safetensors (float16, [tokens, 4H]). Safetensors corpora
  of train-mtp hold only the final state, so text/jsonl corpora are read (the target re-encodes them).
- The head (drafters/eagle3.Eagle3Head): fc [H, 3H], one midlayer over cat[input_layernorm(Emb(t)),
  hidden_norm(g)], norm, lm_head over the draft vocabulary (`--vocab-subset N` -> d2t); the target's
  embedding is shared and frozen. Written as an EAGLE-3 checkpoint folder in the HF layout (config.json +
  model.safetensors), loaded by `--drafter eagle3 --eagle3 DIR`.
- Training-time test (EAGLE-3 §3.2): step 0 feeds slot p (Emb(t_{p+1}), fc(f_p)) and learns the target's
  distribution of token p+2; step j > 0 feeds (Emb(t_{p+j+1}), y^{j-1}_p), the head's OWN pre-norm output
  of the step before, at RoPE position p+j, and learns token p+j+2. Step j's query of anchor p attends to
  the step-0 keys of slots 0..p (what the drafter's cache holds: exact slots) and to the anchor's own chain
  keys of steps 1..j (the draft-time entries), exactly the drafter's run-time attention; loss weight
  `--ttt-decay`^j. KL(target || head) over the draft vocabulary with the teacher renormalised to it (as
  train-mtp, same optimum under the support constraint).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from .. import _platform  # noqa: F401  OpenBLAS before mlx

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from ..args import count, finite  # noqa: E402
from ..drafters.eagle3 import Eagle3Head, default_aux_ids  # noqa: E402
from ..drafters.vocab_subset import output_rows  # noqa: E402
from ..target_model.hidden import HiddenRequest  # noqa: E402
from . import mtp  # noqa: E402
from .command import run_trainer  # noqa: E402
from .batches import batch_order, make_windows  # noqa: E402
from .corpus import (  # noqa: E402
    GENERATED, _text_rows, frozen_target, generate_corpus_resumable, log, read_corpus, save_corpus,
)
from .inputs import TrainInputError, check_checkpoint, check_corpus_files, read_prompts, writable_dir  # noqa: E402
from .loop import resume_and_train  # noqa: E402

FEATURES = "eagle3_corpus.safetensors"
CONFIG, WEIGHTS, INFO = "config.json", "model.safetensors", "eagle3.json"


def feature_request(num_layers: int) -> tuple[tuple[int, ...], HiddenRequest]:
    """(boundaries, the capture of their layers + the final-normed state)."""
    ids = default_aux_ids(num_layers)
    return ids, HiddenRequest(layers=tuple(j - 1 for j in ids), final=True)


def encode_features(target, rows: list[list[int]], starts: list[int], request: HiddenRequest, batch: int = 8,
                    chunk: int = 512, progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The frozen target over whole sequences; per sequence (tokens[s:], features[s:] float16 [n, 4H])."""
    from mlx_lm.models.cache import make_prompt_cache

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out: list = [None] * len(rows)
    done, t0 = 0, time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        n = max(len(rows[i]) for i in idx)
        x = mx.array([rows[i] + [0] * (n - len(rows[i])) for i in idx], dtype=mx.int32)  # right padding: causal
        cache = make_prompt_cache(target.model)
        hs = []
        for s in range(0, n, chunk):
            h = target.hidden_batch(x[:, s : s + chunk], cache, request).astype(mx.float16)
            mx.eval(h)
            hs.append(h)
        h = np.array(mx.concatenate(hs, axis=1))
        for j, i in enumerate(idx):
            out[i] = (np.array(rows[i][starts[i] :], dtype=np.int32), h[j, starts[i] : len(rows[i])])
        done += sum(len(rows[i]) for i in idx)
        if progress and (b // batch) % 5 == 0:
            progress(f"features: {b + len(idx)}/{len(rows)} sequences, {done} tokens, "
                     f"{done / (time.perf_counter() - t0):.0f} tok/s")
    return out


# -- the head -----------------------------------------------------------------------------------------------
def build_head(model, draft_vocab: int) -> Eagle3Head:
    from mlx_lm.models import llama

    from ..drafters.mtp.common import text_module

    a = text_module(model).args
    fields = {f: getattr(a, f) for f in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                                         "rms_norm_eps", "head_dim", "rope_theta", "rope_scaling",
                                         "max_position_embeddings", "rope_traditional")
              if getattr(a, f, None) is not None}
    args = llama.ModelArgs(model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=1,
                           vocab_size=a.vocab_size, **fields)
    return Eagle3Head(args, a.hidden_size, draft_vocab)


def init_head(head: Eagle3Head, target, ids: mx.array, how: str) -> None:
    """lm_head = the target's output rows of the draft vocabulary, norm = its final norm; fc starts as the
    high feature (identity on the last third). "last-layer": MLP, o_proj, post-attention norm and the
    hidden half of q/k/v copied from the target's last decoder layer."""
    h = head.norm.weight.shape[0]
    head.lm_head.weight = output_rows(target, ids).astype(mx.float32)
    norm = getattr(target.inner, "norm", None)
    if norm is not None and "weight" in norm:
        head.norm.weight = mx.array(norm.weight)
    w = head.fc.weight
    head.fc.weight = mx.concatenate([w[:, : 2 * h] * 0.1, mx.eye(h, dtype=w.dtype)], axis=1)
    if how != "last-layer":
        return
    last = target.inner.layers[-1]
    mid = head.midlayer
    mid.mlp.update(tree_map(lambda x: mx.array(x), last.mlp.parameters()))
    mid.post_attention_layernorm.weight = mx.array(last.post_attention_layernorm.weight)
    mid.self_attn.o_proj.weight = mx.array(last.self_attn.o_proj.weight)
    for name in ("q_proj", "k_proj", "v_proj"):
        mine, theirs = getattr(mid.self_attn, name), getattr(last.self_attn, name)
        mine.weight = mx.concatenate([mine.weight[:, :h], theirs.weight], axis=1)


def write_checkpoint(out: Path, head: Eagle3Head, subset: np.ndarray | None, vocab: int, boundaries, info: dict,
                     dtype=mx.bfloat16) -> Path:
    """The head as an EAGLE-3 checkpoint folder in the HF layout (what load_eagle3_head reads)."""
    arrays = {k: v.astype(dtype) for k, v in tree_flatten(head.parameters())}
    dv = head.lm_head.weight.shape[0]
    ids = np.arange(dv) if subset is None else subset.astype(np.int64)
    arrays["d2t"] = mx.array((ids - np.arange(dv)).astype(np.int32))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    arrays["t2d"] = mx.array(t2d)
    mx.save_safetensors(str(out / WEIGHTS), arrays, metadata={"format": "pt"})
    mid = head.midlayer.self_attn
    a = {"hidden_size": head.norm.weight.shape[0], "num_attention_heads": mid.n_heads,
         "num_key_value_heads": mid.n_kv_heads, "head_dim": mid.head_dim,
         "intermediate_size": head.midlayer.mlp.gate_proj.weight.shape[0]}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **a, "num_hidden_layers": 1,
           "rms_norm_eps": info["rms_norm_eps"], "rope_theta": info["rope_theta"], "vocab_size": vocab,
           "draft_vocab_size": dv, "target_hidden_size": a["hidden_size"], "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(boundaries), "use_aux_hidden_state": True}}
    (out / CONFIG).write_text(json.dumps(cfg, indent=2))
    (out / INFO).write_text(json.dumps(info, indent=2))
    return out / WEIGHTS


# -- training -----------------------------------------------------------------------------------------------
def _attend(attn, q, keys, values):
    """Step j's attention: causal over the step-0 keys, then the anchor's own chain keys (diagonal)."""
    S = q.shape[2]
    k0, v0 = keys[0], values[0]
    causal = mx.triu(mx.full((S, S), -mx.inf, dtype=q.dtype), k=1)
    s0 = (q * attn.scale) @ k0.swapaxes(-1, -2) + causal
    diag = [((q * attn.scale) * k).sum(-1, keepdims=True) for k in keys[1:]]
    p = mx.softmax(mx.concatenate([s0, *diag], axis=-1), axis=-1, precise=True)
    o = p[..., :S] @ v0
    for i, v in enumerate(values[1:]):
        o = o + p[..., S + i : S + i + 1] * v
    return o


def unroll(head, f, es) -> list[mx.array]:
    """Training-time test: the head's draft logits of steps j = 0..D-1 for every anchor slot, [B, S, V']
    each; f [B, S, 3H] the features of the anchors, es [D, B, S, H] the embeddings of t_{p+j+1}."""
    mid, attn = head.midlayer, head.midlayer.self_attn
    B, S, _ = f.shape
    rep = attn.n_heads // attn.n_kv_heads
    g = head.fc(f)
    keys, values, out = [], [], []
    for j in range(es.shape[0]):
        gn = mid.hidden_norm(g)
        x = mx.concatenate([mid.input_layernorm(es[j]), gn], axis=-1)
        q = attn.q_proj(x).reshape(B, S, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(x).reshape(B, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(x).reshape(B, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = attn.rope(q, offset=j), attn.rope(k, offset=j)  # step j sits at position p + j
        keys.append(mx.repeat(k, rep, axis=1))
        values.append(mx.repeat(v, rep, axis=1))
        o = _attend(attn, q, keys, values).transpose(0, 2, 1, 3).reshape(B, S, -1)
        h = (gn if mid.norm_before_residual else g) + attn.o_proj(o)
        y = h + mid.mlp(mid.post_attention_layernorm(h))
        out.append(head.lm_head(head.norm(y)))
        g = y  # the next step chains the head's own pre-norm output (as the drafter does)
    return out


class Eagle3Trainer(mtp.Trainer):
    """train-mtp's Trainer (checkpoint save/load, the loop) with the EAGLE-3 head and training-time test."""

    def __init__(self, target, head: Eagle3Head, subset: np.ndarray | None, seqs, args):
        self.target, self.head, self.args = target, head, args
        self.layer = head  # what the optimizer trains and the checkpoint holds
        vocab = target.vocab_size
        ids = mx.arange(vocab, dtype=mx.int32) if subset is None else mx.array(subset, dtype=mx.int32)
        self.W = output_rows(target, ids).astype(mx.float32)
        self.emb_table = target.inner.embed_tokens
        tokens, hidden, self.hid_idx, self.mask = make_windows(seqs, args.seq_len)
        last, off = np.empty(len(tokens), dtype=np.int32), 0
        for t, _ in seqs:  # the last position of each position's own sequence
            last[off : off + len(t)] = off + len(t) - 1
            off += len(t)
        self.last = last
        self.H = hidden.shape[1] // 4
        self.tokens = mx.array(tokens)
        self.hidden = mx.array(hidden)  # float16 [N, 4H]: three features, then the final-normed state
        mx.eval(self.W, self.tokens, self.hidden)
        self.n_windows = self.hid_idx.shape[0]
        self.n_slots = int(self.mask.sum())
        self.opt = self.optimizer(args.steps)
        self.opt.init(head.trainable_parameters())
        self.step = 0
        self._compiled = None

    def inputs(self, step: int):
        """Per TTT step j: embeddings of t_{p+j+1}, teacher states h_{p+j+1}, validity masks."""
        w = batch_order(self.n_windows, self.args.batch, step, self.args.seed)
        hi = self.hid_idx[w]
        base = self.mask[w]
        H, n = self.H, self.tokens.shape[0]
        f = self.hidden[mx.array(hi)][..., : 3 * H].astype(mx.float32)
        es, ths, ms = [], [], []
        for j in range(self.args.ttt):
            nxt = hi + j + 1
            ok = base * (nxt <= self.last[hi])
            idx = mx.array(np.minimum(nxt, n - 1))
            es.append(self.emb_table(self.tokens[idx]).astype(mx.float32))
            ths.append(self.hidden[idx][..., 3 * H :].astype(mx.float32))
            ms.append(mx.array(ok.astype(np.float32)))
        return f, mx.stack(es), mx.stack(ths), mx.stack(ms)

    def _loss(self, head, f, es, ths, ms, W):
        total, agree0, weight_sum = mx.array(0.0), mx.array(0.0), 0.0
        for j, s in enumerate(unroll(head, f, es)):
            t = mx.stop_gradient(ths[j] @ W.T)
            logp = t - mx.logsumexp(t, axis=-1, keepdims=True)
            logq = s - mx.logsumexp(s, axis=-1, keepdims=True)
            kl = (mx.exp(logp) * (logp - logq)).sum(-1)
            m = ms[j]
            denom = mx.maximum(m.sum(), 1.0)
            wj = self.args.ttt_decay ** j
            total = total + wj * (kl * m).sum() / denom
            weight_sum += wj
            if j == 0:
                agree0 = ((mx.argmax(s, -1) == mx.argmax(t, -1)).astype(mx.float32) * m).sum() / denom
        return total / weight_sum, agree0

    @staticmethod
    def slots(inputs) -> mx.array:
        """The slots of TTT step 0 (later steps train on the same slots' own continuations)."""
        return inputs[-1][0].sum()


# -- the command ----------------------------------------------------------------------------------------------
def _parser():
    p = mtp._parser()
    p.prog = "python -m mlx_engine train-eagle3"
    p.description = ("Train an EAGLE-3 head for a target model by self-distillation from the frozen target, with "
                     "training-time test. Writes OUT/config.json + OUT/model.safetensors (the EAGLE-3 HF layout); "
                     "use them with --drafter eagle3 --eagle3 OUT. docs/drafters.md: 'EAGLE-3 drafters'.")
    for a in p._actions:
        if a.dest == "corpus":
            a.help = (".jsonl or .txt files (the target re-encodes them whole to read its layer features; the "
                      "default: generate the target's own answers to --prompts)")
    p.add_argument("--ttt", type=count(1), default=4, help="training-time test depth: draft steps unrolled per slot")
    p.add_argument("--ttt-decay", type=fraction, default=0.8, help="loss weight of TTT step j is DECAY**j, in (0, 1]")
    p.add_argument("--encode-batch", type=count(1), default=8, help="sequences per batch when reading the features")
    return p


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = finite(0.0)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def corpus_rows(args, m, target, out: Path, prompts: list[str] | None):
    """(rows, starts, description): whole token sequences and the first position of each to train on.
    The files were checked (inputs.check_corpus_files); token ids are checked against the vocabulary here."""
    if args.corpus:
        rows, starts = [], []
        for f in args.corpus:
            r, s = _text_rows(Path(f), m.tokenizer, target.vocab_size)
            rows += r
            starts += s
        return rows, starts, [str(c) for c in args.corpus]
    prompts_file = args.prompts or mtp.DEFAULT_PROMPTS
    ids = [list(m.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
           for q in prompts]
    if not (out / GENERATED).is_file():
        log(f"generating the target's answers to {len(ids)} prompts from {prompts_file}")
    stop = set(getattr(m.tokenizer, "eos_token_ids", None) or [])
    seqs = generate_corpus_resumable(target, ids, out, args.gen_tokens, args.gen_batch, stop, args.seed)
    rows = [p[:-1] + t.tolist() for p, (t, _) in zip(ids, seqs)]
    return rows, [len(p) - 1 for p in ids], ["generated"]


def load_features(args, m, target, out: Path, request: HiddenRequest, prompts: list[str] | None):
    rows, starts, desc = corpus_rows(args, m, target, out, prompts)
    sig = hashlib.sha1(json.dumps([rows, starts, list(request.layers)]).encode()).hexdigest()
    cache = out / FEATURES
    if cache.is_file() and mx.load(str(cache), return_metadata=True)[1].get("signature") == sig:
        seqs = read_corpus(cache)
    else:
        log(f"reading the target's features of {len(rows)} sequences ({sum(map(len, rows))} tokens)")
        seqs = encode_features(target, rows, starts, request, batch=args.encode_batch, progress=log)
        tmp = out / ("tmp." + FEATURES)
        save_corpus(tmp, seqs, {"signature": sig})
        tmp.replace(cache)
    return [s for s in seqs if len(s[0]) >= 3], desc


def main(argv=None) -> int:
    return run_trainer(_parser(), train, argv, "no model loaded, no corpus read, nothing written")


def train(args) -> int:
    mtp.check_fit(args)
    if args.corpus:  # train-mtp's checks, with .safetensors corpora refused (they hold no layer features)
        check_corpus_files(args.corpus, safetensors=False)
    prompts = None if args.corpus else read_prompts(args.prompts or mtp.DEFAULT_PROMPTS)
    if args.resume:
        check_checkpoint(Path(args.out) / mtp.CKPT)
    out = writable_dir(args.out)
    t_start = time.perf_counter()
    m, target = frozen_target(args.model)
    boundaries, request = feature_request(len(target.layers))
    seqs, corpus_desc = load_features(args, m, target, out, request, prompts)
    if not seqs:
        raise TrainInputError(f"the corpus ({', '.join(corpus_desc)}) holds no sequence of 3 tokens or more")
    vocab = target.vocab_size
    stop = set(getattr(m.tokenizer, "eos_token_ids", None) or [])
    ckpt = out / mtp.CKPT
    subset = mtp.draft_subset(args, ckpt, seqs, vocab, stop)
    ids = mx.arange(vocab, dtype=mx.int32) if subset is None else mx.array(subset)
    mx.random.seed(args.seed)
    head = build_head(m.model, int(ids.shape[0]))
    init_head(head, target, ids, args.init)
    mx.eval(head.parameters())
    trainer = Eagle3Trainer(target, head, subset, seqs, args)
    n_tokens = sum(len(t) for t, _ in seqs)
    n_params = sum(v.size for _, v in tree_flatten(head.parameters()))
    history, train_seconds = resume_and_train(trainer, args, ckpt, subset, t_start, lambda: log(
        f"corpus: {len(seqs)} sequences, {n_tokens} tokens, {trainer.n_slots} slots in {trainer.n_windows} "
        f"windows of {args.seq_len}; features at boundaries {boundaries}; head {n_params / 1e6:.2f}M parameters, "
        f"draft vocabulary {int(ids.shape[0])}; TTT depth {args.ttt}; steps {trainer.step}->{args.steps}"))
    a = m.config
    info = {"format": "eagle3", "model": str(m.path), "corpus": corpus_desc, "corpus_sequences": len(seqs),
            "corpus_tokens": n_tokens, "steps": trainer.step, "batch": args.batch, "seq_len": args.seq_len,
            "ttt": args.ttt, "ttt_decay": args.ttt_decay, "lr": args.lr,
            "train_minutes": round(train_seconds / 60, 2),
            "final_loss": history[-1][1] if history else None,
            "final_top1_agree_step0": history[-1][2] if history else None,
            "rms_norm_eps": a.get("rms_norm_eps", 1e-6), "rope_theta": a.get("rope_theta", 10000.0)}
    path = write_checkpoint(out, head, subset, vocab, boundaries, info, getattr(mx, args.dtype))
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) and {out / CONFIG}; use: --drafter eagle3 --eagle3 {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
