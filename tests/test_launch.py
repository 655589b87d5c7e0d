"""`python -m mlx_engine launch AGENT` with a stand-in agent (agent_stub.py) for each agent name: the variables,
arguments and temporary files it gets, each pointing at the server (the stub asks it a question with them and
gets 200), the user's own config files untouched, a server started for the agent and stopped with it, one
already running used and left running, and a model whose window is smaller than the agent's first request
refused before the agent starts."""

import json
import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from mlx_engine.__main__ import main
from mlx_engine.launch.agents import AGENTS, COMPACT_AT, TIMEOUT_SECONDS
from model_dirs import save_tiny
from serve_util import RunningServer, free_port

WINDOW = 32768  # a tiny model with a large window: every agent's first request fits
SMALL = 1024
USER_CONFIGS = {".claude.json": '{"theme": "dark"}', ".codex/config.toml": 'model = "gpt-5"\n',
                ".config/opencode/opencode.json": '{"model": "anthropic/claude"}',
                ".qwen/settings.json": '{"model": {"name": "qwen3-coder-plus"}}', ".aider.conf.yml": "model: gpt-4o\n"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    return {w: save_tiny(root / f"model-{w}", "llama", seed=4, max_position_embeddings=w) for w in (WINDOW, SMALL)}


@pytest.fixture(scope="module")
def server(model):
    s = RunningServer("--model", str(model[WINDOW]), "--max-tokens", "4", "--no-prefix-cache-dir")
    yield s
    s.close()


@pytest.fixture
def stub(tmp_path, monkeypatch):
    """An executable stand-in agent, a HOME holding the user's own agent configs, and the stub's record."""
    exe = tmp_path / "agent"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name('agent_stub.py')} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    home = tmp_path / "home"
    for name, text in USER_CONFIGS.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-the-users-own")  # must not reach Claude Code beside the token
    monkeypatch.setenv("STUB_OUT", str(tmp_path / "record.json"))
    monkeypatch.delenv("MLX_ENGINE_API_KEY", raising=False)

    def run(agent: str, *args: str, exit_code: int = 0) -> tuple[int, dict | None]:
        monkeypatch.setenv("STUB_AGENT", agent)
        monkeypatch.setenv("STUB_EXIT", str(exit_code))
        out = tmp_path / "record.json"
        out.unlink(missing_ok=True)
        rc = main(["launch", *args, "--agent-bin", str(exe), agent, "--user-flag", "x y"])
        return rc, json.loads(out.read_text()) if out.exists() else None

    run.home = home
    return run


def snapshot(home: Path) -> dict:
    return {str(p.relative_to(home)): (p.read_bytes(), p.stat().st_mtime_ns) for p in home.rglob("*") if p.is_file()}


def answering(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2):
            return True
    except OSError:
        return False


def check(agent: str, got: dict, url: str, model: str, window: int) -> None:
    """What each agent was given: the base URL, a key, the model under each name it asks for, the window, the
    timeout, non-essential traffic off; and its question to the server through these answered 200."""
    env, argv = got["env"], got["argv"]
    assert got["status"] == 200, got["status"]
    assert argv[-2:] == ["--user-flag", "x y"]  # the user's own arguments, last and as given
    if agent == "claude":
        assert env["ANTHROPIC_BASE_URL"] == url and env["ANTHROPIC_AUTH_TOKEN"] == "none"
        assert "ANTHROPIC_API_KEY" not in env
        tiers = ["ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"]
        assert {env[t] for t in tiers} == {model}
        assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(window) == env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"]
        assert env["API_TIMEOUT_MS"] == str(TIMEOUT_SECONDS * 1000)
        assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_TELEMETRY"] == "1"
    elif agent == "codex":
        pairs = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-c")
        assert json.loads(pairs["model_provider"]) == "mlx_engine" and json.loads(pairs["model"]) == model
        assert json.loads(pairs["model_providers.mlx_engine.base_url"]) == url + "/v1"
        assert json.loads(pairs["model_providers.mlx_engine.wire_api"]) == "responses"
        assert int(pairs["model_context_window"]) == window
        assert int(pairs["model_auto_compact_token_limit"]) == int(window * COMPACT_AT)
        assert int(pairs["model_providers.mlx_engine.stream_idle_timeout_ms"]) == TIMEOUT_SECONDS * 1000
        assert pairs["check_for_update_on_startup"] == "false" and pairs["analytics.enabled"] == "false"
    elif agent == "opencode":
        config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
        provider = config["provider"]["mlx-engine"]
        assert provider["options"]["baseURL"] == url + "/v1" and provider["options"]["timeout"] == TIMEOUT_SECONDS * 1000
        assert provider["models"][model]["limit"]["context"] == window
        assert config["model"] == config["small_model"] == f"mlx-engine/{model}" and config["autoupdate"] is False
        assert env["OPENCODE_DISABLE_AUTOUPDATE"] == "1" and env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    elif agent == "qwen":
        assert env["OPENAI_BASE_URL"] == url + "/v1" and env["OPENAI_MODEL"] == model
        settings = json.loads(got["files"]["QWEN_CODE_SYSTEM_SETTINGS_PATH"])
        assert settings["model"]["generationConfig"] == {"timeout": TIMEOUT_SECONDS * 1000, "contextWindowSize": window}
        assert settings["security"]["auth"]["selectedType"] == "openai"
        assert settings["privacy"]["usageStatisticsEnabled"] is False
        assert not Path(env["QWEN_CODE_SYSTEM_SETTINGS_PATH"]).exists()  # a temporary file, gone after the run
    else:
        assert env["OPENAI_API_BASE"] == url + "/v1" and env["AIDER_MODEL"] == f"openai/{model}"
        metadata = json.loads(got["files"]["AIDER_MODEL_METADATA_FILE"])[f"openai/{model}"]
        assert metadata["max_input_tokens"] == window and env["AIDER_TIMEOUT"] == str(TIMEOUT_SECONDS)
        assert env["AIDER_ANALYTICS"] == "false" and env["AIDER_CHECK_UPDATE"] == "false"


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_each_agent_gets_this_server_and_the_users_config_is_untouched(agent, server, stub):
    before = snapshot(stub.home)
    rc, got = stub(agent, "--port", str(server.args.port))
    assert rc == 0 and got is not None
    check(agent, got, server.base, server.model, WINDOW)
    assert snapshot(stub.home) == before  # the user's own config files: not one byte or time changed, none added
    assert answering(server.base)  # a server already running is left running


def test_a_server_is_started_for_the_agent_and_stopped_with_it(model, stub):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rc, got = stub("aider", "--port", str(port), "--model", str(model[WINDOW]),
                   "--serve-args", "--no-prefix-cache-dir --max-tokens 4", exit_code=3)
    assert rc == 3  # the agent's own exit status
    check("aider", got, url, Path(model[WINDOW]).name, WINDOW)  # it asked the server while it ran: 200
    assert not answering(url)  # and the server is gone with it


def test_a_window_smaller_than_the_agents_first_request_is_refused_before_it_starts(model, stub, capsys):
    s = RunningServer("--model", str(model[SMALL]), "--max-tokens", "4", "--no-prefix-cache-dir")
    try:
        rc, got = stub("claude", "--port", str(s.args.port))
        err = capsys.readouterr().err
        assert rc == 1 and got is None  # the agent never started
        assert f"{AGENTS['claude'].first_prompt:,} tokens" in err and f"{SMALL:,}" in err and "--force" in err
        rc, got = stub("claude", "--port", str(s.args.port), "--force")
        assert rc == 0 and got["status"] == 200
    finally:
        s.close()


def test_launch_says_when_the_agent_is_not_installed(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["launch", "codex"]) == 2 and "npm install -g @openai/codex" in capsys.readouterr().err
