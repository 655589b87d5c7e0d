"""The batch policy picks k from a fitted step cost T(B, k) and the measured acceptance."""

from mlx_engine.core.batch_policy import BatchPolicy


def drive(policy, steps, cost, accept, b_of_step):
    """Feed `steps` steps: T = cost(b, k), row r accepting `accept(k, r)` drafts. -> ks chosen per step."""
    ks = []
    for i in range(steps):
        b = b_of_step(i)
        k = policy.next_k(b)
        ks.append((b, k))
        policy.observe(b, k, [accept(k, r) for r in range(b)], cost(b, k))
    return ks


def test_drafts_where_verify_rows_are_cheap_and_stops_where_they_are_not():
    """A CPU-like step (a fixed part plus a cost per verified row): with half the first drafts accepted,
    drafting wins for one sequence (1.5 tokens for 1.33x the time) and loses for eight (1.5 for 1.78x);
    after a history of both batch sizes the policy draws both conclusions."""
    def cost(b, k):  # a CPU-like step: fixed part + per row, rows = b * (k + 1), plus drafting
        return 0.030 + 0.012 * b * (k + 1) + 0.002 * k

    p = BatchPolicy(max_k=4)
    drive(p, 300, cost, lambda k, r: min(k, 1 - r % 2), lambda i: 1 if (i // 25) % 2 == 0 else 8)
    assert p.choose(1) >= 1
    assert p.choose(8) == 0
    late = drive(p, 64, cost, lambda k, r: min(k, 1 - r % 2), lambda i: 8)
    drafted = sum(1 for _, k in late if k > 0)
    assert drafted <= 64 // p.probe_every * 2 + 1  # only the probes draft


def test_useless_drafter_is_turned_off_and_probed_rarely():
    p = BatchPolicy(max_k=4)
    ks = drive(p, 200, lambda b, k: 0.05 + 0.01 * b * (k + 1), lambda k, r: 0, lambda i: 2)
    assert p.choose(2) == 0
    assert sum(1 for _, k in ks[-96:] if k > 0) <= 96 // p.probe_every * 2


def test_good_drafter_stays_on_for_one_sequence():
    p = BatchPolicy(max_k=6)
    ks = drive(p, 120, lambda b, k: 0.05 + 0.002 * b * (k + 1), lambda k, r: k, lambda i: 1)  # all accepted
    assert p.choose(1) >= 4
    assert sum(1 for _, k in ks[-48:] if k == 0) == 0


def test_noisy_costs_and_poor_acceptance_stay_plain():
    """What the loaded CPU showed: step times +-30% from step to step, 15% of first drafts accepted (a k=1
    step costs ~1.2x a plain one, so drafting loses). Noise must not talk the policy into drafting."""
    import random

    rng = random.Random(0)
    p = BatchPolicy(max_k=8)

    def cost(b, k):
        return (0.77 + 0.05 * b * (k + 1) + 0.1 * k) * rng.uniform(0.7, 1.3)

    ks = drive(p, 240, cost, lambda k, r: 1 if k and rng.random() < 0.15 else 0, lambda i: 1 + (i // 40) % 2)
    late = [k for _, k in ks[-160:]]
    assert sum(1 for k in late if k > 0) <= 160 // p.probe_every * 2
    assert max(late) <= 1  # only k = 1 probes
