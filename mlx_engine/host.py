"""The only places the engine and its drafters wait for the device or read values on the host.

Counting them here is how tests check the loop's promise: one host synchronisation per cycle.
"""

import mlx.core as mx

counts = {"read": 0, "wait": 0}


def read(x: mx.array) -> list:
    """Evaluate `x` and bring it to the host (a host synchronisation)."""
    counts["read"] += 1
    return x.tolist()


def read_all(*arrays: mx.array) -> list[list]:
    """Evaluate several arrays together and bring each to the host: ONE host synchronisation (a cycle's
    verdict and the logprobs of its tokens, whose dtypes differ)."""
    counts["read"] += 1
    mx.eval(*arrays)
    return [a.tolist() for a in arrays]


def wait(*arrays) -> None:
    """Evaluate arrays and block until done (prefill chunks, profiling boundaries)."""
    counts["wait"] += 1
    mx.eval(*arrays)


def read_bytes(*arrays: mx.array) -> list[bytes]:
    """Evaluate arrays together and bring each one's raw bytes to the host: one synchronisation (weights'
    samples for a fingerprint, cache pieces for the disk tier)."""
    counts["read"] += 1
    mx.eval(*arrays)
    return [bytes(memoryview(a)) for a in arrays]


def start(*arrays) -> None:
    """Start evaluating arrays in the background (not a synchronisation)."""
    mx.async_eval(*arrays)


def total() -> int:
    return counts["read"] + counts["wait"]
