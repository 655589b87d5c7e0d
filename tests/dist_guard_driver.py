"""One rank of the guard's dead-peer test: `python tests/dist_guard_driver.py TIMEOUT` on two ranks.

Rank 1 dies after one collective. Rank 0, armed, then queues several collectives and reads the last: MLX's
ring fails the ones pending when it notices the closed socket and never runs the ones queued after
(distributed/peers.py), so without the guard's own look at the sockets rank 0 would wait for the timeout.
If MLX raises instead, rank 0 reports it as the engine does. Either way: one `error:` line, exit 2.
"""

import os
import signal
import sys
import time

import mlx_engine  # noqa: F401  (OpenBLAS first)
import mlx.core as mx

from mlx_engine.distributed import init
from mlx_engine.distributed.guard import Guard
from mlx_engine.distributed.peers import joined

QUEUED = 8  # collectives rank 0 queues after rank 1 died (4 were enough to hang MLX 0.32.4 here)


def main() -> int:
    group = init()
    guard = Guard(group.rank(), group.size(), float(sys.argv[1]), joined())
    x = mx.ones((4,))
    mx.eval(mx.distributed.all_sum(x, group=group))
    print(f"watching {len(joined().fds)} sockets", flush=True)
    if group.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # rank 1 is gone before rank 0 queues anything
    guard.arm()
    guard.beat("summing the queued collectives")
    for _ in range(QUEUED):
        x = mx.distributed.all_sum(x, group=group) * 0.5
    try:
        mx.eval(x)
    except RuntimeError as e:
        print(f"error: {guard.lost(e)}", file=sys.stderr, flush=True)
        return 2
    print("read the sum: rank 1 was not gone", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
