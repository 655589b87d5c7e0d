"""The speedup over plain decoding, like with like: turns are grouped by what was asked (the prompt's
tokens and the temperature), and only a prompt answered both with speculation on and with it off counts.

Comparing every speculative turn with every plain one (as the panel once did) set answers of different
kinds against each other: a code edit that prompt lookup drafts well against a story it cannot, 4.92x
with no plain turn of the same question. Here a turn that switched mode midway (F2 during the answer)
counts for neither side; the answer again (ctrl+r) with F2 flipped makes a pair.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .messages import TurnTiming


def prompt_key(prompt: list[int], temperature: float) -> str:
    """What makes two turns comparable: the same tokens in, at the same temperature."""
    return hashlib.sha1(repr((prompt, round(temperature, 3))).encode()).hexdigest()[:16]


def mode_of(timing: TurnTiming) -> str | None:
    """"spec", "plain", or None for a turn that decoded both ways (or nothing)."""
    if timing.spec_tokens and not timing.plain_tokens:
        return "spec"
    if timing.plain_tokens and not timing.spec_tokens:
        return "plain"
    return None


@dataclass
class Speedup:
    """What the panel shows: a ratio over paired prompts, or why there is none."""

    ratio: float | None = None
    spec_tps: float = 0.0
    plain_tps: float = 0.0
    pairs: int = 0
    reason: str = ""


class SpeedupPairs:
    """Per prompt, the latest turn of each mode; the speedup over the prompts that have both."""

    def __init__(self) -> None:
        self.turns: dict[str, dict[str, TurnTiming]] = {}
        self.mixed = 0  # turns that decoded both ways: compared with nothing

    def record(self, key: str, timing: TurnTiming) -> None:
        mode = mode_of(timing)
        if mode is not None:
            self.turns.setdefault(key, {})[mode] = TurnTiming(**vars(timing))
        elif timing.spec_tokens or timing.plain_tokens:
            self.mixed += 1

    def summary(self) -> Speedup:
        paired = [t for t in self.turns.values() if "spec" in t and "plain" in t]
        if not paired:
            modes = {m for t in self.turns.values() for m in t}
            if modes == {"spec", "plain"}:
                reason = "no prompt answered both ways yet"
            elif modes:
                reason = "no plain (spec off) turn yet" if "plain" not in modes else "no speculative turn yet"
            elif self.mixed:
                reason = "a turn with F2 midway counts for neither"
            else:
                reason = "no answer measured yet"
            return Speedup(reason=reason)
        spec, plain = TurnTiming(), TurnTiming()
        for t in paired:
            spec.add(t["spec"])
            plain.add(t["plain"])
        ratio = spec.spec_tps / plain.plain_tps if plain.plain_tps > 0 else None
        return Speedup(ratio, spec.spec_tps, plain.plain_tps, len(paired))
