"""Speculative decoding over a target sharded across processes (mx.distributed; issue 29).

    mlx.launch -n 2 -- python -m mlx_engine generate --distributed pipeline --model M --drafter mtp ...

    from mlx_engine.distributed import init, load_sharded, DistributedEngine
    group = init()                                      # under mlx.launch: this process's rank
    m = load_sharded("path/or/repo", "pipeline", group)  # this rank's shard only (mlx-lm's sharded_load)
    drafter = NgramDrafter() if group.rank() == 0 else None
    engine = DistributedEngine(m.model, drafter, group=group)   # every rank, same arguments
    for step in engine.generate(prompt, cfg): ...      # every rank iterates; rank 0's steps are the answer

loading.py: sharded loading, and which drafters run where; engine.py: the cycle with rank 0's decisions
shared; packets.py: what rank 0 sends; plain.py: plain stretches; rollback.py: the ranks' rollback paths;
follow.py: the server's followers; guard.py: dead and hung ranks; counting.py: collectives by kind.
"""

from .engine import DistributedEngine
from .group import DistributedError, MODES, init, quiet_followers
from .loading import ShardedModel, drafter_refusal, load_sharded

__all__ = ["DistributedEngine", "DistributedError", "MODES", "ShardedModel", "drafter_refusal", "init",
           "load_sharded", "quiet_followers"]
