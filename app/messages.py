"""Messages the engine worker thread posts to the app (App.post_message is thread-safe)."""

from dataclasses import dataclass, field

from textual.message import Message


class ModelLoading(Message):
    def __init__(self, stage: str, step: int, total: int) -> None:
        super().__init__()
        self.stage, self.step, self.total = stage, step, total


class ModelLoaded(Message):
    def __init__(self, name: str, drafter: str, info: str, warning: str | None = None) -> None:
        super().__init__()
        self.name, self.drafter, self.info, self.warning = name, drafter, info, warning


class ModelLoadFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


@dataclass
class TurnTiming:
    """Decode cycles of one turn split by mode, for the speedup over plain decoding."""

    plain_tokens: int = 0
    plain_time: float = 0.0
    spec_tokens: int = 0
    spec_time: float = 0.0

    def add(self, other: "TurnTiming") -> None:
        self.plain_tokens += other.plain_tokens
        self.plain_time += other.plain_time
        self.spec_tokens += other.spec_tokens
        self.spec_time += other.spec_time

    @property
    def plain_tps(self) -> float:
        return self.plain_tokens / self.plain_time if self.plain_time > 0 else 0.0

    @property
    def spec_tps(self) -> float:
        return self.spec_tokens / self.spec_time if self.spec_time > 0 else 0.0

    @property
    def speedup(self) -> float | None:
        if self.plain_tps > 0 and self.spec_tps > 0:
            return self.spec_tps / self.plain_tps
        return None


@dataclass
class Snapshot:
    """What the stats panel shows: a copy of the engine's SpecStats plus the worker's own numbers."""

    stats: dict = field(default_factory=dict)  # SpecStats.to_dict()
    k: int = 0  # draft length in force now (0 = speculation off)
    last_draft: int = 0  # tokens actually drafted in the latest cycle
    interval_tps: float = 0.0  # decode tok/s since the previous snapshot (the sparkline)
    timing: TurnTiming = field(default_factory=TurnTiming)
    reprefill: int = 0  # prompt tokens prefilled this turn (the rest of the conversation came from the cache)


class GenerationStarted(Message):
    """key: what the turn answers (app/speedup.py prompt_key), so turns of the same prompt can be compared."""

    def __init__(self, turn: int, prompt_tokens: int, key: str = "") -> None:
        super().__init__()
        self.turn, self.prompt_tokens, self.key = turn, prompt_tokens, key


class PrefillProgress(Message):
    """A long prompt being read: `done` of `total` prompt tokens prefilled (posted chunk by chunk)."""

    def __init__(self, turn: int, done: int, total: int) -> None:
        super().__init__()
        self.turn, self.done, self.total = turn, done, total


class GenerationProgress(Message):
    """Coalesced: new text pieces since the last message, [(text, from_accepted_draft)], and a snapshot."""

    def __init__(self, turn: int, pieces: list[tuple[str, bool]], snapshot: Snapshot) -> None:
        super().__init__()
        self.turn, self.pieces, self.snapshot = turn, pieces, snapshot


class GenerationFinished(Message):
    """reason: "eos", "max_tokens", "stopped", "error", or "context" (the prompt did not fit the model's
    context window: nothing was sent to the engine, `error` says by how much)."""

    def __init__(self, turn: int, text: str, reason: str, snapshot: Snapshot, error: str | None = None) -> None:
        super().__init__()
        self.turn, self.text, self.reason, self.snapshot, self.error = turn, text, reason, snapshot, error
