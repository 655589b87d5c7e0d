"""SpecStats of a sharded run: plus the collectives this rank issued, by kind, and per generated token."""

from dataclasses import asdict, dataclass, field

from ..core.stats import SpecStats


@dataclass
class DistributedStats(SpecStats):
    ranks: int = 1
    collectives: dict = field(default_factory=dict)  # "model" (the model's own), "decision", "token", "first", ...

    @property
    def collectives_per_token(self) -> float:
        """Collectives per generated token after the first (the model's and the engine's)."""
        return sum(self.collectives.values()) / (self.generated - 1) if self.generated > 1 else 0.0

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["collectives_per_token"] = self.collectives_per_token
        return d


def with_collectives(stats: SpecStats, ranks: int, collectives: dict) -> DistributedStats:
    return DistributedStats(**asdict(stats), ranks=ranks, collectives=dict(collectives))
