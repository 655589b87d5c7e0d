"""Train a DeepSeek-style MTP head for a target that ships none, by self-distillation from the frozen target.

    python -m mlx_engine train-mtp --model M --out DIR [--corpus FILES] [--steps N] [--seq-len L]
        [--batch B] [--lr LR] [--vocab-subset N] [--resume]

The head (drafters/mtp/trained.py): enorm, hnorm, eh_proj, one decoder block of the target's family, output
norm; the target's embedding and output matrix are shared and frozen. Head slot p takes (Emb(t_{p+1}), h_p)
with h_p the target's final-normed hidden state, and learns the TARGET's distribution for token p+2, i.e.
softmax(lm_head(h_{p+1})) (self-distillation: KL(teacher || head)).

Efficiency on a CPU:
- The target runs ONCE over the corpus (no grad) and its final-normed hidden states are kept (float16).
  The teacher distribution of slot p is lm_head(h_{p+1}): recomputed in each step from the stored hidden
  state with the same (subset) output matrix the head uses: a [S, H] matmul, far cheaper than storing
  [N, V] teacher logits.
- `--vocab-subset N`: the N most frequent tokens of the corpus (the target's own generations) plus the stop
  tokens. The head's logits AND the teacher's are taken over the subset only, the teacher renormalised
  over it. Why that and not the full-vocabulary KL: at run time the drafter puts probability 0 outside the
  subset, and among distributions q supported on S the cross-entropy -sum_x p(x) log q(x) is minimised by
  q = p restricted to S and renormalised, so the restricted+renormalised teacher has the same optimum as the
  full-vocabulary objective under the support constraint, at S/V of the cost (8192/49152 on SmolLM2).
- The train step (forward, backward, gradient clipping, AdamW) is one `mx.compile`d function.

Corpus files (`--corpus`, any mix):
- `.safetensors` written by `mlx_engine/train/make_corpus.py` / `save_corpus` (tokens + hidden states already there);
- `.jsonl` rows with `tokens` (ids), or `prompt_ids` + `response_ids`, or `prompt` + `response` (text; the
  prompt goes through the chat template), or `text`;
- `.txt` (plain text, split into chunks).
Text corpora are encoded once by the frozen target and cached in DIR/corpus_cache.safetensors.

Checkpoints (DIR/checkpoint/: head weights, optimizer state, step, seed and data order) every
`--ckpt-every` steps and at the end; `--resume` continues from the last one with identical state (the data
order is a function of the seed and the step). Output: DIR/mtp.safetensors (bf16 by default) + DIR/mtp.json,
which the engine loads with `--mtp-weights DIR/mtp.safetensors` or finds next to the model.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import _platform  # noqa: F401  OpenBLAS before mlx

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map, tree_unflatten  # noqa: E402

from ..args import ArgumentParser, HelpFormatter, count, finite  # noqa: E402
from ..drafters.vocab_subset import SUBSET_KEY, output_rows  # noqa: E402
from .batches import batch_order, choose_subset, make_windows, schedule, train_step_fn  # noqa: E402
from .command import run_trainer  # noqa: E402
from .corpus import GENERATED, frozen_target, generate_corpus_resumable, load_corpora, log, read_corpus  # noqa: E402
from .inputs import (  # noqa: E402
    TrainInputError, check_checkpoint, check_corpus_files, check_hidden_size, read_prompts, writable_dir,
)
from .loop import resume_and_train  # noqa: E402

CKPT = "checkpoint"
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts_train.jsonl"


# -- training -----------------------------------------------------------------------------------------------
def init_head(head, target, how: str = "last-layer") -> None:
    """The output norm starts as the target's final norm (the scale lm_head expects); with "last-layer" the
    block starts as a copy of the target's last decoder layer."""
    layer = head.layers[0]
    norm = getattr(target.inner, "norm", None)
    if norm is not None and "weight" in norm and norm.weight.shape == layer.norm.weight.shape:
        layer.norm.weight = mx.array(norm.weight)
    if how == "last-layer":
        layer.block.update(tree_map(lambda x: mx.array(x), target.inner.layers[-1].parameters()))


def head_file_arrays(head, subset: np.ndarray | None, dtype=mx.bfloat16) -> dict:
    arrays = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
              for k, v in tree_flatten(head.parameters())}
    if subset is not None:
        arrays[SUBSET_KEY] = mx.array(subset, dtype=mx.int32)
    return arrays


def write_head(out: Path, head, subset, config: dict, info: dict, dtype=mx.bfloat16) -> Path:
    from ..drafters.mtp import HEAD_FILE, HEAD_FORMAT, HEAD_JSON

    arrays = head_file_arrays(head, subset, dtype)
    meta = {"format": HEAD_FORMAT, "family": "trained", "target": config.get("model_type"), "num_layers": "1",
            "quantization": "", "vocab_subset": str(0 if subset is None else len(subset))}
    mx.save_safetensors(str(out / HEAD_FILE), arrays, metadata=meta)
    (out / HEAD_JSON).write_text(json.dumps({**meta, **info}, indent=2))
    return out / HEAD_FILE


class Trainer:
    def __init__(self, target, head, subset: np.ndarray | None, seqs, args):
        self.target, self.head, self.args = target, head, args
        self.layer = head.layers[0]
        ids = None if subset is None else mx.array(subset, dtype=mx.int32)
        vocab = target.vocab_size
        self.W = output_rows(target, ids if ids is not None else mx.arange(vocab, dtype=mx.int32)).astype(mx.float32)
        self.emb_table = target.inner.embed_tokens
        tokens, hidden, self.hid_idx, self.mask = make_windows(seqs, args.seq_len)
        self.tokens = mx.array(tokens)
        self.hidden = mx.array(hidden)  # float16, cast per batch
        mx.eval(self.W, self.tokens, self.hidden)
        self.n_windows = self.hid_idx.shape[0]
        self.n_slots = int(self.mask.sum())
        self.opt = self.optimizer(args.steps)
        self.opt.init(self.layer.trainable_parameters())
        self.step = 0
        self._compiled = None

    def optimizer(self, steps: int):
        """AdamW with the learning-rate schedule over `steps` (warm-up, then cosine decay)."""
        return optim.AdamW(learning_rate=schedule(self.args.lr, steps, self.args.warmup),
                           weight_decay=self.args.weight_decay)

    # one batch's inputs, built from the window indices (all gathers on device)
    def inputs(self, step: int):
        w = batch_order(self.n_windows, self.args.batch, step, self.args.seed)
        hi = mx.array(self.hid_idx[w])
        mask = mx.array(self.mask[w])
        e = self.emb_table(self.tokens[hi + 1]).astype(mx.float32)
        h = self.hidden[hi].astype(mx.float32)
        th = self.hidden[hi + 1].astype(mx.float32)
        return e, h, th, mask

    def _loss(self, layer, e, h, th, mask, W):
        x = layer.project(e, h)
        y = layer.block(x, "causal", None)
        hp = layer.norm(y)
        s = hp @ W.T
        t = mx.stop_gradient(th @ W.T)
        logp = t - mx.logsumexp(t, axis=-1, keepdims=True)
        logq = s - mx.logsumexp(s, axis=-1, keepdims=True)
        kl = (mx.exp(logp) * (logp - logq)).sum(-1)
        agree = (mx.argmax(s, axis=-1) == mx.argmax(t, axis=-1)).astype(mx.float32)
        denom = mx.maximum(mask.sum(), 1.0)
        return (kl * mask).sum() / denom, (agree * mask).sum() / denom

    def _make_step(self):
        layer = self.layer
        return train_step_fn(layer, self.opt, lambda *a: self._loss(layer, *a), self.args.clip, self.args.compile)

    def train_step(self):
        if self._compiled is None:
            self._compiled = self._make_step()
        inputs = self.inputs(self.step)
        loss, agree = self._compiled(*inputs, self.W)
        mx.eval(loss, agree, self.layer.parameters(), self.opt.state)
        self.step += 1
        return float(loss), float(agree), float(self.slots(inputs))

    @staticmethod
    def slots(inputs) -> mx.array:
        """The training slots a step's inputs hold: the ones of its mask (the last input)."""
        return inputs[-1].sum()

    # -- checkpoints --
    def save(self, folder: Path, extra: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "tmp"
        tmp.mkdir(exist_ok=True)
        mx.save_safetensors(str(tmp / "head.safetensors"), dict(tree_flatten(self.head.parameters())))
        opt_state = {k: v for k, v in tree_flatten(self.opt.state)}
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
        (tmp / "state.json").write_text(json.dumps({"step": self.step, "seed": self.args.seed, **extra}, indent=1))
        for name in ("head.safetensors", "optimizer.safetensors", "state.json"):
            (tmp / name).replace(folder / name)
        tmp.rmdir()

    def load(self, folder: Path) -> dict:
        state = json.loads((folder / "state.json").read_text())
        self.head.load_weights(list(mx.load(str(folder / "head.safetensors")).items()))
        opt = mx.load(str(folder / "optimizer.safetensors"))
        self.opt.state = tree_unflatten(list(opt.items()))
        self.opt.init(self.layer.trainable_parameters())  # marks it initialised, keeps the loaded values
        self.step = int(state["step"])
        self._compiled = None
        mx.eval(self.head.parameters(), self.opt.state)
        return state

    def refit(self, steps: int) -> None:
        """The same run, its learning-rate schedule now over `steps` (optimizer state and step kept)."""
        self.args.steps = steps
        opt = self.optimizer(steps)
        opt.state = self.opt.state
        opt.init(self.layer.trainable_parameters())
        self.opt, self._compiled = opt, None  # the compiled step holds the old schedule


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m mlx_engine train-mtp", formatter_class=HelpFormatter,
                       description="Train an MTP head for a target model that ships none, by self-distillation from the "
                                   "frozen target. Writes OUT/mtp.safetensors + OUT/mtp.json; use them with "
                                   "--drafter mtp --mtp-weights OUT/mtp.safetensors. docs/training.md: "
                                   "'Training a head'.")
    p.add_argument("--model", default=None,
                   help="target model: path, hub id or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output folder: the head, checkpoints, the corpus (required)")
    p.add_argument("--corpus", nargs="+", default=None,
                   help=".safetensors (from mlx_engine/train/make_corpus.py), .jsonl or .txt files (default: generate the "
                        "target's own answers to --prompts, saved as OUT/corpus_generated.safetensors)")
    p.add_argument("--prompts", default=None,
                   help="prompts .jsonl ({\"prompt\": ...} rows) answered when no --corpus is given "
                        "(default: mlx_engine/train/data/prompts_train.jsonl, 457 prompts)")
    p.add_argument("--gen-tokens", type=count(1), default=160, help="max new tokens per generated answer")
    p.add_argument("--gen-batch", type=count(1), default=32,
                   help="prompts answered per batch; the corpus is saved after each, so an interrupted run goes on")
    p.add_argument("--steps", type=count(0), default=1000, help="training steps (0: nothing is trained or generated)")
    p.add_argument("--seq-len", type=count(2), default=64, help="consecutive positions per training window")
    p.add_argument("--batch", type=count(1), default=16, help="windows per step")
    p.add_argument("--lr", type=finite(0.0), default=1e-3, help="peak learning rate (AdamW, warm-up then cosine decay)")
    p.add_argument("--warmup", type=count(0), default=50, help="warm-up steps (at most a tenth of --steps)")
    p.add_argument("--clip", type=finite(0.0), default=1.0, help="gradient norm clip (0 = off)")
    p.add_argument("--weight-decay", type=finite(0.0), default=0.0, help="AdamW weight decay")
    p.add_argument("--vocab-subset", type=count(0), default=0,
                   help="draft over the N most frequent tokens of the corpus, a cheaper draft step (0 = the full vocabulary)")
    p.add_argument("--init", choices=("last-layer", "random"), default="last-layer",
                   help="the head's block starts as a copy of the target's last layer, or random")
    p.add_argument("--init-from", default=None, metavar="HEAD",
                   help="start from this head (a file train-mtp wrote, e.g. the shipped one) and fine-tune it; its draft "
                        "vocabulary is kept unless --vocab-subset chooses one from the corpus (off: --init)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data order")
    p.add_argument("--log-every", type=count(1), default=10, help="steps between log lines")
    p.add_argument("--ckpt-every", type=count(1), default=100,
                   help="steps between checkpoints (OUT/checkpoint; also written at the end and on Ctrl-C)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint with identical state (off: start afresh)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="dtype of the written head")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run the train step uncompiled (off: one mx.compile'd step)")
    p.add_argument("--minutes", type=finite(0.0), default=0.0,
                   help="stop (checkpoint + write the head) after this wall time (0 = no limit)")
    p.add_argument("--fit-minutes", action="store_true",
                   help="with --minutes: time the first steps, then shorten --steps to what the budget holds, so the "
                        "learning rate decays fully before the head is written (never lengthens; not with --resume)")
    p.add_argument("--stop-after", type=count(0), default=0,
                   help="stop this run after N steps (checkpointed; --resume continues the same schedule; 0 = off)")
    return p


def main(argv=None) -> int:
    return run_trainer(_parser(), train, argv, "no model loaded, no corpus generated, nothing written")


def check_fit(args) -> None:
    """--fit-minutes fits the schedule to --minutes, once, in a fresh run."""
    if args.fit_minutes and not args.minutes:
        raise TrainInputError("--fit-minutes needs --minutes M (the budget the schedule is fitted to)")
    if args.fit_minutes and args.resume:
        raise TrainInputError("--fit-minutes with --resume: the checkpoint's schedule is kept as it was; "
                              "drop one of them")


def check_inputs(args) -> tuple[Path, list[str] | None]:
    """What can be checked before the model loads, in order: the flags that go together, the corpus files
    (or the prompts file), a checkpoint to resume, the output folder (created, a file written there).
    Returns (out, prompts)."""
    check_fit(args)
    prompts = None
    if args.corpus:
        check_corpus_files(args.corpus)
    else:
        prompts = read_prompts(args.prompts or DEFAULT_PROMPTS)
    if args.resume:
        check_checkpoint(Path(args.out) / CKPT)
    if args.init_from:
        read_head_file(args.init_from)
    return writable_dir(args.out), prompts


def read_head_file(path) -> dict:
    """The arrays of a head file train-mtp wrote (--init-from), or one error line naming it."""
    p = Path(path)
    if not p.is_file():
        raise TrainInputError(f"--init-from {p}: no such file")
    try:
        arrays = mx.load(str(p))
    except Exception as e:  # noqa: BLE001  (any unreadable file is the same user error)
        raise TrainInputError(f"--init-from {p}: not a safetensors head ({e})") from None
    if not any(k.startswith("layers.0.") for k in arrays):
        raise TrainInputError(f"--init-from {p}: no trained head's tensors (layers.0.*): not a file train-mtp wrote")
    return arrays


def train(args) -> int:
    from ..drafters.mtp import trained

    out, prompts = check_inputs(args)
    t_start = time.perf_counter()
    m, target = frozen_target(args.model)
    cfg = m.config
    stop = set(getattr(m.tokenizer, "eos_token_ids", None) or [])

    if args.corpus:
        seqs = load_corpora(args.corpus, target, m.tokenizer, out)
        corpus_desc = [str(c) for c in args.corpus]
    else:
        gen = out / GENERATED
        if gen.is_file():
            seqs = read_corpus(gen)
            check_hidden_size(seqs, getattr(getattr(target.text, "args", None), "hidden_size", None), str(gen))
        else:
            ids = [list(m.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
                   for q in prompts]
            log(f"generating the target's answers to {len(ids)} prompts from {args.prompts or DEFAULT_PROMPTS}")
            seqs = generate_corpus_resumable(target, ids, out, args.gen_tokens, args.gen_batch, stop, args.seed)
        corpus_desc = ["generated"]
    seqs = [s for s in seqs if len(s[0]) >= 3]
    if not seqs:
        raise TrainInputError(f"the corpus ({', '.join(corpus_desc)}) holds no sequence of 3 tokens or more")
    n_tokens = sum(len(t) for t, _ in seqs)
    vocab = target.vocab_size

    ckpt = out / CKPT
    start = read_head_file(args.init_from) if args.init_from else {}
    subset = draft_subset(args, ckpt, seqs, vocab, stop)
    if subset is None and SUBSET_KEY in start and not args.resume:
        subset = np.array(start[SUBSET_KEY], dtype=np.int32)
    if subset is not None:
        cover = np.isin(np.concatenate([t for t, _ in seqs]), subset).mean()
        log(f"draft vocabulary: {len(subset)} of {vocab} tokens, covering {cover:.1%} of the corpus tokens")

    mx.random.seed(args.seed)
    head = trained.build(m.model)
    init_head(head, target, args.init)
    if start:
        own = dict(tree_flatten(head.parameters()))
        weights = [(k, v.astype(own[k].dtype) if k in own else v) for k, v in start.items() if k != SUBSET_KEY]
        try:
            head.load_weights(weights, strict=True)
        except ValueError as e:
            raise TrainInputError(f"--init-from {args.init_from}: not a head for this model ({e})") from None
    mx.eval(head.parameters())
    trainer = Trainer(target, head, subset, seqs, args)
    n_params = sum(v.size for _, v in tree_flatten(head.parameters()))
    history, train_seconds = resume_and_train(trainer, args, ckpt, subset, t_start, lambda: log(
        f"corpus: {len(seqs)} sequences, {n_tokens} tokens, {trainer.n_slots} training slots in "
        f"{trainer.n_windows} windows of {args.seq_len}; head: {n_params / 1e6:.2f}M parameters; "
        f"steps {trainer.step}->{args.steps}, batch {args.batch}"))
    info = {"model": str(m.path), "corpus": corpus_desc, "corpus_sequences": len(seqs),
            "corpus_tokens": n_tokens, "steps": trainer.step, "batch": args.batch, "seq_len": args.seq_len,
            "lr": args.lr, "init_from": args.init_from, "train_minutes": round(train_seconds / 60, 2),
            "final_loss": history[-1][1] if history else None,
            "final_top1_agree": history[-1][2] if history else None}
    path = write_head(out, head, subset, cfg, info, getattr(mx, args.dtype))
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) and {out / 'mtp.json'}; "
        f"use: --drafter mtp --mtp-weights {path}")
    return 0


def draft_subset(args, ckpt: Path, seqs, vocab: int, stop) -> np.ndarray | None:
    """The draft vocabulary: the resumed checkpoint's, else --vocab-subset N chosen from the corpus, else None
    (the full vocabulary)."""
    if args.resume and (ckpt / "state.json").is_file():
        saved = json.loads((ckpt / "state.json").read_text())
        return None if saved.get("subset") is None else np.array(saved["subset"], dtype=np.int32)
    if args.vocab_subset and args.vocab_subset < vocab:
        return choose_subset(seqs, args.vocab_subset, vocab, always=stop)
    return None


if __name__ == "__main__":
    sys.exit(main())
