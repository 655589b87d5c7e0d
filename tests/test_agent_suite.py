"""The agent suite (mlx_engine/bench/agent_suite.py, bench/prompts/agent.jsonl) and the bench's private suffix
caches: each second request resends the first whole with the answer and a new ask, the asked code is in the
tool output, the file says where its text comes from; a bench mode's suffix cache is its own and emptied."""

import json
import sys

import pytest

from mlx_engine.bench import agent_suite
from mlx_engine.drafters.base import Verdict
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.ngram import NgramDrafter
from mlx_engine.drafters.suffix import SuffixDrafter, private_cache
from mlx_engine.drafters.suffix_cache import SuffixCache, shared_cache
from test_suffix import corpus, distinct_substrings


def test_sessions_resend_the_earlier_request_and_ask_for_code_from_the_tool_output():
    rows = agent_suite.build()
    assert len(rows) == 12 and len({r["id"] for r in rows}) == 12
    for first, second in zip(rows[::2], rows[1::2]):
        m1, m2 = first["messages"], second["messages"]
        assert m2[: len(m1)] == m1 and [m["role"] for m in m2[len(m1) :]] == ["assistant", "user"]
        tool = m1[3]["content"]
        assert tool.startswith("[tool read_file ")
        code = m2[len(m1)]["content"].strip("`\n").removeprefix("python\n").splitlines()
        body = [line for line in code if '"""' not in line]  # the answer: the function, a docstring added
        lines = iter(tool.splitlines())
        assert all(line in lines for line in body)  # ... in the order of the tool's output (its own docstring out)
        assert "PSF-2.0" in first["source"] and sys.version.split()[0] in first["source"]


def test_the_committed_suite_is_what_the_generator_writes():
    rows = [json.loads(line) for line in agent_suite.OUT.read_text().splitlines()]
    if rows[0]["source"].split()[1] != sys.version.split()[0]:
        pytest.skip("written by another Python version (its standard library differs)")
    assert rows == agent_suite.build()


def test_a_bench_mode_gets_its_own_suffix_cache_and_it_empties():
    caches = []
    chain = private_cache(ChainDrafter(NgramDrafter(), SuffixDrafter()), caches)  # (any model member will do)
    alone = private_cache(SuffixDrafter(), caches)
    assert private_cache(NgramDrafter(), caches) is not None and len(caches) == 2
    assert chain.ngram.cache is caches[0] and alone.cache is caches[1]
    assert all(c is not shared_cache() for c in caches)
    alone.begin([1, 2, 3, 1, 2])
    assert alone.lookup(2) == [3, 1]
    caches[1].clear()
    assert caches[1].nodes == 0 and alone.match() is not None  # its own text goes back in at its next read
    alone.commit(Verdict(0, 0, [7]))
    assert caches[1].nodes == distinct_substrings(corpus(caches[1]), caches[1].depth)
    other = SuffixDrafter(caches[1])
    other.begin([9, 2, 3])  # the text written back after the clear is there: "2 3" -> 1
    assert other.lookup(1) == [1]


def test_clear_forgets_every_text():
    cache = SuffixCache()
    d = SuffixDrafter(cache)
    d.begin([4, 5, 6, 4, 5])
    cache.clear()
    fresh = SuffixDrafter(cache)
    fresh.begin([4, 5])
    assert fresh.next_member() is None  # nothing of the cleared text is left
