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
