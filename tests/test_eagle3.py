"""The EAGLE-3 drafter on tiny checkpoints in the published HF layout: drafting logits against a numpy
reference from the tensors, greedy output == plain greedy for k = 1..8, the sampled distribution at
temperature 1 == the target's, accepted slots re-fed exactly."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from eagle3_writer import draft_ref, write_eagle3
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.eagle3 import Eagle3Drafter, Eagle3Error, aux_request, load_eagle3_drafter
from mlx_engine.target_model.model import Target
from reference import mlx_lm_greedy
from test_distribution import N_SAMPLES, chi_square_p_value, exact_joint

PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 128, 64, 31, 2, 99, 150, 7, 8]
LAYERS = 6


@pytest.fixture(scope="module")
def target():
    model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=LAYERS)
    return model, cfg


def _ckpt(tmp_path_factory, cfg, name, **kw):
    folder = tmp_path_factory.mktemp(name)
    return folder, write_eagle3(folder, cfg, **kw)


class OracleEagle3(Eagle3Drafter):
    """The real EAGLE-3 drafter (fc, midlayer, caches, trims, re-feeds) whose draft logits come from the
    full target over history + drafts: every greedy draft is accepted."""

    def _logits(self, i, y, drafted):
        ctx = mx.concatenate([mx.array(self.history, dtype=mx.int32), *drafted])
        return self.target.model(ctx[None])[0, -1:] + 0 * y.sum()


def _generate(model, drafter, k, n=48):
    out = []
    engine = Engine(model, drafter)
    for step in engine.generate(PROMPT, GenerationConfig(max_tokens=n, num_draft=k)):
        out += step.tokens
    return out, engine.stats


def test_feature_layers_follow_vllm_indexing():
    """Boundary j = the input of layer j = the output of layer j - 1; default (2, L//2, L-3). Checkpoint ids
    starting at 1 are layer outputs (SpecForge (1, L//2-1, L-4)): the same layers as the default."""
    from mlx_engine.drafters.eagle3 import aux_ids_of, boundaries, default_aux_ids

    assert default_aux_ids(32) == (2, 16, 29)
    assert aux_request((2, 16, 29), 32).layers == (1, 15, 28)
    assert boundaries((1, 15, 28)) == (2, 16, 29) and boundaries((2, 16, 29)) == (2, 16, 29)
    assert aux_ids_of({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32) == (2, 16, 29)
    assert aux_ids_of({"eagle_aux_hidden_state_layer_ids": [3, 16, 31]}, 32) == (3, 16, 31)
    assert aux_ids_of({}, 32) == (2, 16, 29)
    with pytest.raises(Eagle3Error):
        aux_request((0, 3, 5), 6)


@pytest.mark.parametrize("variant", ["reduced vocab, shared embedding", "full vocab, own embedding"])
def test_draft_logits_match_numpy_reference(tmp_path_factory, target, variant):
    model, cfg = target
    reduced = variant.startswith("reduced")
    folder, ckpt = _ckpt(tmp_path_factory, cfg, "e3ref", seed=1, draft_vocab=64 if reduced else None,
                         own_embed=not reduced, hidden=32 if not reduced else None)
    drafter = load_eagle3_drafter(folder, model)
    assert drafter.hidden_request.layers == (1, 2, 2) and not drafter.hidden_request.final
    tgt = Target(model)
    _, feats = tgt.forward(mx.array(PROMPT[:-1]), tgt.make_cache(), drafter.hidden_request)
    assert feats.shape == (len(PROMPT) - 1, 3 * cfg["hidden_size"])
    drafter.begin(PROMPT, feats)
    draft = drafter.propose(4, SamplingConfig(temperature=1.0), mx.random.key(0))
    drafts = [int(t) for t in np.array(draft.tokens)]
    embed = np.array(model.model.embed_tokens.weight)
    want = draft_ref(ckpt, embed, PROMPT, np.array(feats, dtype=np.float64), drafts)
    want_p = np.exp(want - want.max(-1, keepdims=True))
    want_p /= want_p.sum(-1, keepdims=True)
    got_p = np.array(draft.probs)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-4, atol=1e-5)
    if reduced:  # probability 0 off the draft vocabulary
        ids = np.arange(64) + ckpt["tensors"]["d2t"]
        off = np.ones(cfg["vocab_size"], bool)
        off[ids] = False
        assert np.all(got_p[:, off] == 0) and set(drafts) <= set(ids.tolist())


@pytest.mark.parametrize("oracle", [False, True], ids=["random head", "oracle logits"])
def test_greedy_equals_plain_for_every_k(tmp_path_factory, target, oracle):
    model, cfg = target
    folder, _ = _ckpt(tmp_path_factory, cfg, "e3greedy", seed=2, draft_vocab=128)
    ref = mlx_lm_greedy(model, PROMPT, 48)
    for k in range(1, 9):
        drafter = load_eagle3_drafter(folder, model)
        if oracle:
            drafter.__class__ = OracleEagle3
        out, stats = _generate(model, drafter, k)
        assert out == ref, f"k={k}"
        if oracle:
            assert stats.accepted == stats.drafted > 0


def test_accepted_slots_are_refed_with_target_features(tmp_path_factory, target):
    """After cycles that accept drafts, the head's cache equals a fresh one-batch prefill over the same
    tokens and the target's features: no draft-time (chained) entry is left behind."""
    model, cfg = target
    folder, _ = _ckpt(tmp_path_factory, cfg, "e3roll", seed=3, draft_vocab=128)
    drafter = load_eagle3_drafter(folder, model)
    drafter.__class__ = OracleEagle3
    engine = Engine(model, drafter)
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=3))
    for _ in range(4):
        next(gen)
    assert engine.stats.accepted >= 3
    assert_cache_equals_fresh_prefill(drafter, model, folder)


def assert_cache_equals_fresh_prefill(drafter, model, folder):
    """The head's cache equals that of a fresh head prefilled in one batch over the drafter's history and
    the target's features of it (no draft-time entry left behind)."""
    drafter.flush()
    history = drafter.history
    n = len(history) - 1
    tgt = Target(model)
    _, feats = tgt.forward(mx.array(history[:-1]), tgt.make_cache(), drafter.hidden_request)
    fresh = load_eagle3_drafter(folder, model)
    fresh.begin(history, feats)
    fresh.flush()
    got, want = drafter.cache[0], fresh.cache[0]
    assert got.offset == want.offset == n
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        np.testing.assert_allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), rtol=1e-4, atol=1e-4)


def test_first_two_tokens_follow_target_distribution(tmp_path_factory):
    """Temperature 1, a draft vocabulary of 4 of the 6 tokens: the joint of the first two tokens (the
    second from a k = 2 EAGLE-3 cycle) matches the target's exactly (chi-square)."""
    vocab = 6
    model, cfg = tiny_models.build("llama", seed=1, vocab=vocab, num_hidden_layers=4)
    folder, _ = _ckpt(tmp_path_factory, cfg, "e3dist", seed=4, draft_vocab=4)
    prompt = [1, 4, 2, 5, 3]
    sampling = SamplingConfig(temperature=1.0)
    engine = Engine(model, load_eagle3_drafter(folder, model))
    counts = np.zeros((vocab, vocab))
    accepted = 0
    for seed in range(N_SAMPLES):
        gen = GenerationConfig(max_tokens=4, num_draft=2, sampling=sampling, seed=seed)
        tokens = [t for step in itertools.islice(engine.generate(prompt, gen), 2) for t in step.tokens]
        counts[tokens[0], tokens[1]] += 1
        accepted += engine.stats.accepted_at[0] if engine.stats.accepted_at else 0
    expected = exact_joint(model, sampling) * N_SAMPLES
    assert 0 < accepted < N_SAMPLES
    assert np.all(counts[expected == 0] == 0)
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3


def test_bad_checkpoints_are_refused(tmp_path_factory, target):
    model, cfg = target
    with pytest.raises(Eagle3Error, match="not a folder"):
        load_eagle3_drafter(tmp_path_factory.getbasetemp() / "nowhere", model)
    other = dict(cfg, hidden_size=32)
    folder, _ = _ckpt(tmp_path_factory, other, "e3wrong", seed=5)
    with pytest.raises(Eagle3Error, match="hidden size"):
        load_eagle3_drafter(folder, model)
    folder, _ = _ckpt(tmp_path_factory, cfg, "e3aux", seed=5, aux_ids=(2, 3, 9))
    with pytest.raises(Eagle3Error, match="outside"):
        load_eagle3_drafter(folder, model)


def test_cli_eagle3_equals_plain_and_errors_are_clear(tmp_path_factory, capsys):
    import json

    from mlx_engine.__main__ import main
    from model_dirs import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("m") / "llama6", seed=0, num_hidden_layers=LAYERS)
    cfg = json.loads((folder / "config.json").read_text())
    head, _ = _ckpt(tmp_path_factory, cfg, "e3cli", seed=6, draft_vocab=100)
    args = ["generate", "--model", str(folder), "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "30",
            "--ignore-eos", "--temp", "0", "--json"]

    def run(*extra):
        assert main([*args, *extra]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    plain = run("--drafter", "none")
    spec = run("--drafter", "eagle3", "--eagle3", str(head), "--num-draft", "3")
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0
    for extra in (["--drafter", "eagle3"], ["--drafter", "eagle3", "--eagle3", str(folder / "nope")],
                  ["--drafter", "ngram", "--eagle3", str(head)]):
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "eagle3" in err and "Traceback" not in err
