"""The server `launch` hands an agent: the one already answering on the port (its /v1/models says the model and
window), or one started here as `python -m mlx_engine serve` in a child process, waited for, and stopped when
the agent exits. Its log goes to a file, so the agent's screen is its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .agents import Server


class LaunchError(Exception):
    pass


def model_card(url: str, api_key: str | None, timeout: float = 2.0) -> dict | None:
    """The first entry of `url`/v1/models, or None when nothing answers there. LaunchError for a server that
    answers but is not this one (no context_length) or refuses the key."""
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key or 'none'}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise LaunchError(f"the server at {url} wants an API key: pass --api-key or set MLX_ENGINE_API_KEY") \
                from None
        raise LaunchError(f"{url}/v1/models answered {e.code}: is another server on this port?") from None
    except (OSError, ValueError):  # refused, reset, timed out, not JSON yet
        return None
    data = body.get("data") if isinstance(body, dict) else None
    card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if card is None or "context_length" not in card:
        raise LaunchError(f"{url} answers /v1/models without a context window: another kind of server is on this "
                          f"port (pick another with --port)")
    return card


class Started:
    """A `serve` child process, its log in `log`."""

    def __init__(self, serve_argv: list[str], log: Path, api_key: str | None = None):
        self.log = log
        self._out = open(log, "wb")
        env = {**os.environ, "MLX_ENGINE_API_KEY": api_key} if api_key else None  # (a flag would show in ps)
        self.process = subprocess.Popen([sys.executable, "-m", "mlx_engine", "serve", *serve_argv], env=env,
                                        stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)  # the terminal's Ctrl-C goes to the agent only

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # serve's graceful shutdown: running requests get their time
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._out.close()


def wait_for(url: str, api_key: str | None, started: Started, timeout: float) -> dict:
    """Poll /v1/models until the child answers (its model card), it exits (LaunchError with its log's tail), or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        card = model_card(url, api_key)
        if card is not None:
            return card
        if started.process.poll() is not None:
            raise LaunchError(f"the server exited ({started.process.returncode}) before it answered:\n{started.tail()}")
        time.sleep(0.25)
    raise LaunchError(f"the server did not answer within {timeout:g} s (its log: {started.log})")


def connect(host: str, port: int, api_key: str | None, serve_argv: list[str], log: Path,
            timeout: float) -> tuple[Server, Started | None]:
    """The server on host:port, started with `serve_argv` when none answers there. -> (what the agent is told,
    the child to stop afterwards or None when the server was already running)."""
    url = f"http://{host}:{port}"
    card = model_card(url, api_key)
    started = None
    if card is None:
        started = Started(["--host", host, "--port", str(port), *serve_argv], log, api_key)
        try:
            card = wait_for(url, api_key, started, timeout)
        except BaseException:
            started.stop()
            raise
    return Server(url, card["id"], int(card["context_length"]), api_key), started
