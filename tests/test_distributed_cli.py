"""`mlx.launch -n 2 -- python -m mlx_engine generate|serve --distributed ...`: the user's command lines,
through MLX's own launcher; bad input refused with one line."""

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from dist_util import MLX_LAUNCH, PYTHON, ROOT, free_ports, mlx_launch, save_noisy_copy
from model_dirs import save_tiny
from mlx_engine.__main__ import main

TOKENS = "5,6,7,8,5,6,7,8,5,6,7,9,10,11,12"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_cli")
    model = save_tiny(root / "ds3", "deepseek_v3", seed=1, num_hidden_layers=4)
    return model, save_noisy_copy(model, root / "ds3-draft", scale=0.05)


def one_process(capsys, model, *extra):
    assert main(["generate", "--model", str(model), "--prompt-tokens", TOKENS, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_under_mlx_launch_equals_one_process(models, capsys):
    model, draft = models
    args = ["--max-tokens", "24", "--ignore-eos"]
    r = mlx_launch(["-m", "mlx_engine", "generate", "--distributed", "pipeline", "--model", str(model),
                    "--prompt-tokens", TOKENS, "--drafter", "draft", "--draft-model", str(draft), "--num-draft", "3",
                    "--json", *args])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1  # rank 0's answer; the follower prints nothing
    out = json.loads(lines[0])
    assert out["stats"]["ranks"] == 2 and out["stats"]["drafted"] > 0
    c = out["stats"]["collectives"]
    assert c["decision"] <= out["stats"]["cycles"] + 2 and c["model"] > 0
    assert out["tokens"] == one_process(capsys, model, *args)["tokens"]


def test_one_process_with_the_flag_and_bad_input(models, capsys):
    model, _ = models
    plain = one_process(capsys, model, "--max-tokens", "8")
    assert main(["generate", "--model", str(model), "--prompt-tokens", TOKENS, "--json", "--max-tokens", "8",
                 "--distributed", "pipeline"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == plain["tokens"]
    assert "with one process: start it with mlx.launch -n N" in captured.err
    for extra, words in ((["--distributed", "ring"], "invalid choice: 'ring'"),
                         (["--distributed", "tensor", "--batch-invariant"], "batch-invariant decoding is not"),
                         (["--distributed", "pipeline", "--model", str(model / "model.gguf")], "cannot be sharded")):
        argv = ["generate", "--model", str(model), "--prompt-tokens", TOKENS, *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_serve_under_mlx_launch(models, capsys):
    """Rank 0 serves, the follower runs its steps: greedy answers equal one process, a stop string ends a
    request early (the ranks stay in step for the next), a sampled request, a JSON schema (rank 0's grammar)
    as one process writes it, then Ctrl-C ends both."""
    model, draft = models
    port = free_ports(1)[0]
    cmd = [MLX_LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(1)[0]), "--", PYTHON, "-m",
           "mlx_engine", "serve", "--distributed", "pipeline", "--model", str(model), "--drafter", "draft",
           "--draft-model", str(draft), "--num-draft", "3", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
                time.sleep(0.5)
        assert main(["generate", "--model", str(model), "--prompt-tokens", "3,4", "--json", "--max-tokens", "12"]) == 0
        expected = json.loads(capsys.readouterr().out)["text"]  # 'IIIIIII>...' from this tiny model
        body = {"model": model.name, "prompt": [3, 4], "max_tokens": 12}
        first = post(base, body)
        assert first["choices"][0]["text"] == expected and first["speculation"]["drafted"] > 0
        cut = post(base, {**body, "stop": [">"]})
        assert cut["choices"][0]["text"] == expected[: expected.index(">")]
        assert post(base, {**body, "temperature": 0.9, "seed": 5})["usage"]["completion_tokens"] >= 1
        schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "s": {"type": "string", "maxLength": 6}},
                  "required": ["c", "s"], "additionalProperties": False}
        (model.parent / "schema.json").write_text(json.dumps(schema))
        assert main(["generate", "--model", str(model), "--prompt-tokens", "3,4", "--json", "--max-tokens", "40",
                     "--grammar", f"json:{model.parent / 'schema.json'}"]) == 0
        constrained = json.loads(capsys.readouterr().out)["text"]
        assert json.loads(constrained)["c"] in ("red", "blue")
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}  # rank 0's grammar
        assert post(base, {**body, "max_tokens": 40, "response_format": fmt})["choices"][0]["text"] == constrained
        again = post(base, body)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the launcher's terminal: every rank gets it
        try:
            assert proc.wait(timeout=30) is not None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
