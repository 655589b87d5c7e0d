"""The adaptive draft-length policy: the cost model's choice, and what it does inside the engine."""

import mlx.core as mx

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig
from mlx_engine.drafters.base import Draft
from mlx_engine.policy import AdaptivePolicy
from test_greedy_equality import PROMPT, plain, target


def trained(costs: dict, acceptance: list[float]) -> AdaptivePolicy:
    p = AdaptivePolicy(max_k=6)
    p.cost.update(costs)
    p.acceptance = list(acceptance)
    return p


def test_picks_the_length_that_maximises_tokens_per_second():
    # costs in units of one plain step: verify t(k+1)/t(1) = 1.2 .. plus 0.1 per draft step
    costs = {0: 1.0, 1: 1.3, 2: 1.45, 3: 1.6}
    p = trained(costs, [0.8, 0.7, 0.2])
    speeds = {k: p.expected_tokens(k) / p.estimated_cost(k) for k in range(7)}
    assert p.choose() == max(speeds, key=speeds.get) == 2
    assert abs(p.expected_tokens(2) - (1 + 0.8 + 0.8 * 0.7)) < 1e-12


def test_picks_plain_decoding_when_drafts_are_rejected():
    p = trained({0: 1.0, 1: 1.3, 2: 1.45}, [0.05, 0.05])
    assert p.choose() == 0
    assert p.plain_run() < p.plain_run()  # the plain stretch grows while drafting keeps losing


def test_observations_update_costs_and_conditional_acceptance():
    p = AdaptivePolicy(max_k=4, smoothing=1.0)
    p.observe(0, 0, 0.5, tokens=10)
    p.observe(3, 1, 0.2)  # position 0 accepted, position 1 rejected, position 2 never reached
    assert p.cost == {0: 0.05, 3: 0.2}
    assert p.acceptance[:2] == [1.0, 0.0] and len(p.acceptance) == 2


class ModelledCosts(AdaptivePolicy):
    """The adaptive policy fed a fixed cost model instead of wall time (timings are not test material):
    a plain token costs 1, a cycle drafting k costs 1.2 + 0.1 k."""

    def observe(self, k, n_accepted, seconds, tokens=1):
        super().observe(k, n_accepted, tokens * 1.0 if k == 0 else 1.2 + 0.1 * k, tokens)


class OracleDrafter:
    """Drafts the true greedy continuation at no cost: auto must draft long."""

    name, needs_hidden = "oracle", False

    def __init__(self, continuation):
        self.continuation, self.pos = continuation, 0

    def begin(self, tokens, hidden):
        self.pos = 1

    def propose(self, k, sampling, key):
        found = self.continuation[self.pos : self.pos + k]
        return Draft(mx.array(found, dtype=mx.int32), None, found)

    def commit(self, verdict, hidden):
        self.pos += len(verdict.tokens)

    def max_draft(self):
        return None


def test_auto_drafts_long_with_a_perfect_drafter():
    ref = plain("llama")
    engine = Engine(target("llama"), OracleDrafter(ref))
    engine.policy = ModelledCosts(max_k=8)
    tokens = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft="auto")) for t in s.tokens]
    assert tokens == ref
    assert engine.stats.acceptance_rate == 1.0
    assert engine.stats.mean_accepted_length > 3


def test_auto_stops_drafting_a_useless_drafter_and_stays_lossless():
    engine = Engine(target("qwen3_next"), DraftModelDrafter(tiny_models.build("llama", seed=99)[0], tiny_models.VOCAB))
    engine.policy = ModelledCosts(max_k=8)
    for _ in range(2):  # the policy persists across generations
        tokens = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft="auto")) for t in s.tokens]
        assert tokens == plain("qwen3_next")
    assert engine.stats.drafted <= 8  # a few probes; the rest decoded plainly
