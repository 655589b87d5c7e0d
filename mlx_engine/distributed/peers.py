"""The sockets that join this rank to the others, and whether a peer has closed its end.

Why the guard watches them itself: MLX's ring backend (mlx/distributed/ring/ring.cpp) gives each socket
a worker thread that, after ten failed sends or receives, fails the tasks pending at that moment with
"[ring] connection to a peer was lost" and then returns. A collective queued after that (plain decoding
keeps the next step's collectives queued behind the current one) waits for a worker that is gone: no
exception ever reaches Python, and the rank would sit there until the watchdog's timeout. A dead peer's
sockets are closed by its kernel, which a peek (MSG_PEEK, never consuming a byte the worker should read)
sees at once.

`capture(backend)` runs around the backend's init: the connected stream sockets that appeared are the
ones joining the ranks, for the ring backend only, which keeps its sockets for the whole run (another
backend's sockets may be set-up channels a peer closes once it is done: a closed one would say nothing).
With another backend, or a group made elsewhere (mx.distributed.init called directly), none are known and
only the timeout applies.
"""

from __future__ import annotations

import os
import socket
import stat
from contextlib import contextmanager

_FD_DIR = "/dev/fd"  # Linux and macOS


def _open_sockets() -> dict[int, int]:
    """This process's socket descriptors -> their inode (a descriptor number can be reused)."""
    found = {}
    for name in os.listdir(_FD_DIR):
        try:
            fd = int(name)
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            found[fd] = st.st_ino
    return found


def _peer_of(fd: int) -> socket.socket:
    """A socket object on a duplicate of `fd`: the caller closes it, `fd` stays open and untouched (with no
    default timeout set, Python leaves the shared blocking mode alone; MSG_DONTWAIT does the rest)."""
    return socket.socket(fileno=os.dup(fd))


def _connected_stream(fd: int) -> bool:
    try:
        with _peer_of(fd) as s:
            s.getpeername()
            return s.type == socket.SOCK_STREAM
    except OSError:
        return False


def peer_closed(fd: int) -> bool:
    """Whether the other end of stream socket `fd` is gone (end of stream, reset or broken), without
    consuming anything."""
    try:
        with _peer_of(fd) as s:
            return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # nothing to read yet: the peer is there
        return False
    except OSError:  # reset, broken pipe, not connected any more
        return True


class PeerSockets:
    """The sockets joining this rank to the others (empty: unknown)."""

    def __init__(self, fds: dict[int, int] | None = None):
        self.fds = dict(fds or {})

    def closed(self) -> list[int]:
        """The watched descriptors whose peer has gone (a descriptor now naming another file is skipped)."""
        gone = []
        for fd, inode in self.fds.items():
            try:
                st = os.fstat(fd)
                same = stat.S_ISSOCK(st.st_mode) and st.st_ino == inode
            except OSError:
                same = False
            if same and peer_closed(fd):
                gone.append(fd)
        return gone


_joined = PeerSockets()


def is_ring(backend: str) -> bool:
    """Whether mx.distributed.init(backend=backend) joins through the ring: asked for by name, or "any"
    where MLX tries it first (no CUDA, whose NCCL comes first) and its hostfile is there."""
    if backend == "ring":
        return True
    if backend != "any" or not os.environ.get("MLX_HOSTFILE"):
        return False
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)  # every build has it since MLX 0.26 (False on a Mac)
    return not (cuda is not None and cuda.is_available())


@contextmanager
def capture(backend: str = "ring"):
    """Around a backend's init: remember the connected stream sockets the ring opened (a repeated init,
    which returns the same group, opens none and forgets none; another backend: nothing)."""
    global _joined
    if not is_ring(backend):
        yield
        return
    before = _open_sockets()
    yield
    opened = {fd: ino for fd, ino in _open_sockets().items() if before.get(fd) != ino and _connected_stream(fd)}
    _joined = PeerSockets({**_joined.fds, **opened})


def joined() -> PeerSockets:
    """The sockets the last `capture()` found (none before one ran)."""
    return _joined
