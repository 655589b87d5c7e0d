"""SpecStats: monotonic counters of a generation and the rates derived from them."""

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose cache was kept from the previous generation
    generated: int = 0  # tokens emitted, the first (prefill) token included
    cycles: int = 0  # verify passes after the first token
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times a draft reached it
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times it was accepted
    prompt_time: float = 0.0  # s, prefill + first token
    decode_time: float = 0.0  # s, after the first token
    # Time split, measured on profiled cycles (GenerationConfig.profile_every) with a device
    # synchronisation at each phase boundary; host = Python time outside device waits on all cycles.
    profiled_cycles: int = 0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_sample: float = 0.0
    time_host: float = 0.0
    peak_memory: int = 0  # bytes, mx.get_peak_memory()
    cancelled: bool = False  # GenerationConfig.should_stop() ended the prefill
    # under a grammar: tokens it drafted (forced text) and of those accepted, kept apart from the drafter's
    # own; drafted tokens it cut before the verify pass (not counted in `drafted`)
    forced: int = 0
    forced_accepted: int = 0
    cut: int = 0
    unsure: int = 0  # drafted tokens not verified for the drafter's low confidence (core/confidence.py)
    grammar_seconds: float = 0.0  # host time the grammar took (masks, cuts, forced runs)

    def record_cycle(self, n_drafted: int, n_accepted: int, n_emitted: int, forced: bool = False) -> None:
        self.cycles += 1
        if forced:  # a grammar cycle: its own counters
            self.forced += n_drafted
            self.forced_accepted += n_accepted
            self.generated += n_emitted
            return
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.generated += n_emitted
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify pass, the bonus/corrected token included (1.0 = plain decoding)."""
        return (self.generated - 1) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def decode_tps(self) -> float:
        return (self.generated - 1) / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        prefilled = self.prompt_tokens - self.reused_tokens
        return prefilled / self.prompt_time if self.prompt_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "acceptance_per_position", "decode_tps", "prompt_tps"):
            d[name] = getattr(self, name)
        return d
