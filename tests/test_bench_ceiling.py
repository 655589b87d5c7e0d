"""`bench ceiling`: the copy oracle's lengths and least-cost schedule against brute force."""

import random

import pytest

from mlx_engine.bench.ceiling import ceiling, copy_lengths, min_cost
from mlx_engine.bench.__main__ import main as bench_main


def brute_lengths(known, answer, min_match, max_draft):
    """For each i, the longest m (<= max_draft) such that answer[i:i+m] sits in one known text (earlier texts,
    or the prompt + answer[:i]) right after an occurrence of the answer's last min_match written tokens."""
    out = [0]
    for i in range(1, len(answer)):
        texts = [list(t) for t in known[:-1]] + [list(known[-1]) + answer[:i]]
        written = (list(known[-1]) + answer[:i])[-min_match:]
        best = 0
        for t in texts:
            for j in range(min_match, len(t)):
                if t[j - min_match : j] != written:
                    continue
                for m in range(1, max_draft + 1):
                    if i + m <= len(answer) and j + m <= len(t) and t[j : j + m] == answer[i : i + m]:
                        best = max(best, m)
        out.append(best)
    return out


def brute_cost(lengths, cost):
    """The least cost over every schedule, by enumerating them (short answers only)."""
    n = len(lengths)

    def go(i):
        if i >= n:
            return 0.0
        return min(cost[m + 1] + go(i + m + 1) for m in range(0, min(lengths[i], n - 1 - i) + 1))

    return go(1)


@pytest.mark.parametrize("seed", range(40))
def test_copy_lengths_match_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])
    known = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(rng.randrange(1, 4))]
    answer = [rng.randrange(vocab) for _ in range(rng.randrange(2, 14))]
    min_match, max_draft = rng.choice([1, 2, 3]), rng.choice([2, 4, 16])
    assert copy_lengths(known, answer, min_match, max_draft) == brute_lengths(known, answer, min_match, max_draft)


def test_a_copy_stays_inside_one_text_and_inside_what_is_written():
    # the earlier text ends after 8: the copy of "8" cannot run on into the prompt's 9
    assert copy_lengths([[7, 8], [9]], [7, 8, 9], 1, 16) == [0, 1, 0]
    # only what is written can be copied (one 5 after "5 5", two after "5 5 5"), and no further than the
    # answer goes (one token left at the end)
    assert copy_lengths([[5]], [5, 5, 5, 5], 1, 16) == [0, 1, 2, 1]


def test_an_answer_that_repeats_its_prompt_costs_one_pass():
    prompt, answer = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]
    lengths = copy_lengths([prompt], answer, 1, 16)
    assert lengths[1] == 5  # 2..6 copied; 7 is the target's own
    free = {r: 1.0 for r in range(1, 18)}
    assert min_cost(lengths, free) == (1.0, 1)
    row = ceiling("x", [prompt], answer, free, 1, 16)
    assert (row.answer_tokens, row.copyable, row.passes, row.speedup) == (6, 5, 1, 6.0)


@pytest.mark.parametrize("seed", range(30))
def test_min_cost_is_the_best_schedule(seed):
    rng = random.Random(seed)
    n = rng.randrange(2, 11)
    lengths = [0] + [rng.randrange(0, 5) for _ in range(n - 1)]
    step = rng.choice([0.0, 0.1, 0.3, 1.2])  # rows costing nothing, little, much, more than a step
    cost = {r: 1.0 + step * (r - 1) ** rng.choice([0.5, 1.0]) for r in range(1, 7)}
    total, passes = min_cost(lengths, cost)
    assert total == pytest.approx(brute_cost(lengths, cost))
    assert 1 <= passes <= n - 1


def test_rows_dearer_than_steps_make_the_oracle_decode_plainly():
    lengths = [0, 3, 2, 1, 0]
    cost = {r: float(r) * 1.5 for r in range(1, 5)}
    cost[1] = 1.0
    assert min_cost(lengths, cost) == (4.0, 4)


def test_an_unknown_suite_is_one_error_line_before_the_model_loads(capsys):
    assert bench_main(["ceiling", "--suite", "no-such-suite"]) == 2
    err = capsys.readouterr().err
    assert "no-such-suite" in err and err.count("\n") == 1
