"""The adaptive draft-length policy: the cost model's choice, and what it does inside the engine."""

import mlx.core as mx

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig
from mlx_engine.drafters.base import Draft
from mlx_engine.core.policy import AdaptivePolicy
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
    stretches = []
    for _ in range(200):  # the engine's loop, drafts always rejected
        k = p.next_k()
        if k == 0:
            stretches.append(p.plain_run())
            p.observe(0, 0, float(stretches[-1]), tokens=stretches[-1])
        else:
            p.observe(k, 0, 1.2 + 0.1 * k)
    assert stretches[:6] == [16, 32, 64, 128, 256, 512]  # doubles while each probing burst loses
    assert stretches[-1] == p.max_stretch


def test_a_flat_pair_of_costs_does_not_make_long_drafts_look_free():
    # a k = 1 cycle timed as cheap as a plain token (noise, or the drafter's upkeep inside plain tokens):
    # extrapolating that flat would price k = 8 like k = 1 and pick it at any acceptance
    p = trained({0: 1.0, 1: 1.0}, [0.3])
    assert p.estimated_cost(8) >= 1.0 + 7 * p.min_step_cost
    assert p.choose() == 1


def test_a_deeper_position_looks_no_better_than_the_one_before():
    p = AdaptivePolicy(max_k=4)
    for _ in range(40):
        p.observe(1, 0, 1.0)  # position 1: mostly rejected
    p.observe(2, 2, 1.2)  # position 2 reached once, and accepted
    assert p.acceptance[1] <= p.acceptance[0] + 1 / (1 + p.prior_weight)  # one accept against a low prior


def test_observations_update_costs_and_conditional_acceptance():
    p = AdaptivePolicy(max_k=4, smoothing=1.0, prior_weight=0.0)
    p.observe(0, 0, 0.5, tokens=10)
    p.observe(3, 1, 0.2)  # the first drafting cycle after a plain stretch is untimed, unless k is unmeasured
    p.observe(3, 1, 0.3)  # position 0 accepted, position 1 rejected, position 2 never reached
    assert p.cost == {0: 0.05, 3: 0.3}
    assert p.acceptance == [1.0, 0.0]


def test_acceptance_is_beta_smoothed_decayed_counts():
    p = AdaptivePolicy(max_k=2, prior_acceptance=0.5, prior_weight=2.0, window=4.0)
    p.observe(1, 1, 1.0)
    assert abs(p.acceptance[0] - (1 + 1) / (1 + 2)) < 1e-12  # one accept against a prior of 1 in 2
    for _ in range(50):
        p.observe(1, 0, 1.0)
    assert p.acceptance[0] < 0.3  # old accepts fade: the decayed count keeps ~window observations
    assert p.tries[0] < 4.0 + 1e-9


def test_catch_up_cycle_after_a_plain_stretch_is_not_timed():
    p = AdaptivePolicy(max_k=2, smoothing=1.0)
    p.observe(1, 0, 1.0)
    p.observe(0, 0, 64.0, tokens=64)
    p.observe(1, 0, 9.0)  # drafter catching up over 64 tokens: not k = 1's cost
    assert p.cost[1] == 1.0
    p.observe(1, 0, 2.0)
    assert p.cost[1] == 2.0


def simulate(p: AdaptivePolicy, acceptance: list[float], tokens: int, seed: int = 0,
             gen_len: int | None = None, base: float = 1.2, regime=None, trace: list | None = None) -> tuple[float, int]:
    """Drive the policy the way the engine does with modelled costs (plain token 1, a cycle drafting k
    base + 0.1 k) and a seeded drafter accepting position i with probability acceptance[i], over
    generations of `gen_len` tokens (default: one long one), each begun in `regime`; `trace` gets the k
    of every cycle (0: a plain stretch). -> (modelled time for `tokens` tokens, tokens produced by drafting
    cycles)."""
    import random

    rng, time_, made, drafted_tokens = random.Random(seed), 0.0, 0, 0
    gen_len = gen_len or tokens
    while made < tokens:
        p.begin(regime)
        in_gen = 0
        while in_gen < gen_len:
            remaining = gen_len - in_gen
            wanted = p.next_k()
            k = min(wanted, remaining - 1)
            if trace is not None:
                trace.append(max(k, 0))
            if k <= 0:
                n = min(p.plain_run(), remaining) if wanted <= 0 else 1
                if wanted <= 0:
                    p.observe(0, 0, float(n), tokens=n)
                time_, in_gen = time_ + n, in_gen + n
                continue
            n = 0
            while n < k and rng.random() < acceptance[min(n, len(acceptance) - 1)]:
                n += 1
            cost = base + 0.1 * k
            p.observe(k, n, cost)
            time_, in_gen, drafted_tokens = time_ + cost, in_gen + min(n + 1, remaining), drafted_tokens + n + 1
        made += gen_len
    return time_, drafted_tokens


def test_a_useless_drafter_costs_under_five_percent_even_in_short_generations():
    for gen_len in (40, 100):  # plain stretches and probing bursts carry across generations
        time_, drafted = simulate(AdaptivePolicy(max_k=8), [0.0], 2000, 0, gen_len)
        assert time_ <= 2000 / 0.95, gen_len


def test_a_useless_drafter_costs_under_five_percent():
    for seed in range(5):
        time_, drafted = simulate(AdaptivePolicy(max_k=8), [0.0], 2000, seed)
        assert time_ <= 2000 / 0.95  # modelled: plain decoding would take 2000
        assert drafted < 0.08 * 2000  # tokens from probing bursts: ~1/16 of each plain stretch


def test_a_useless_drafter_with_costly_cycles_costs_little():
    # this CPU: a k = 1 cycle of the random MTP head costs ~1.5 plain tokens (verify + Python per cycle)
    for gen_len in (40, None):
        time_, drafted = simulate(AdaptivePolicy(max_k=8), [0.0], 4000, 0, gen_len, base=1.4)
        assert time_ <= 4000 / 0.98, gen_len


def test_optimistic_start_drafts_from_the_first_cycle():
    """No evidence yet: auto drafts at k = 1 from the first cycle, so a short answer is drafted from its start."""
    trace = []
    time_, drafted = simulate(AdaptivePolicy(max_k=8), [0.7], 40, trace=trace)
    assert trace[:4] == [1, 1, 1, 1]  # drafting within the first 4 cycles (from the first, in fact)
    assert time_ < 40  # a useful drafter: the short answer already beats plain decoding (modelled)


def test_optimistic_start_costs_a_useless_drafter_a_few_percent_per_answer():
    # a fresh policy for every answer, as each CLI run has: the first burst is paid each time (modelled:
    # ~0.96 of plain at 64 tokens, ~0.98 at 256, the same as timing plain decoding first did)
    for gen_len, speed in ((64, 0.95), (256, 0.97)):
        for seed in range(3):
            time_, drafted = simulate(AdaptivePolicy(max_k=8), [0.0], gen_len, seed)
            assert time_ <= gen_len / speed, (gen_len, seed)
    # a drafting cycle costing 1.5 plain tokens (a k = 1 cycle can on this CPU), answers of 256 tokens
    time_, _ = simulate(AdaptivePolicy(max_k=8), [0.0], 256, 0, base=1.4)
    assert time_ <= 256 / 0.96


def test_a_hopeless_burst_ends_early():
    p = AdaptivePolicy(max_k=8)
    simulate(p, [0.0], 4000)
    assert p.stretch == p.max_stretch
    bursts, cycles = [], 0
    for _ in range(3000):  # after each 512-token stretch a burst of up to 32 cycles may run
        k = p.next_k()
        if k == 0:
            if cycles:
                bursts.append(cycles)
            cycles = 0
            n = p.plain_run()
            p.observe(0, 0, float(n), tokens=n)
        else:
            cycles += 1
            p.observe(k, 0, 1.3)
    assert bursts and max(bursts) <= 10  # 0 accepts in ~8 drafts: even the upper bound loses


def test_a_change_of_text_is_noticed_after_a_long_plain_stretch():
    p = AdaptivePolicy(max_k=8)
    simulate(p, [0.0], 4000)  # useless text: plain, stretches at their longest
    time_, drafted = simulate(p, [0.9], 2000, seed=3)  # the text turns predictable
    assert drafted > 1000  # back to drafting within about one stretch
    assert time_ < 2000  # and faster than plain over the 2000 tokens


def test_acceptance_evidence_fades_over_plain_tokens():
    p = AdaptivePolicy(max_k=2, window=64.0)
    for _ in range(20):
        p.observe(1, 0, 1.0)
    low = p.acceptance[0]
    p.observe(0, 0, 512.0, tokens=512)
    assert p.tries[0] < 0.01 and p.acceptance[0] > low  # back near the prior: the text may have changed


def test_converges_to_the_best_length_of_the_cost_model():
    def true_speed(a, k):  # tokens per modelled second with i.i.d. acceptance a
        return sum(a**i for i in range(k + 1)) / (1.0 if k == 0 else 1.2 + 0.1 * k)

    for a in (0.95, 0.8, 0.6, 0.4, 0.1):
        best = max(true_speed(a, k) for k in range(9))
        p = AdaptivePolicy(max_k=8)
        simulate(p, [a], 3000, seed=1)
        assert true_speed(a, p.best) >= 0.97 * best, (a, p.best)  # what it decided to run
        if p.best > 0:  # measured while drafting (during plain stretches the evidence fades by design)
            assert abs(p.acceptance[0] - a) < 0.2
        time_, _ = simulate(p, [a], 3000, seed=2)  # once learnt, the whole run is near the best fixed k
        assert 3000 / time_ >= 0.95 * best, a


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


def test_what_is_learnt_is_kept_per_sampling_regime():
    p = AdaptivePolicy(max_k=8)
    simulate(p, [0.9], 2000, regime="greedy")  # drafting pays
    greedy_best, greedy_acceptance = p.best, list(p.acceptance)
    assert greedy_best > 1
    p.begin("sampled")  # another regime starts from scratch ...
    assert p.cost == {} and p.acceptance == [] and p.max_k == 8
    simulate(p, [0.0], 2000, regime="sampled")  # ... and learns that drafting does not pay there
    assert p.best == 0
    p.begin("greedy")  # back: what was learnt for greedy decoding is intact
    assert p.best == greedy_best and p.acceptance == greedy_acceptance


def test_costs_are_learnt_per_context_range_and_acceptance_across():
    """A verify pass that is cheap at short contexts and dear at long ones (attention grows): the policy
    drafts at short contexts, re-measures when the context doubles past its range instead of trusting the
    short-context costs, stops drafting there, and finds its short-context table again when it comes back."""
    p = AdaptivePolicy(max_k=8)
    p.at_context(500)
    simulate(p, [0.6], 1000, base=1.2)
    short_best, acceptance, short_costs = p.best, list(p.acceptance), dict(p.cost)
    assert short_best > 0
    p.at_context(9000)
    assert p.cost == {} and p.acceptance == acceptance  # costs start afresh, acceptance is kept
    simulate(p, [0.6], 1000, base=4.0)  # a verify pass costs 4 plain tokens here
    assert p.best == 0
    p.at_context(600)  # back: the short-context costs, intact; drafting pays there again
    assert p.cost == short_costs and p.choose() > 0 and 3 in p._costs  # 9000 tokens: the range 8192-16383
