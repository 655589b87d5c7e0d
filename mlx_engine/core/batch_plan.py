"""What one step of the batch engine does to each row, decided before its pass and read by every stage after
it (core/batch_engine.py's `step`): which rows decode and how many drafts each verifies, which row feeds a
prompt chunk and how much of it, which rows only wait. A row is exactly one of

    idle      it runs no real token this pass (its drafter is still being fed, or its prompt waits a turn):
              its pass row is a placeholder, every entry it writes is dropped again;
    feeding   its prompt is being fed: `fed[i]` tokens this pass (0: it waits), across the layers of
              `spans[i]` when its chunk crosses only some of them;
    decoding  it verifies [last, d_1..d_ki] (ki = ks[i]; ki = 0: one plain token).

`kept(i, layer, n)` is the rollback rule of the whole step in one place: how many of the pass's `width`
positions row i keeps in that layer (n: a decoding row's accepted drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    feeding: list  # per row: its Prefilling while its prompt is fed, else None
    idle: list[bool]  # per row: runs no real token
    decoding: list[int]  # rows that verify their drafts (or decode one token)
    ks: list[int]  # per row: drafts it verifies (after the grammar's cuts)
    asked: list[int]  # per row: drafts asked for before the grammar's cuts (what the policy learns from)
    k: int = 0  # drafts the model drafters draft this step (the longest row's)
    forced: dict = field(default_factory=dict)  # rows whose grammar drafts its forced run
    constrained: bool = False  # a decoding row has a grammar
    drafts: dict = field(default_factory=dict)  # row -> Draft, padded to width - 1
    on_host: dict = field(default_factory=dict)  # grammar: each constrained row's host-side draft tokens
    chunk: int = 0  # prompt tokens the turn's row may feed
    depth: int = 0  # that row's prompt positions already fed (what sized the chunk)
    fed: list[int] = field(default_factory=list)  # per row: prompt tokens fed in this pass
    spans: dict = field(default_factory=dict)  # row -> layer_span.Span: a chunk crossing only some layers
    width: int = 0  # tokens per row in the pass
    firsts: list[int] = field(default_factory=list)  # rows whose first token this pass's logits give

    @property
    def widest(self) -> int:
        """The longest draft the pass verifies."""
        return max(self.ks, default=0)

    def real(self, i: int) -> int:
        """Row i's real tokens in the pass (the rest of its width is padding)."""
        if self.idle[i]:
            return 0
        if self.feeding[i] is not None:
            return self.fed[i]
        return self.ks[i] + 1

    def kept(self, i: int, layer: int, n: int | None) -> int:
        """Positions of the pass row i keeps in `layer`: none for an idle row, its chunk for a feeding one
        (none in a layer outside its span: what it wrote there is garbage), [last, d_1..d_n] for a decoding
        row that accepted n drafts."""
        if self.idle[i]:
            return 0
        if self.feeding[i] is not None:
            span = self.spans.get(i)
            return self.fed[i] if span is None or span.start <= layer < span.end else 0
        return n + 1
