"""Drafter chains (ngram+mtp, ngram+eagle3): greedy output == plain for every k with both branches used,
the model drafter's state exact after n-gram cycles, the T = 1 distribution == the target's; under auto
each member its own policy (the n-gram long, the model drafter short, or off without turning the n-gram
off)."""

import itertools
import json

import numpy as np
import pytest

import tiny_models
from eagle3_writer import write_eagle3
from hf_writer import write_checkpoint
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.__main__ import main
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.ngram import NgramDrafter
from reference import mlx_lm_greedy
from test_ngram import Recording
from test_distribution import N_SAMPLES, VOCAB, chi_square_p_value, exact_joint
from test_eagle3 import assert_cache_equals_fresh_prefill
from test_mtp_helpers import load_hf

# repeats itself, so prompt lookup finds matches; the tiny models also fall into loops the n-gram catches
PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]


@pytest.fixture(scope="module")
def llama6(tmp_path_factory):
    model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=6)
    folder = tmp_path_factory.mktemp("chain_e3")
    write_eagle3(folder, cfg, seed=2, draft_vocab=128)
    return model, folder


def _run(model, drafter, k, n=64, prompt=PROMPT):
    engine = Engine(model, drafter)
    out = [t for step in engine.generate(prompt, GenerationConfig(max_tokens=n, num_draft=k)) for t in step.tokens]
    return out, engine


def test_ngram_eagle3_greedy_equals_plain_for_every_k(llama6):
    model, folder = llama6
    ref = mlx_lm_greedy(model, PROMPT, 64)
    for k in range(1, 9):
        chain = ChainDrafter(load_eagle3_drafter(folder, model))
        out, engine = _run(model, chain, k)
        assert out == ref, f"k={k}"
        assert chain.cycles["ngram"] > 0 and chain.cycles["eagle3"] > 0, chain.cycles
        assert engine.stats.accepted > 0


def test_ngram_mtp_greedy_equals_plain(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_5", "qwen3_5", seed=3)
    model, config = load_hf(folder)
    ref = mlx_lm_greedy(model, PROMPT, 64)
    for k in (1, 2, 4, 8):
        # unigram matches too: this random model's output rarely repeats a 2-gram
        chain = ChainDrafter(load_mtp_drafter(model, folder, config), NgramDrafter(max_ngram=3, min_ngram=1))
        out, _ = _run(model, chain, k)
        assert out == ref, f"k={k}"
        assert chain.cycles["ngram"] > 0 and chain.cycles["mtp"] > 0, chain.cycles


def test_under_auto_each_member_drafts_by_its_own_policy(llama6):
    """Each class of n-gram match gets its own policy (its longest draft 16, first burst at 16) while the
    engine's policy serves the model drafter (8); each sees only its member's cycles; output == plain."""
    model, folder = llama6
    chain = ChainDrafter(load_eagle3_drafter(folder, model), NgramDrafter(min_ngram=1))
    engine = Engine(model, chain)
    assert engine.policy.max_k == 8
    engine.policy = Recording(max_k=8)  # the modelled costs (no timings), and a record of k
    drafted_by = {"ngram": [], "ngram:long": [], "eagle3": []}
    for _ in range(2):  # what each policy learnt carries over to the next generation
        gen = engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft="auto"))
        out = []
        for step in gen:
            out += step.tokens
            if step.draft:
                drafted_by[chain.last].append(len(step.draft))
        assert out == mlx_lm_greedy(model, PROMPT, 64)
    assert all(drafted_by.values()), drafted_by  # the tiny model loops: short and long matches both occur
    for name in ("ngram", "ngram:long"):
        own = engine.member_policies[name]
        assert type(own) is Recording and own is not engine.policy
        assert (own.max_k, own.bootstrap_k) == (16, 16) and own.asked[0] == 16
        assert [k for k, _ in own.told if k] == drafted_by[name]  # each policy told of its own cycles only
    assert engine.member_policies["ngram"] is not engine.member_policies["ngram:long"]
    assert max(drafted_by["eagle3"]) <= 8 and max(drafted_by["ngram"] + drafted_by["ngram:long"]) > 8, drafted_by
    assert [k for k, _ in engine.policy.told if k] == drafted_by["eagle3"]


class PlainAlways(Recording):
    """A policy that never drafts (plain stretches without end): the model drafter turned off."""

    def next_k(self):
        self.asked.append(0)
        return 0

    def plain_run(self):
        return 1 << 20

    def for_member(self, **settings):
        return Recording(**settings)


def test_a_model_drafter_turned_off_leaves_prompt_lookup_on(llama6):
    """The model drafter's policy decodes plainly for good; its plain stretch ends as soon as the context
    has a match, and the n-gram drafts (suspect of issue 15: one policy shut prompt lookup off with it)."""
    model, folder = llama6
    chain = ChainDrafter(load_eagle3_drafter(folder, model), NgramDrafter(min_ngram=1))
    engine = Engine(model, chain)
    engine.policy = PlainAlways(max_k=8)
    out = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft="auto")) for t in s.tokens]
    assert out == mlx_lm_greedy(model, PROMPT, 64)
    assert chain.cycles["eagle3"] == 0 and chain.cycles["ngram"] > 0 and engine.stats.accepted > 0


def test_model_drafter_sees_every_committed_token(llama6):
    """After a mix of n-gram and EAGLE-3 cycles, the EAGLE-3 cache equals a fresh one-batch prefill over the
    committed tokens and the target's features."""
    model, folder = llama6
    chain = ChainDrafter(load_eagle3_drafter(folder, model))
    engine = Engine(model, chain)
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=3))
    for _ in range(12):
        next(gen)
    assert chain.cycles["ngram"] > 0 and chain.cycles["eagle3"] > 0, chain.cycles
    inner = chain.model
    inner.flush()
    assert inner.history == chain.ngram.tokens
    assert_cache_equals_fresh_prefill(inner, model, folder)


@pytest.mark.slow  # 1500 generations: ~20-35 s on the shared CPU
def test_chain_follows_target_distribution_at_temperature_1(tmp_path_factory):
    """Vocabulary of 6; the prompt's 2-gram (3, 1) recurs, so the second token comes from an n-gram draft
    when the first is 1 and from an EAGLE-3 draft otherwise: both branches, one exact joint."""
    model, cfg = tiny_models.build("llama", seed=1, vocab=VOCAB, num_hidden_layers=4)
    folder = tmp_path_factory.mktemp("chain_dist")
    write_eagle3(folder, cfg, seed=4, draft_vocab=4)
    prompt = [1, 4, 2, 5, 3, 1, 4, 2, 5, 3]
    sampling = SamplingConfig(temperature=1.0)
    chain = ChainDrafter(load_eagle3_drafter(folder, model), NgramDrafter(max_ngram=2, min_ngram=2))
    engine = Engine(model, chain)
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(N_SAMPLES):
        gen = GenerationConfig(max_tokens=4, num_draft=2, sampling=sampling, seed=seed)
        tokens = [t for step in itertools.islice(engine.generate(prompt, gen), 2) for t in step.tokens]
        counts[tokens[0], tokens[1]] += 1
    assert chain.cycles["ngram"] > 50 and chain.cycles["eagle3"] > 50, chain.cycles
    expected = exact_joint(model, sampling, prompt) * N_SAMPLES
    assert np.all(counts[expected == 0] == 0)
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3


def test_cli_chains(tmp_path_factory, capsys):
    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_5", "qwen3_5", seed=3)
    args = ["generate", "--model", str(folder), "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "40",
            "--ignore-eos", "--temp", "0", "--json"]

    def run(*extra):
        assert main([*args, *extra]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    plain = run("--drafter", "none")
    spec = run("--drafter", "ngram+mtp", "--num-draft", "3")
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0
    assert main([*args, "--drafter", "ngram+eagle3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--eagle3" in err


def test_a_plain_token_timed_by_one_member_is_known_to_every_policy():
    """Prompt lookup's first burst is followed by a plain stretch only to time a plain token when no policy
    of the generation has timed one yet (members.observe_plain shares the measure)."""
    from mlx_engine.core import members
    from mlx_engine.core.policy import AdaptivePolicy

    def after_first_burst(policy):
        for _ in range(policy.bootstrap_cycles):
            assert policy.next_k() == 16
            policy.observe(16, 16, 0.25)
        return policy.next_k()

    default, shared, alone = AdaptivePolicy(), AdaptivePolicy(max_k=16, bootstrap_k=16), AdaptivePolicy(max_k=16, bootstrap_k=16)
    members.observe_plain(default, default, {"ngram": shared}, seconds=0.8, tokens=8)
    assert default.cost[0] == shared.cost[0] == 0.1 and 0 not in alone.cost
    assert after_first_burst(shared) > 0  # drafts on (17 tokens for 0.25 s beat a plain 0.1 s token)
    assert after_first_burst(alone) == 0 and alone.plain_run() == alone.bootstrap_tokens  # times plain first
