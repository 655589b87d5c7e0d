"""What produced a prefix cache's entries, as one hex string: the disk tier's entries of one fingerprint are
never read under another (target_model/disk_tier.py).

It covers the weights themselves, not the model's name (an updated checkpoint under the same name must never
read old entries): every parameter's name, shape and dtype, and `SAMPLES` of its values taken at even
strides across the whole tensor (a fine-tune, a merged adapter, a re-quantization changes them; hashing
every byte of a 30 GB model at each start would cost minutes). Then the cache's own form: the dtype its
entries take, KV bits and group size; the drafter whose state rides in the entries (its kind and its own
weights' digest); the disk format and its block size.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import host

SAMPLES = 64  # values read per tensor


def weights_digest(module) -> str:
    """A digest of a module's parameters (names, shapes, dtypes, sampled values)."""
    h = hashlib.sha256()
    params = sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0])
    picks = []
    for name, a in params:
        h.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
        flat = a.reshape(-1)
        step = max(1, flat.size // SAMPLES)
        picks.append(flat[::step][:SAMPLES].astype(mx.float32))
    for raw in host.read_bytes(*picks) if picks else []:
        h.update(raw)
    return h.hexdigest()


def fingerprint(model, dtype, kv_bits: int | None, kv_group_size: int, drafter: str | None = None,
                drafter_modules: tuple = (), extra: str = "") -> str:
    """The fingerprint of a target, the drafter whose state the entries carry (its kind and modules: a head,
    a draft model) and the cache's form."""
    h = hashlib.sha256()
    h.update(weights_digest(model).encode())
    h.update(f"|{dtype}|{kv_bits}|{kv_group_size}|{extra}|drafter {drafter}".encode())
    for m in drafter_modules:
        h.update(weights_digest(m).encode())
    return h.hexdigest()[:24]
