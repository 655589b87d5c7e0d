"""The disk tier through the server (issue 52): a restarted server over the same folder answers a resent agent
prompt from disk (the same answer, /health and /metrics counting the disk hit, the start-up line naming the
folder), and `python -m mlx_engine cache` lists and clears the folder."""

import httpx2 as httpx
import pytest

from mlx_engine.__main__ import main
from serve_util import RunningServer
from test_serve_batch import ask

PROMPT = "Summarise this file in one line:\n" + "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(40))


@pytest.mark.cpu_exact  # the restored entries give the tokens the first server's cold prefill gave
def test_a_restarted_server_answers_from_disk(tmp_path, capsys):
    folder = tmp_path / "cache"
    first = RunningServer("--prefix-cache-dir", str(folder), "--drafter", "none", "--max-tokens", "24")
    try:
        cold = ask(first, PROMPT, 16)
    finally:
        first.close()  # (stopping flushes what is queued for the disk)
    again = RunningServer("--prefix-cache-dir", str(folder), "--drafter", "none", "--max-tokens", "24")
    try:
        assert ask(again, PROMPT, 16) == cold
        tree = httpx.get(again.base + "/health").json()["prefix_cache"]
        assert tree["disk"]["hits"] == 1 and tree["disk"]["hit_tokens"] > 300 and tree["tiers"]["disk_hits"] == 1
        metrics = httpx.get(again.base + "/metrics").text
        assert 'mlx_engine_prefix_cache_hits_total{tier="disk"} 1.0' in metrics
    finally:
        again.close()
    capsys.readouterr()
    assert main(["cache", "list", "--dir", str(folder)]) == 0
    listed = capsys.readouterr().out
    assert "entries" in listed and " 0 entries" not in listed.splitlines()[-1]
    assert main(["cache", "clear", "--dir", str(folder)]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["cache", "list", "--dir", str(folder)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": 0 entries, 0.00 GiB")


def test_no_prefix_cache_dir_keeps_to_ram(tmp_path):
    server = RunningServer("--no-prefix-cache-dir", "--drafter", "none")
    try:
        assert "disk" not in httpx.get(server.base + "/health").json()["prefix_cache"]
    finally:
        server.close()
