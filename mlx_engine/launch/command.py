"""`python -m mlx_engine launch AGENT [agent args...]`: a coding agent on this server in one command. The server on
--port is used where one answers, else started (`serve` with --model / --drafter / --serve-args), waited for, and
stopped when the agent exits; the agent starts with its configuration for this server only (agents.py), its
own arguments passed on as given, and its exit status returned."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .agents import AGENTS, Setup, too_small
from .server import LaunchError, connect

DEFAULT_PORT = 8080


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", choices=sorted(AGENTS), help="the agent to start")
    p.add_argument("agent_args", nargs=argparse.REMAINDER,
                   help="passed to the agent as given (e.g. -p 'hi' for claude, exec '...' for codex, run '...' "
                        "for opencode, --message '...' for aider)")
    p.add_argument("--host", default="127.0.0.1", help="the server's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"the server's port (default {DEFAULT_PORT}): a server answering there is used, else one is "
                        "started there and stopped with the agent")
    p.add_argument("--model", help="the model of a server started here (default: serve's, the embedded model)")
    p.add_argument("--drafter", help="the drafter of a server started here (default: serve's)")
    p.add_argument("--serve-args", default="", metavar="'FLAGS'",
                   help="more `serve` flags for a server started here, as one quoted string")
    p.add_argument("--api-key", default=os.environ.get("MLX_ENGINE_API_KEY") or None,
                   help="the server's key (default: MLX_ENGINE_API_KEY; a server started here takes it too)")
    p.add_argument("--agent-bin", help="the agent's executable (default: found on PATH by its name)")
    p.add_argument("--force", action="store_true",
                   help="start the agent even when the model's window is smaller than its first request")
    p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                   help="how long a server started here may take to load (default 600)")
    p.add_argument("--print-env", action="store_true",
                   help="print what the agent is given (variables, arguments) and start nothing else")


def serve_argv(args) -> list[str]:
    out = ["--model", args.model] * bool(args.model) + ["--drafter", args.drafter] * bool(args.drafter)
    return out + shlex.split(args.serve_args)


def materialize(setup: Setup, folder: Path) -> tuple[list[str], dict[str, str]]:
    """The setup's files written into `folder`; -> (its argv, the agent's whole environment)."""
    for name, text in setup.files.items():
        (folder / name).write_text(text)
    argv = [a.replace("{dir}", str(folder)) for a in setup.argv]
    env = dict(os.environ)
    for key, value in setup.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value.replace("{dir}", str(folder))
    return argv, env


def describe(setup: Setup, argv: list[str]) -> str:
    lines = [f"{k}={'(unset)' if v is None else v}" for k, v in setup.env.items()]
    lines += [f"{name}: {text}" for name, text in setup.files.items()]
    if argv:
        lines.append("arguments: " + shlex.join(argv))
    return "\n".join(lines)


def run_launch(args) -> int:
    agent = AGENTS[args.agent]
    executable = args.agent_bin or shutil.which(agent.executable)
    if executable is None and not args.print_env:
        print(f"error: `{agent.executable}` is not on PATH: install it ({agent.install}) or pass --agent-bin",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix=f"mlx-engine-{agent.name}-") as tmp:
        folder = Path(tmp)
        log = folder / "serve.log"
        try:
            server, started = connect(args.host, args.port, args.api_key, serve_argv(args), log, args.wait)
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        try:
            where = f"started here, log {log}" if started else "already running"
            print(f"mlx-engine: {server.model} at {server.url}/v1 ({where}; context {server.context_length:,} tokens)",
                  file=sys.stderr, flush=True)
            why = too_small(agent, server.context_length)
            if why and not args.force:
                print(f"error: {why}", file=sys.stderr)
                return 1
            setup = agent.configure(server)
            argv, env = materialize(setup, folder)
            if args.print_env:
                print(describe(setup, argv))
                return 0
            try:
                return subprocess.run([executable, *argv, *args.agent_args], env=env).returncode
            except KeyboardInterrupt:  # the agent had its Ctrl-C too; the server stops below
                return 130
        finally:
            if started is not None:
                started.stop()
