"""Sampled requests through the server follow the target's distribution (not only: the same seed, the same
text). A tiny model folder served with a draft model of another seed (q != p), every request a first
token from the prefill and a k = 1 verify cycle (an accepted draft + the bonus, or the corrected token);
requests sent concurrently, so they are decoded as one batch. The texts of many seeds are compared with
the exact distribution over texts, built from the target's logits by tests/sampling_reference.py.
"""

import functools
import itertools
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine import text as text_ops
from model_dirs import save_tiny, save_tokenizer
from sampling_reference import chi2_sf, conditional_chi_square, distribution
from serve_util import RunningServer

PROMPT = [40, 41, 42, 43, 44]  # token ids
TOKENS, TOP_K, TEMPERATURE, PENALTY = 3, 3, 1.0, 1.3
N_REQUESTS = 400


def save_noisy_copy(path, seed: int, vocab: int = 320, noise: float = 0.02):
    """The tiny model of `seed` with weight noise, as a model folder: a draft that agrees often, not always."""
    from mlx.utils import tree_map
    from mlx_lm.utils import save_config, save_model

    model, config = tiny_models.build("llama", seed=seed, vocab=vocab)
    mx.random.seed(seed + 1)
    model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape), model.parameters()))
    mx.eval(model.parameters())
    path.mkdir(parents=True)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    save_tokenizer(path, vocab)
    return path


@pytest.fixture(scope="module", params=["continuous", "fair"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_sampled")
    target, draft = save_tiny(root / "target", seed=3), save_noisy_copy(root / "draft", seed=3)
    s = RunningServer("--model", str(target), "--drafter", "draft", "--draft-model", str(draft),
                      "--num-draft", "2", "--batching", request.param, "--max-concurrency", "8")
    yield s
    s.close()


def text_distribution(server) -> dict[str, float]:
    """P(text) of the request: every token sequence the target can sample, its probability from the
    definitions (temperature, top-k, penalty over the prompt + tokens so far), a stop token ending it."""
    worker = server.service.worker
    model, tok, stops = worker.engine.target.model, server.service.tokenizer, worker.eos

    @functools.cache
    def dist(seq: tuple) -> np.ndarray:
        logits = np.array(model(mx.array([list(PROMPT) + list(seq)]))[0, -1].astype(mx.float32))
        return distribution(logits, list(PROMPT) + list(seq), TEMPERATURE, TOP_K, repetition_penalty=PENALTY)

    out: dict[str, float] = {}

    def walk(seq: tuple, prob: float):
        if len(seq) == TOKENS or (seq and seq[-1] in stops):
            text = text_ops.decode(tok, [t for t in seq if t not in stops])
            out[text] = out.get(text, 0.0) + prob
            return
        p = dist(seq)
        for t in np.flatnonzero(p):
            walk(seq + (int(t),), prob * float(p[t]))

    walk((), 1.0)
    return out


def test_sampled_texts_follow_the_target_distribution(server):
    client = server.client()

    def ask(seed):
        r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=TOKENS, temperature=TEMPERATURE,
                                      seed=seed, extra_body={"top_k": TOP_K, "repetition_penalty": PENALTY})
        return r.choices[0].text, r.model_extra.get("speculation", {})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(N_REQUESTS)))
    texts = [t for t, _ in answers]
    assert texts[:20] == [ask(seed)[0] for seed in range(20)]  # a seed still gives its text when served alone
    drafted = sum(s.get("drafted", 0) for _, s in answers)
    accepted = sum(s.get("accepted", 0) for _, s in answers)
    assert 0 < accepted < drafted, (accepted, drafted)
    want = text_distribution(server)
    assert abs(sum(want.values()) - 1.0) < 1e-6
    unexpected = sorted(set(texts) - set(want))
    assert not unexpected, f"texts the target gives probability 0: {unexpected[:5]}"
    cells = sorted(want)
    index = {t: i for i, t in enumerate(cells)}
    probs = np.tile([want[t] for t in cells], (len(texts), 1))
    stat, df = conditional_chi_square(probs, np.array([index[t] for t in texts]))
    assert df >= 5 and chi2_sf(stat, df) > 1e-4, (stat, df, collections_of(texts, want))


def collections_of(texts, want) -> list:
    """(text, observed, expected) of the most frequent texts, for the failure message."""
    n = len(texts)
    counts = {t: texts.count(t) for t in set(texts)}
    top = itertools.islice(sorted(want.items(), key=lambda x: -x[1]), 12)
    return [(t, counts.get(t, 0), round(p * n, 1)) for t, p in top]
