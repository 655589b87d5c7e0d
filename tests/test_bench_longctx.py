"""The long-context bench's agent session (bench/agent_session.py) and its command's bad inputs."""

import pytest

from mlx_engine.bench.agent_session import FILES, session, stdlib_dir


def count(messages):
    """A stand-in tokenizer: characters / 4 plus a few tokens per message."""
    return sum(len(m["content"]) // 4 + 4 for m in messages) + 1


@pytest.mark.parametrize("length", [1500, 4000, 9000])
def test_session_fits_its_length_and_asks_for_code_it_holds(length):
    s = session(count, length)
    assert length - 400 < count(s["messages"]) <= length
    text = "\n".join(m["content"] for m in s["messages"])
    assert s["asks"]["source"] in text  # the function asked for is in the context, whole
    assert s["asks"]["function"] in s["messages"][-1]["content"]
    assert s["files"][0] == FILES[0] and (stdlib_dir() / FILES[0]).exists()
    assert session(count, length) == s  # deterministic


def test_session_too_short_for_one_file():
    with pytest.raises(ValueError, match="cannot hold one whole file"):
        session(count, 300)


def test_bench_refuses_bad_modes_before_loading(capsys):
    from mlx_engine.bench.longctx import main

    assert main(["--modes", "ngram,plain"]) == 2
    assert "--modes must start with plain" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--agent-server", "--short-rate", "-1"], "--short-rate must be >= 0"),
    (["--agent-server", "--prefill-budget", "0"], "--prefill-budget must be in (0, 60]"),
])
def test_agent_server_bench_refuses_bad_flags_before_loading(capsys, args, message):
    from mlx_engine.bench.longctx import main

    assert main(args) == 2
    assert message in capsys.readouterr().err


class _FakeEngine:
    def __init__(self, slots):
        self.slots, self.added = slots, []

    def free_slots(self):
        return self.slots - len(self.added)

    def add(self, sid, prompt, max_tokens):
        self.added.append(sid)


class _Tok:
    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [1, 2, len(messages[0]["content"])]


def test_agent_server_clients_arrive_poisson_wait_past_a_full_batch_and_count_from_arrival():
    from mlx_engine.bench.agent_server import _Clients

    engine = _FakeEngine(slots=2)
    clients = _Clients(engine, _Tok(), rate_per_min=60.0, max_tokens=4, seed=3)
    clients.start(0.0)
    clients.arrive(30.0)  # ~30 arrivals at one a second
    assert 15 <= clients.sent <= 50
    assert engine.added == ["short1", "short2"] and len(clients.backlog) == clients.sent - 2  # the rest wait
    arrived = clients.waiting["short1"]
    assert 0.0 < arrived < 30.0
    clients.seen("short1", [5], 31.0)
    assert clients.ttfts == [pytest.approx(31.0 - arrived)] and "short1" not in clients.waiting
    again = _Clients(_FakeEngine(2), _Tok(), 60.0, 4, seed=3)
    again.start(0.0)
    again.arrive(30.0)
    assert again.waiting == clients.waiting | {"short1": arrived}  # seeded: the same arrivals


def test_agent_server_traces_the_slowest_short_requests_through_the_steps_they_waited():
    from mlx_engine.bench.agent_server import _slowest

    steps = [(0.0, 0.5, 1, {"cold": 512}), (0.5, 0.6, 2, {"s1": 31}), (0.6, 0.7, 2, {}), (0.7, 1.2, 2, {"cold": 512})]
    spans = [(0.4, 0.6), (0.65, 0.7)]  # s1 arrived 0.1 s before the long chunk's step ended, s2 within a decode
    [slow, fast] = _slowest(spans, steps, n=2)
    assert slow["ttft_s"] == pytest.approx(0.2) and slow["in_flight_left_s"] == pytest.approx(0.1)
    assert [st["fed"] for st in slow["steps"]] == [{"cold": 512}, {"s1": 31}]
    assert fast["ttft_s"] == pytest.approx(0.05) and [st["rows"] for st in fast["steps"]] == [2]
    assert len(_slowest(spans, steps, n=1)) == 1


def test_serve_refuses_a_bad_prefill_budget_before_loading(capsys):
    from mlx_engine.__main__ import main

    assert main(["serve", "--prefill-budget", "0"]) == 2
    assert "--prefill-budget must be in (0, 60] seconds" in capsys.readouterr().err
