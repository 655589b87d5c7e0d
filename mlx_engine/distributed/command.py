"""What the commands (generate, serve) need for `--distributed pipeline|tensor`: this rank's shard, its
engine class, quiet followers."""

from __future__ import annotations

import sys
from functools import partial

from .engine import DistributedEngine
from .group import DistributedError, init, quiet_followers
from .loading import ShardedModel, load_sharded


def leads() -> bool:
    """This process is rank 0 of its group (the one that prints and serves)."""
    return init().rank() == 0


def load_for_command(model: str | None, mode: str, serving: bool = False, batching: str = "fair") -> ShardedModel:
    """Join the processes mlx.launch started, load this rank's shard; followers then print only errors.
    The result's `engine_class` builds a DistributedEngine over the group (the commands' Engine otherwise).
    `serving`: rank 0 announces each request to the followers; one request at a time (continuous batching
    would need every rank to join and drop rows in step: not done)."""
    if serving and batching == "continuous":
        raise DistributedError("--batching continuous is not available with --distributed: requests are served "
                               "one at a time (--batching fair or auto)")
    group = init()
    if group.size() == 1:
        print("note: --distributed with one process: start it with mlx.launch -n N ... to shard the model "
              "across N processes", file=sys.stderr)
    loaded = load_sharded(model, mode, group)
    quiet_followers(group)
    loaded.engine_class = partial(DistributedEngine, group=group, serving=serving)
    if serving and group.rank() == 0:
        print(f"note: serving one request at a time across {group.size()} processes ({mode} sharding)",
              file=sys.stderr)
    return loaded
