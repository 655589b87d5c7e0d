"""The server across processes: rank 0 serves HTTP and announces each generation; the others follow.

Rank 0's engine sends every generation it starts as a job (two collectives: its length, then the bytes of
packets.job_bytes: prompt and the settings that decide what is computed); a follower runs `follow()`:
wait for a job (with no time limit: a server may idle for days), run that generation in step with rank 0,
wait again. A job of length 0 means rank 0 is shutting down; a lost connection while idle means rank 0
is gone, and the follower stops quietly.
"""

from __future__ import annotations

import atexit
import sys

import mlx.core as mx

from .. import host
from .packets import job_bytes, job_from_bytes, share


def _share_bytes(engine, data: bytes | None) -> bytes:
    """rank 0's bytes on every rank: the length, then the bytes (int32 each), two collectives."""
    group = engine.group
    with engine.collective("job"):
        n = host.read(share(group, mx.array([len(data)]) if data is not None else None, 1))[0]
        if n == 0:
            return b""
        value = mx.array(list(data), dtype=mx.int32) if data is not None else None
        return bytes(host.read(share(group, value, n)))


def send_job(engine, prompt: list[int], cfg) -> None:
    _share_bytes(engine, job_bytes(prompt, cfg))
    if not getattr(engine, "_quit_registered", False):
        engine._quit_registered = True
        atexit.register(send_quit, engine)


def send_quit(engine) -> None:
    """Rank 0 at exit: a job of length 0 (skipped if a generation is still running on its thread)."""
    if engine.guard._armed:
        return
    try:
        _share_bytes(engine, b"")
    except RuntimeError:
        pass


def follow(engine) -> int:
    """A follower's server loop: run rank 0's generations until it shuts down. -> exit status."""
    while True:
        try:
            data = _share_bytes(engine, None)
        except RuntimeError as e:  # rank 0 exited without a word (its process stopped): so do we
            print(f"rank {engine.rank}: rank 0 is gone ({e}); stopping", file=sys.__stderr__, flush=True)
            return 0
        if not data:
            return 0
        prompt, cfg, asks_stop = job_from_bytes(data)
        if asks_stop:
            cfg.should_stop = lambda: False  # rank 0's answer is what counts (shared per chunk)
        for _ in engine.generate(prompt, cfg):
            pass
