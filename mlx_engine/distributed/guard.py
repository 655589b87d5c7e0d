"""Faults: a rank that dies or hangs ends the run with a clear error, within a bounded time, never a hang.

A rank that dies closes its sockets. The others' next collective usually fails at once ("[ring] connection
to a peer was lost"), which `lost()` turns into a one-line error naming what the rank was doing. But MLX's
ring fails only the collectives pending when it notices; one queued after that waits forever (peers.py
says why), so a watchdog thread also watches the sockets joining the ranks: a rank that made no progress
for `grace` seconds while a peer's socket is closed prints the same error and ends the process (exit
status `exit_lost`: 2, as a command's error, or 3 for a server). A rank that hangs (stopped, swapped to
death, or MLX's ring all_sum deadlock on CPU streams, mlx issue 4475) leaves the others blocked inside a
collective, in C++, where no Python exception reaches them. The same thread ends that: while a generation
runs, every cycle, plain token and prefill chunk beats it; when no beat came for `timeout` seconds it
prints what the rank was waiting for and ends the process (exit status 3: a blocked collective cannot be
cancelled, and the launcher then stops the other ranks).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .group import EXIT_ERROR, EXIT_FAULT, TIMEOUT_ENV, DistributedError
from .peers import PeerSockets

HANG_HINT = "MLX's ring all_sum can deadlock on CPU streams (mlx issue 4475)"


class Guard:
    def __init__(self, rank: int, size: int, timeout: float, peers: PeerSockets | None = None,
                 exit_lost: int = EXIT_ERROR):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.peers, self.exit_lost = peers or PeerSockets(), exit_lost
        self.grace = min(1.0, timeout / 2)  # no progress for this long: look at the peers' sockets
        self.what = "starting"
        self._last = time.monotonic()
        self._armed = 0  # generations in progress (nested calls keep it armed)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.fired = False

    def _others(self) -> str:
        return "the other ranks" if self.rank == 0 else "rank 0 and the other ranks"

    def beat(self, what: str) -> None:
        """Progress: the rank is now `what` (e.g. 'waiting for the decision of cycle 12')."""
        with self._lock:
            self.what, self._last = what, time.monotonic()

    def arm(self) -> None:
        with self._lock:
            self._armed += 1
            self._last = time.monotonic()
        if self.size > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mlx-engine-dist-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._armed = max(0, self._armed - 1)

    def message(self, waited: float) -> str:
        return (f"error: rank {self.rank} of {self.size}: no progress for {waited:.0f} s while {self.what}: "
                f"{self._others()} did not answer (a rank died or hung; {HANG_HINT}); stopping this run "
                f"({TIMEOUT_ENV}={self.timeout:g})")

    def _watch(self) -> None:
        step = min(0.25, self.timeout / 10)
        while True:
            time.sleep(step)
            with self._lock:
                waited = time.monotonic() - self._last
                stuck = self._armed > 0 and waited > self.grace
            gone = self.peers.closed() if stuck else []
            if gone:
                self._fire(f"error: {self.lost(ConnectionError(f'socket {gone[0]} was closed by its peer'))}",
                           self.exit_lost)
            if stuck and waited > self.timeout:
                self._fire(self.message(waited), EXIT_FAULT)

    def _fire(self, line: str, status: int) -> None:
        self.fired = True
        print(line, file=sys.__stderr__, flush=True)
        os._exit(status)

    def lost(self, error: BaseException) -> DistributedError:
        """The error a failed collective becomes: which rank, doing what, and why it failed."""
        return DistributedError(f"rank {self.rank} of {self.size} lost the connection to {self._others()} "
                                f"while {self.what} ({error}): a rank died or was stopped")
