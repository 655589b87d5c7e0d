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


# -- decisions from synthetic timings and acceptances ------------------------------------------------------
def feed(policy, b, k, seconds, accepted, steps, ks=None, rows=None):
    """`steps` timed steps of b rows at batch length k, each row accepting accepted[r] drafts."""
    for _ in range(steps):
        policy.observe(b, k, list(accepted), seconds, ks, rows)


def test_chooses_plain_where_a_verify_costs_more_than_the_acceptance_returns():
    """B = 4: a step at k = 1 costs 1.5 plain steps. A first-position acceptance of 0.3 returns 1.3 tokens
    per row for it (k = 0 wins); 0.9 returns 1.9 (k > 0 wins). Same costs, the acceptance decides."""
    for acceptance, drafts in ((0.3, False), (0.9, True)):
        p = BatchPolicy(max_k=4)
        feed(p, 4, 0, 0.100, [0] * 4, 10)
        for step in range(40):  # rows accept their first draft at the given rate, never the second
            accepted = [1 if (step * 4 + r) % 10 < acceptance * 10 else 0 for r in range(4)]
            p.observe(4, 1, accepted, 0.150)
        assert (p.choose(4) > 0) == drafts, (acceptance, p.report())


def test_same_acceptance_pays_at_one_batch_size_and_not_at_another():
    """Acceptance 0.5 at both sizes; k = 1 costs 1.15x a plain step at B = 1 (drafting wins: 1.5 tokens)
    and 1.8x at B = 8 (it loses): the policy drafts for one sequence and not for eight."""
    p = BatchPolicy(max_k=1)
    for b, plain, drafted in ((1, 0.085, 0.098), (8, 0.140, 0.252)):
        feed(p, b, 0, plain, [0] * b, 10)
        feed(p, b, 1, drafted, [r % 2 for r in range(b)] if b > 1 else [1], 10)
        feed(p, b, 1, drafted, [(r + 1) % 2 for r in range(b)] if b > 1 else [0], 10)
    assert p.choose(1) == 1
    assert p.choose(8) == 0


def test_costs_measured_at_one_batch_size_are_kept_while_the_batch_runs_at_another():
    """A long run at B = 8 must not overwrite what was measured at B = 1 (a fit over the latest steps
    would predict B = 1 from B = 8's steps): back at one sequence, drafting still wins there."""
    p = BatchPolicy(max_k=2)
    feed(p, 1, 0, 0.085, [0], 10)
    for step in range(20):
        p.observe(1, 1, [step % 2], 0.098)
    for step in range(400):
        k = 1 if step % 8 == 0 else 0
        p.observe(8, k, [(step + r) % 2 for r in range(8)], 0.140 if k == 0 else 0.252)
    assert abs(p.cost(1, 0) - 0.085) < 1e-9 and abs(p.cost(1, 1) - 0.098) < 1e-9
    assert p.choose(1) >= 1 and p.choose(8) == 0


def test_an_unmeasured_batch_size_is_predicted_from_verify_rows():
    """Steps measured at B = 1, 2, 4 on a machine where a step costs 80 ms + 8 ms per verify row + 10 ms
    per draft step: B = 8 (never run) is predicted from its rows, 16 at k = 1, by the fit."""
    def t(b, k):
        return 0.080 + 0.008 * b * (k + 1) + 0.010 * k

    p = BatchPolicy(max_k=2)
    for b in (1, 2, 4):
        for k in (0, 1):
            feed(p, b, k, t(b, k), [0] * b, 4)
    for b, k in ((8, 0), (8, 1), (4, 2), (8, 2)):
        assert abs(p.cost(b, k) - t(b, k)) < 0.02 * t(b, k), (b, k, p.cost(b, k), t(b, k))


def test_a_spike_from_another_process_does_not_flip_the_choice():
    p = BatchPolicy(max_k=1)
    feed(p, 2, 0, 0.100, [0, 0], 20)
    for step in range(40):
        p.observe(2, 1, [1, step % 2], 0.115)  # acceptance 0.75 for 1.15x: drafting wins
    assert p.choose(2) == 1
    p.observe(2, 1, [0, 0], 2.0)  # one step 17x slower (the machine was busy)
    assert p.choose(2) == 1


def test_a_useless_drafter_is_probed_ever_more_rarely():
    """Acceptance 0: after the first batch size's exploration, plain decoding with probes whose spacing
    doubles while they keep losing: over 2,000 steps drafting takes well under 2% of the steps."""
    p = BatchPolicy(max_k=4)
    ks = []
    for _ in range(2000):
        k = p.next_k(4)
        ks.append(k)
        p.observe(4, k, [0] * 4, 0.1 * (1 + 0.5 * k))
    assert sum(1 for k in ks if k > 0) < 0.02 * len(ks)
    assert p.stretch == p.max_stretch
    assert sum(1 for k in ks[-600:] if k > 0) <= 2 * (600 // p.max_stretch + 1)


def test_rows_draft_up_to_their_caps():
    p = BatchPolicy(max_k=4)
    assert p.row_ks(3, [p.row() for _ in range(3)], [0, 2, 8]) == [0, 2, 3]
    assert p.row_ks(0, [p.row() for _ in range(2)], [8, 8]) == [0, 0]


def test_a_row_whose_drafts_are_rejected_stops_drafting_when_its_drafting_costs_time():
    """A drafter per row (its cost grows with the drafts: 10 ms per drafted token, against 100 ms + 5 ms per
    verify row): drafting pays for the batch (one row accepts every draft), but the row whose 30 drafts
    were all rejected drafts 0 while the other keeps drafting. With one batched head pass for all rows,
    drafting a row costs nothing extra: both draft. A probe step re-tries every row."""
    def t(b, k, drafted):
        return 0.1 + 0.005 * b * (k + 1) + 0.010 * drafted

    for per_row in (True, False):
        p = BatchPolicy(max_k=2, per_row_drafting=per_row)
        rows = [p.row(), p.row()]
        feed(p, 2, 0, t(2, 0, 0), [0, 0], 6, rows=rows)
        for b, ks in ((1, [1]), (2, [2, 2]), (1, [2])):  # cells for the fit at other sizes
            feed(p, b, max(ks), t(b, max(ks), sum(ks) if per_row else max(ks)), [0] * b, 4, ks=ks)
        for _ in range(30):
            p.observe(2, 1, [0, 1], t(2, 1, 2 if per_row else 1), [1, 1], rows)
        assert p.choose(2) == 1
        p.next_k(2)
        assert p.row_ks(1, rows, [8, 8]) == ([0, 1] if per_row else [1, 1])
        probe = next(k for k in (p.next_k(2) for _ in range(p.probe_every)) if k != 1)  # a neighbour of k = 1
        assert probe == 2 and p.row_ks(probe, rows, [8, 8]) == [2, 2]


def test_a_neighbour_measured_far_slower_is_not_probed_again():
    """k = 1 wins at B = 8 (by 23% over plain); k = 2 was measured at 1.5x the time of k = 1 for little more:
    drafting goes on at k = 1 without a k = 2 (or k = 0) probe every probe_every steps."""
    p = BatchPolicy(max_k=3)
    feed(p, 8, 0, 0.140, [0] * 8, 10)
    feed(p, 8, 1, 0.170, [r % 2 for r in range(8)], 40)
    feed(p, 8, 2, 0.255, [r % 2 for r in range(8)], 4)
    assert p.choose(8) == 1
    ks = [p.next_k(8) for _ in range(8 * p.probe_every)]
    assert set(ks) == {1}
