"""What rank 0 tells the others, and the one primitive it travels by.

`share(group, value, width)`: rank 0's int32 vector on every rank, as ONE all_sum in which the other
ranks add zeros (a broadcast the ring backend does in one collective; exact for integers). A follower's
zeros may depend on arrays of its own (`after`): evaluating the share then evaluates its pass first, so
every rank issues the same collectives in the same order.

The control packet (rank 0 -> followers, once per cycle, built on rank 0's host after its one read):
    [verdict_n, verdict_len, action, arg, replay, 0, t_0 .. t_KMAX, d_1 .. d_KMAX]
verdict_n = -1 when it carries no verdict; the action says what every rank does next: END the
generation, a CYCLE verifying `arg` drafts (the d_i, rank 0's, drawn on device: the packet is lazy), a
CYCLE whose drafts come in a second packet (DRAFTS: the kept tokens are replayed first, core/engine.py's
_feed_replay, which issues the model's collectives before rank 0 drafts), or PLAIN decoding of `arg`
tokens. `replay` is how many kept tokens rank 0 replays after that verdict: every rank must find the same.

The plain-token packet (one per plainly decoded token, lazy, on device):
    [token, promise, closing, 0]
promise: rank 0 will build the step after the next one (followers pipeline one step ahead, as rank 0
does, so they learn two steps ahead whether a step will be built); closing: rank 0 ends the generation
after the steps promised so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import mlx.core as mx

KMAX = 64  # the longest draft a cycle carries
HEADER = 6
CONTROL_WIDTH = HEADER + (KMAX + 1) + KMAX
TOKEN_WIDTH = 4

END, CYCLE, DRAFTS_NEXT, DRAFTS, PLAIN = 0, 1, 2, 3, 4
ACTIONS = {END: "end", CYCLE: "cycle", DRAFTS_NEXT: "cycle (drafts next)", DRAFTS: "drafts", PLAIN: "plain"}


def share(group: mx.distributed.Group, value: mx.array | None, width: int, after=()) -> mx.array:
    """rank 0's `value` ([width] int32) on every rank; the others pass None (they add zeros, made to depend
    on `after`, their own arrays that must be evaluated first)."""
    if group.rank() == 0:
        x = value.astype(mx.int32)
    else:
        x = mx.zeros((width,), dtype=mx.int32)
    if after:
        x = mx.depends(x, list(after))
    return mx.distributed.all_sum(x, group=group)


@dataclass
class Control:
    action: int
    arg: int = 0  # drafts of a CYCLE / DRAFTS, tokens of a PLAIN stretch
    verdict: tuple[int, list[int]] | None = None  # (n_accepted, emitted tokens) of the cycle just verified
    replay: int = 0
    drafts: list[int] = field(default_factory=list)  # followers: the drafts it carried

    def header(self) -> list[int]:
        n, tokens = self.verdict if self.verdict is not None else (-1, [])
        if len(tokens) > KMAX + 1:
            raise ValueError(f"a verdict of {len(tokens)} tokens does not fit a packet ({KMAX + 1} at most)")
        return [n, len(tokens), self.action, self.arg, self.replay, 0] + tokens + [0] * (KMAX + 1 - len(tokens))


def control(c: Control, drafts: mx.array | None = None) -> mx.array:
    """The packet on device: the host header, then rank 0's drafts (lazy), padded to the packet's width."""
    head = mx.array(c.header(), dtype=mx.int32)
    k = 0 if drafts is None else drafts.shape[0]
    if k > KMAX:
        raise ValueError(f"a draft of {k} tokens does not fit a packet ({KMAX} at most)")
    parts = [head] + ([drafts.astype(mx.int32)] if k else []) + [mx.zeros((KMAX - k,), dtype=mx.int32)]
    return mx.concatenate(parts)


def read_control(values: list[int]) -> Control:
    n, length, action, arg, replay = values[:5]
    tokens = values[HEADER : HEADER + length]
    drafts = values[HEADER + KMAX + 1 : HEADER + KMAX + 1 + arg] if action in (CYCLE, DRAFTS) else []
    if action not in ACTIONS:
        raise ValueError(f"a control packet with an unknown action {action}")
    return Control(action, arg, None if n < 0 else (n, tokens), replay, drafts)


def job_bytes(prompt: list[int], cfg) -> bytes:
    """A generation the server's rank 0 starts, for the followers to run with it (GenerationConfig's
    fields that decide what is computed; callbacks become flags)."""
    s = cfg.sampling
    return json.dumps({
        "prompt": prompt, "max_tokens": cfg.max_tokens, "num_draft": cfg.num_draft, "seed": cfg.seed,
        "stop_tokens": sorted(cfg.stop_tokens), "prefill_step": cfg.prefill_step, "reuse_cache": cfg.reuse_cache,
        "should_stop": cfg.should_stop is not None,
        "sampling": {k: getattr(s, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                 "repetition_context")},
    }).encode()


def job_from_bytes(data: bytes):
    """-> (prompt, GenerationConfig, whether rank 0 asks should_stop between prefill chunks)."""
    from ..core.engine import GenerationConfig
    from ..sampling import SamplingConfig

    d = json.loads(data.decode())
    cfg = GenerationConfig(max_tokens=d["max_tokens"], num_draft=d["num_draft"], seed=d["seed"],
                           stop_tokens=frozenset(d["stop_tokens"]), prefill_step=d["prefill_step"],
                           reuse_cache=d["reuse_cache"], sampling=SamplingConfig(**d["sampling"]))
    return d["prompt"], cfg, d["should_stop"]


class Ended(Exception):
    """A follower's generation ends here: rank 0 said so (its consumer left before the natural end)."""
