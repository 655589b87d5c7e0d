"""The batch engine's per-sequence records: a running sequence's state and figures, and a step's output."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..sampling import SamplingConfig


@dataclass
class Output:
    """What a step produced for one sequence: new token ids, and when it ended, why and its figures."""

    seq_id: object
    tokens: list[int]
    finished: str | None = None  # "stop" (a stop token) | "length" (max_tokens) | "cancelled"
    stats: dict | None = None


@dataclass
class RunningSequence:
    """A sequence in the running batch: its request, its drafter, where it stands, its figures."""

    id: object
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop_tokens: frozenset[int]
    key: mx.array
    drafter: object
    history: list[int]
    last: int
    reused: int = 0
    max_draft: int | None = None  # the request's own ceiling on its draft length (None: the policy's)
    evidence: object = None  # the batch policy's per-row state (its own acceptance)
    generated: int = 1
    drafted: int = 0
    accepted: int = 0
    verifies: int = 0  # steps that drafted (plain steps are not verify passes)
    verified_tokens: int = 0  # tokens those steps emitted
    prompt_time: float = 0.0
    t_decode: float = field(default_factory=time.perf_counter)
    decode_time: float = 0.0
    cancelled: bool = False

    def next_key(self) -> mx.array:
        self.key, k = mx.random.split(self.key)
        return k

    def stats(self, num_draft) -> dict:
        d, a, v, g = self.drafted, self.accepted, self.verifies, self.generated
        return {
            "num_draft": num_draft, "drafted": d, "accepted": a, "acceptance": a / d if d else 0.0,
            "verify_passes": v, "tokens_per_verify": self.verified_tokens / v if v else 0.0,
            "decode_tokens_per_second": (g - 1) / self.decode_time if self.decode_time > 0 else 0.0,
            "prompt_tokens": len(self.prompt), "completion_tokens": g, "reused_prompt_tokens": self.reused,
            "prompt_seconds": self.prompt_time, "decode_seconds": self.decode_time,
            # the names of core/stats.py's SpecStats, for callers that read those
            "cycles": v, "generated": g, "decode_time": self.decode_time,
        }
