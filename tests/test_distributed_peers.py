"""peers.py: the sockets a backend's init opened, and a peek that sees a peer gone without taking a byte."""

import os
import socket
from pathlib import Path

import pytest

from mlx_engine.distributed import peers


@pytest.fixture
def connection():
    """A loopback TCP connection: (our end, the peer's end)."""
    server = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(server.getsockname())
    theirs, _ = server.accept()
    server.close()
    yield ours, theirs
    ours.close()
    theirs.close()


def test_an_open_peer_is_not_gone_and_its_bytes_stay_unread(connection):
    ours, theirs = connection
    assert not peers.peer_closed(ours.fileno())  # nothing sent yet
    theirs.sendall(b"xy")
    assert not peers.peer_closed(ours.fileno())
    assert ours.recv(2) == b"xy"  # the peek consumed nothing
    assert ours.gettimeout() is None  # and left our blocking mode alone


def test_a_closed_peer_is_gone_even_with_bytes_left_to_read(connection):
    ours, theirs = connection
    theirs.sendall(b"z")
    theirs.close()
    assert not peers.peer_closed(ours.fileno())  # its last byte first: the worker may still need it
    assert ours.recv(1) == b"z"
    assert peers.peer_closed(ours.fileno())


def test_capture_keeps_the_connected_sockets_opened_inside_and_forgets_none(connection, monkeypatch):
    monkeypatch.setattr(peers, "_joined", peers.PeerSockets())
    ours, _ = connection  # opened before: not the backend's
    with peers.capture():
        listener = socket.create_server(("127.0.0.1", 0))  # a listening socket has no peer
        inside = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    try:
        assert set(peers.joined().fds) == {inside.fileno(), accepted.fileno()}
        with peers.capture():  # a repeated init opens nothing
            pass
        assert set(peers.joined().fds) == {inside.fileno(), accepted.fileno()}
        assert peers.joined().closed() == []
        accepted.close()
        assert peers.joined().closed() == [inside.fileno()]
    finally:
        for s in (listener, inside, accepted):
            s.close()


def test_a_descriptor_that_now_names_another_file_is_not_watched(connection, tmp_path):
    ours, theirs = connection
    watched = peers.PeerSockets({ours.fileno(): os.fstat(ours.fileno()).st_ino})
    theirs.close()
    fd = ours.detach()
    file = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    os.dup2(file, fd)  # the socket's number now names a file
    try:
        assert watched.closed() == []
        os.close(fd)
        assert watched.closed() == []  # and now nothing
    finally:
        os.close(file)


@pytest.mark.parametrize("backend, hostfile, watched", [
    ("ring", None, True), ("any", "hosts.json", True), ("any", None, False), ("jaccl", "hosts.json", False),
    ("mpi", None, False)])
def test_only_the_rings_sockets_are_watched(backend, hostfile, watched, monkeypatch):
    """Another backend's sockets may be set-up channels its peer closes when done: never watched."""
    import mlx.core as mx

    monkeypatch.setattr(peers, "_joined", peers.PeerSockets())
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    if hostfile:
        monkeypatch.setenv("MLX_HOSTFILE", hostfile)
    else:
        monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    with peers.capture(backend):
        listener = socket.create_server(("127.0.0.1", 0))
        inside = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    try:
        assert bool(peers.joined().fds) == watched
    finally:
        for s in (listener, inside, accepted):
            s.close()


def test_any_backend_with_cuda_is_nccl_not_the_ring(monkeypatch):
    import mlx.core as mx

    monkeypatch.setenv("MLX_HOSTFILE", "hosts.json")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert not peers.is_ring("any") and peers.is_ring("ring")


GUARDED = """
import socket, sys, time
from mlx_engine.distributed.guard import Guard
from mlx_engine.distributed.peers import PeerSockets
import os
ours, theirs = socket.socketpair()
theirs.close()  # the peer is gone
guard = Guard(0, 2, timeout=30, peers=PeerSockets({ours.fileno(): os.fstat(ours.fileno()).st_ino}),
              exit_lost=int(sys.argv[1]))
guard.arm()
for i in range(int(sys.argv[2])):  # beats while making progress
    guard.beat(f"step {i}")
    time.sleep(0.1)
guard.disarm()
if sys.argv[3] == "stuck":
    guard.arm()
    guard.beat("waiting for the verify pass of cycle 7")
    time.sleep(10)
else:
    time.sleep(2)  # disarmed: between generations
print("ended by itself")
"""


def run_guarded(status: int, beats: int, then: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", GUARDED, str(status), str(beats), then], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])


def test_the_guard_ends_a_stuck_rank_whose_peer_closed_with_the_status_asked():
    done = run_guarded(3, 0, "stuck")  # a server's status
    assert done.returncode == 3, done.stderr
    assert "ended by itself" not in done.stdout
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 0 of 2 lost the connection to the other ranks while waiting for the "
                           "verify pass of cycle 7") and "closed by its peer" in line


def test_a_rank_that_makes_progress_or_is_idle_is_left_alone():
    done = run_guarded(2, 20, "idle")  # 2 s of beats every 0.1 s with the peer closed, then 2 s disarmed
    assert done.returncode == 0 and "ended by itself" in done.stdout, done.stderr
