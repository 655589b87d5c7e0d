"""The process group of a sharded run: who this process is, how long one wait may last, quiet followers.

`mlx.launch -n N -- python -m mlx_engine ...` starts N processes with the ring backend's hostfile and
MLX_RANK in their environment; `init()` joins them. Without a launcher it gives a group of one process
(everything then runs as on one machine, through the same code). Rank 0 is the leader: it prints, serves
and decides; the other ranks (followers) compute their shard of every pass and print nothing.
"""

from __future__ import annotations

import math
import os
import sys

import mlx.core as mx

from . import peers

MODES = ("pipeline", "tensor")
TIMEOUT_ENV = "MLX_ENGINE_DIST_TIMEOUT"  # seconds one wait for the other ranks may last before the run stops
DEFAULT_TIMEOUT = 120.0
BACKEND_ENV = "MLX_ENGINE_DIST_BACKEND"  # MLX's backend name: any (default), ring, jaccl, mpi
EXIT_FAULT = 3  # exit status of a run ended by a hung rank, or of a server by a dead one
EXIT_ERROR = 2  # a one-shot run ended by a dead rank: the status of a command's one-line error


class DistributedError(ValueError):
    """A sharded run that cannot start or go on (reported by the commands as one `error:` line)."""


def init() -> mx.distributed.Group:
    """The group this process belongs to (a group of one without a launcher)."""
    backend = os.environ.get(BACKEND_ENV, "any")
    try:
        with peers.capture(backend):  # the sockets the guard watches for a rank that died (peers.py)
            return mx.distributed.init(strict=False, backend=backend)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(f"cannot join the other processes ({BACKEND_ENV}={backend}): {e}") from None


def timeout_seconds() -> float:
    """The longest a rank waits for the others at one point (MLX_ENGINE_DIST_TIMEOUT, default 120 s)."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


class _FollowerStderr:
    """A follower's stderr: its error and warning lines and tracebacks, prefixed with its rank; the rest
    (progress bars, the stats line) is rank 0's to print."""

    def __init__(self, rank: int, stream):
        self.prefix, self.stream, self.passing, self.pending = f"[rank {rank}] ", stream, False, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.passing = self.passing or line.startswith("Traceback")
            if self.passing or line.startswith(("error:", "warning:")):
                self.stream.write(self.prefix + line + "\n")
        self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def quiet_followers(group: mx.distributed.Group) -> None:
    """Followers print nothing on stdout (the launcher merges every rank's output; the answer is rank 0's)
    and only errors on stderr, prefixed with their rank."""
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _FollowerStderr(group.rank(), sys.__stderr__)


def describe(group: mx.distributed.Group) -> str:
    return f"rank {group.rank()} of {group.size()}"
