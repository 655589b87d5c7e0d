"""A rank that dies or hangs ends the run with a clear error on rank 0 within a bounded time, never a hang.

Rank 1 kills itself (SIGKILL) or stops itself (SIGSTOP: a hung process, as MLX's ring all_sum deadlock
leaves one, mlx issue 4475) after a few cycles of a speculative generation."""

import pytest

from dist_util import launch
from model_dirs import save_tiny
from test_distributed import PROMPT

TIMEOUT = 5  # MLX_ENGINE_DIST_TIMEOUT of these runs, in seconds


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("dist_faults") / "ds3", "deepseek_v3", seed=1, num_hidden_layers=2)


def run(tmp_path, model, **fault):
    import json

    spec = {"model": str(model), "mode": "pipeline", "timeout": TIMEOUT, "runs": [
        {"name": "ngram", "drafter": "ngram", "num_draft": 3, "prompt": PROMPT * 3, "max_tokens": 200, **fault}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    return launch(["tests/dist_driver.py", str(tmp_path / "spec.json"), str(tmp_path)], 2, timeout=90,
                  until_rank0=True)


def test_a_killed_rank_gives_rank_0_a_clear_error(tmp_path, model):
    rank0, rank1 = run(tmp_path, model, die_after=3)
    assert rank1.returncode == -9
    assert rank0.returncode == 2, rank0.stderr[-2000:]
    line = [ln for ln in rank0.stderr.splitlines() if ln.startswith("error: ")][-1]
    assert "rank 0 of 2 lost the connection to the other ranks" in line and "a rank died" in line
    assert "Traceback" not in rank0.stderr
    assert rank0.seconds - rank1.seconds < TIMEOUT  # at once: a closed socket, no timeout needed


def test_a_hung_rank_ends_the_run_after_the_timeout_with_what_happened(tmp_path, model):
    rank0, _ = run(tmp_path, model, hang_after=3)
    assert rank0.returncode == 3, rank0.stderr[-2000:]
    line = [ln for ln in rank0.stderr.splitlines() if ln.startswith("error: ")][-1]
    assert f"no progress for {TIMEOUT}" in line and "did not answer" in line and "mlx issue 4475" in line
    assert "waiting for the verify pass of cycle" in line or "decoding plain token" in line
    assert rank0.seconds < 60  # start-up + a few cycles + the timeout, not a hang


def test_a_dead_rank_is_seen_on_its_sockets_when_no_collective_raises():
    """Collectives queued after MLX's ring gave up on a closed socket wait forever, with no exception
    (distributed/peers.py): the guard sees the closed socket itself and ends the rank at once, exit 2."""
    from dist_util import launch

    rank0, rank1 = launch(["tests/dist_guard_driver.py", str(TIMEOUT)], 2, timeout=60, until_rank0=True)
    assert rank1.returncode == -9
    assert "watching 0 sockets" not in rank0.stdout and "watching" in rank0.stdout, rank0.stdout
    assert rank0.returncode == 2, rank0.stderr[-2000:]
    line = [ln for ln in rank0.stderr.splitlines() if ln.startswith("error: ")][-1]
    assert "rank 0 of 2 lost the connection to the other ranks while summing the queued collectives" in line
    assert "a rank died" in line and "Traceback" not in rank0.stderr
    assert rank0.seconds - rank1.seconds < TIMEOUT
