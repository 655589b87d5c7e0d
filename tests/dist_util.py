"""Several local processes joined by MLX's ring backend over loopback, as `mlx.launch -n N` starts them.

`launch(argv, n)` starts N processes of `python argv...` with the environment mlx.launch gives them (a ring
hostfile of 127.0.0.1 ports, MLX_RANK) and collects each rank's exit status and output; `mlx_launch()`
runs the real launcher. Ports come from the OS (a free port per rank), so tests may run beside others.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MLX_LAUNCH = str(Path(PYTHON).parent / "mlx.launch")
# the ranks import this tree's packages (not an installed copy) and the tests' helpers
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "tests")])


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def env_for(rank: int, hostfile: str, extra: dict | None = None) -> dict:
    env = {**os.environ, "MLX_HOSTFILE": hostfile, "MLX_RANK": str(rank), "PYTHONPATH": PYTHONPATH,
           "MLX_ENGINE_DIST_BACKEND": "ring"}
    env.update(extra or {})
    return env


@dataclass
class Rank:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def launch(argv: list[str], n: int = 2, timeout: float = 120, env: dict | None = None,
           on_start=None, until_rank0: bool = False) -> list[Rank]:
    """Run `python argv` on n ranks; every rank is killed if the run passes `timeout` seconds (a hang fails
    the test, it never stalls the suite), or once rank 0 has ended with `until_rank0`. on_start(processes)
    runs once they are started."""
    ports = free_ports(n)
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        outs = [(open(Path(tmp) / f"out{r}", "w+"), open(Path(tmp) / f"err{r}", "w+")) for r in range(n)]
        t0 = time.monotonic()
        procs = [subprocess.Popen([PYTHON, *argv], cwd=ROOT, env=env_for(r, str(hostfile), env),
                                  stdout=outs[r][0], stderr=outs[r][1]) for r in range(n)]
        if on_start is not None:
            on_start(procs)
        ended = [None] * n
        try:
            while any(e is None for e in ended) and time.monotonic() - t0 < timeout:
                if until_rank0 and ended[0] is not None:
                    break
                for r, p in enumerate(procs):
                    if ended[r] is None and p.poll() is not None:
                        ended[r] = time.monotonic() - t0
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait()
        result = []
        for r, p in enumerate(procs):
            out, err = outs[r]
            out.seek(0)
            err.seek(0)
            result.append(Rank(p.returncode, out.read(), err.read(), ended[r] if ended[r] is not None else timeout))
            out.close()
            err.close()
        return result


def mlx_launch(argv: list[str], n: int = 2, timeout: float = 120, env: dict | None = None):
    """`mlx.launch -n N --backend ring -- python argv...`, the user's command line (outputs merged)."""
    port = free_ports(1)[0]
    envs = sum((["--env", f"{k}={v}"] for k, v in (env or {}).items()), [])
    cmd = [MLX_LAUNCH, "-n", str(n), "--backend", "ring", "--starting-port", str(port), *envs, "--",
           PYTHON, *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})


def save_noisy_copy(src: Path, dst: Path, scale: float = 0.05, seed: int = 0) -> Path:
    """A draft model: the target's weights plus relative noise (same tokenizer), so it agrees with the target
    often but not always: drafts are partly accepted and every rank rolls back."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import load_model, save_config, save_model

    model, config = load_model(Path(src), strict=False)
    mx.random.seed(seed)
    noisy = [(k, v + scale * v.abs().mean() * mx.random.normal(v.shape) if mx.issubdtype(v.dtype, mx.floating) else v)
             for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(noisy))
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model)
    config = {k: v for k, v in config.items() if k != "quantization"}
    save_config(config, dst / "config.json")
    for f in Path(src).glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    return dst
