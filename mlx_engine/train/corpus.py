"""The self-distillation corpus every trainer here shares: the frozen target's own answers to prompts, or
text/jsonl/safetensors files, each sequence kept with the target's final-normed hidden states (float16).

- `generate_corpus(_resumable)`: the target's answers, in batches, saved as they come (an interrupted run
  goes on where it stopped);
- `encode_sequences`: the target run once (no grad) over token sequences, keeping the hidden states;
- `save_corpus` / `read_corpus`: the .safetensors corpus format (tokens + hidden states);
- `load_corpora`: any mix of .safetensors, .jsonl and .txt files, text encoded once and cached.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from .. import _platform  # noqa: F401  OpenBLAS before mlx

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from .inputs import ROW_FORMS, TrainInputError, check_hidden_size, check_token_ids  # noqa: E402

CACHE = "corpus_cache.safetensors"
GENERATED = "corpus_generated.safetensors"
GENERATED_PART = "corpus_generated.part.safetensors"  # answers generated so far (an interrupted run goes on)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the frozen target: hidden states --------------------------------------------------------------------
def _hidden(target, x: mx.array, cache) -> mx.array:
    """Final-normed hidden states [B, L, H] of the target's inner model (what lm_head scores)."""
    return target.inner(x, cache=cache)


def encode_sequences(target, seqs: list[list[int]], starts: list[int] | None = None, batch: int = 8,
                     chunk: int = 512, progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run the frozen target over token sequences; per sequence (tokens[s:], hidden[s:] float16).

    Right-padded batches, fed in chunks through a KV cache: with a causal mask the padding never reaches
    real positions. `starts[i]`: first position kept (e.g. the last prompt token)."""
    from mlx_lm.models.cache import make_prompt_cache

    starts = starts or [0] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list = [None] * len(seqs)
    done = 0
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        n = max(len(seqs[i]) for i in idx)
        x = mx.array([seqs[i] + [0] * (n - len(seqs[i])) for i in idx], dtype=mx.int32)
        cache = make_prompt_cache(target.model)
        hs = []
        for s in range(0, n, chunk):
            h = _hidden(target, x[:, s : s + chunk], cache).astype(mx.float16)
            mx.eval(h)
            hs.append(h)
        h = np.array(mx.concatenate(hs, axis=1))
        for j, i in enumerate(idx):
            m = len(seqs[i])
            out[i] = (np.array(seqs[i][starts[i] :], dtype=np.int32), h[j, starts[i] : m])
        done += sum(len(seqs[i]) for i in idx)
        if progress:
            progress(f"encoded {b + len(idx)}/{len(seqs)} sequences, {done} tokens, "
                     f"{done / (time.perf_counter() - t0):.0f} tok/s")
    return out


def generate_corpus(target, prompts: list[list[int]], max_tokens: int = 192, temperature: float = 0.0,
                    batch: int = 32, stop: set[int] | frozenset = frozenset(), seed: int = 0,
                    progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The target's own answers, batched (left padding, BatchKVCache), keeping the hidden states.

    Per prompt: (tokens, hidden float16) for the fed positions from the LAST PROMPT TOKEN on, up to (not
    including) the first stop token; hidden[i] is the state after feeding tokens[i], tokens[i+1] the token
    chosen from it. No second pass over the corpus is needed."""
    from mlx_lm.models.cache import BatchKVCache

    key = mx.random.key(seed)
    out = []
    n_layers = len(target.inner.layers)
    t0 = time.perf_counter()
    n_tok = 0
    for b in range(0, len(prompts), batch):
        chunk = prompts[b : b + batch]
        n = max(len(p) for p in chunk)
        pad = [n - len(p) for p in chunk]
        x = mx.array([[0] * q + p for q, p in zip(pad, chunk)], dtype=mx.int32)
        cache = [BatchKVCache(pad) for _ in range(n_layers)]
        if n > 1:
            mx.eval(_hidden(target, x[:, :-1], cache))
        cur = x[:, -1:]
        toks, hs = [cur], []
        for t in range(max_tokens):
            h = _hidden(target, cur, cache)[:, -1]
            logits = target.lm_head(h).astype(mx.float32)
            if temperature > 0:
                key, sub = mx.random.split(key)
                nxt = mx.random.categorical(logits * (1.0 / temperature), key=sub)
            else:
                nxt = mx.argmax(logits, axis=-1)
            cur = nxt.astype(mx.int32)[:, None]
            hs.append(h.astype(mx.float16))
            toks.append(cur)
            mx.async_eval(cur, hs[-1])
            if stop and t % 16 == 15:
                got = np.array(mx.concatenate(toks[1:], axis=1))
                if all(any(int(v) in stop for v in row) for row in got):
                    break
        tok = np.array(mx.concatenate(toks, axis=1))  # [B, 1 + T]
        hid = np.array(mx.stack(hs, axis=1))  # [B, T, H]
        for j in range(len(chunk)):
            row = tok[j]
            end = hid.shape[1]  # fed positions 0..end-1 (the last chosen token is never fed)
            for i in range(1, row.shape[0]):
                if int(row[i]) in stop:
                    end = i  # keep positions before the stop token is fed
                    break
            out.append((row[:end].astype(np.int32), hid[j, :end]))
            n_tok += end
        if progress:
            el = time.perf_counter() - t0
            progress(f"generated {b + len(chunk)}/{len(prompts)} answers, {n_tok} tokens, {n_tok / el:.1f} tok/s, "
                     f"{el / 60:.1f} min")
    return out


# -- corpus files -------------------------------------------------------------------------------------------
def save_corpus(path, seqs: list[tuple[np.ndarray, np.ndarray]], meta: dict | None = None) -> None:
    offsets = np.cumsum([0] + [len(t) for t, _ in seqs]).astype(np.int32)
    tokens = np.concatenate([t for t, _ in seqs]).astype(np.int32)
    hidden = np.concatenate([h for _, h in seqs]).astype(np.float16)
    mx.save_safetensors(str(path), {"tokens": mx.array(tokens), "hidden": mx.array(hidden),
                                    "offsets": mx.array(offsets)},
                        metadata={k: str(v) for k, v in (meta or {}).items()})


def generate_corpus_resumable(target, prompts: list[list[int]], out: Path, max_tokens: int, batch: int,
                              stop=frozenset(), seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """generate_corpus, saved after every batch of prompts (out/corpus_generated.part.safetensors), so an
    interrupted run continues where it stopped; the whole corpus ends in out/corpus_generated.safetensors.
    Greedy answers: a batch's answers do not depend on the batches before it."""
    final, part = out / GENERATED, out / GENERATED_PART
    sig = hashlib.sha1(json.dumps([prompts, max_tokens, sorted(stop), seed]).encode()).hexdigest()
    seqs: list = []
    if part.is_file():
        _, meta = mx.load(str(part), return_metadata=True)
        if meta.get("signature") == sig:
            seqs = read_corpus(part)
            log(f"continuing the corpus in {part}: {len(seqs)} of {len(prompts)} answers already there")
    for b in range(len(seqs), len(prompts), batch):
        seqs += generate_corpus(target, prompts[b : b + batch], max_tokens, 0.0, batch, stop, seed)
        tmp = part.with_name("tmp." + part.name)  # (mx.save_safetensors wants the .safetensors suffix)
        save_corpus(tmp, seqs, {"signature": sig})
        tmp.replace(part)
        log(f"generated {len(seqs)}/{len(prompts)} answers ({sum(len(t) for t, _ in seqs)} tokens), saved in {part}")
    part.replace(final) if part.is_file() else save_corpus(final, seqs)
    return seqs


def read_corpus(path) -> list[tuple[np.ndarray, np.ndarray]]:
    w = mx.load(str(path))
    tokens, hidden, offsets = np.array(w["tokens"]), np.array(w["hidden"]), np.array(w["offsets"])
    return [(tokens[a:b], hidden[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def _text_rows(path: Path, tokenizer, vocab: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Token sequences of a .txt or .jsonl corpus file and the first position of each to train on; with
    `vocab`, token ids given in the file must lie in the model's vocabulary (TrainInputError otherwise)."""
    seqs, starts = [], []
    if path.suffix == ".txt":
        ids = tokenizer.encode(path.read_text())
        for s in range(0, len(ids), 1024):
            seqs.append(ids[s : s + 1024])
            starts.append(0)
        return seqs, starts
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        if "tokens" in r:
            seqs.append([int(t) for t in r["tokens"]]), starts.append(0)
        elif "prompt_ids" in r and "response_ids" in r:
            p = [int(t) for t in r["prompt_ids"]]
            seqs.append(p + [int(t) for t in r["response_ids"]]), starts.append(len(p) - 1)
        elif "prompt" in r and "response" in r:
            p = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
            seqs.append(list(p) + tokenizer.encode(r["response"], add_special_tokens=False))
            starts.append(len(p) - 1)
            continue
        elif "text" in r:
            seqs.append(tokenizer.encode(r["text"])), starts.append(0)
            continue
        else:
            raise TrainInputError(f"{path} line {n}: a row needs {ROW_FORMS}")
        if vocab is not None:  # ids written in the file (text goes through the model's own tokenizer)
            check_token_ids(seqs[-1], vocab, f"--corpus {path} line {n}")
    return seqs, starts


def load_corpora(files: list[str], target, tokenizer, out: Path, batch: int = 8) -> list:
    """All corpus files as (tokens, hidden) sequences; text files are encoded once and cached in `out`.
    The files were checked by inputs.check_corpus_files; what needs the model is checked here (stored
    hidden states of the model's size, token ids in its vocabulary: TrainInputError)."""
    seqs = []
    text_files = []
    for f in files:
        p = Path(f)
        if p.suffix == ".safetensors":
            stored = read_corpus(p)
            check_hidden_size(stored, getattr(getattr(target.text, "args", None), "hidden_size", None), f"--corpus {p}")
            check_token_ids(np.concatenate([t for t, _ in stored] or [np.zeros(0, np.int32)]), target.vocab_size,
                            f"--corpus {p}")
            seqs += stored
        else:
            text_files.append(p)
    if text_files:
        sig = hashlib.sha1(json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime]
                                       for p in text_files]).encode()).hexdigest()
        cache = out / CACHE
        hit = False
        if cache.is_file():
            _, meta = mx.load(str(cache), return_metadata=True)
            hit = meta.get("signature") == sig
        if hit:
            seqs += read_corpus(cache)
        else:
            rows, starts = [], []
            for p in text_files:
                r, s = _text_rows(p, tokenizer, target.vocab_size)
                rows += r
                starts += s
            log(f"encoding {len(rows)} text sequences with the frozen target")
            enc = encode_sequences(target, rows, starts, batch=batch, progress=log)
            save_corpus(cache, enc, {"signature": sig})
            seqs += enc
    return [s for s in seqs if len(s[0]) >= 3]


def frozen_target(model: str | None):
    """(loaded model, Target) of `model` (default: the embedded one), frozen: what every trainer distils from."""
    from ..models import load
    from ..target_model.model import Target

    if model is None:
        from ..models.default import default_model_path

        model = str(default_model_path())
    m = load(model)
    m.model.freeze()
    return m, Target(m.model)
