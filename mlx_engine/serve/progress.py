"""Prompts being prefilled: each one's progress for /health and /metrics, and a log line every few seconds
for a long one (request id, tokens done / total, tok/s), so a server busy with a long prompt says so.
Updated by the engine thread; read by the event loop through `snapshot`, a list replaced whole on each
update (never mutated in place), so a reader never sees a half-made list."""

from __future__ import annotations

import sys
import time


class PrefillProgress:
    def __init__(self, every: float = 5.0, out=None):
        self.every = every  # seconds between log lines of one prompt (its first after `every` seconds)
        self.out = out
        self._entries: dict = {}  # id -> {"done", "total", "stage", "start", "logged", "first"}
        self.snapshot: list[dict] = []  # [{"id", "done", "total"(, "stage")}] for /health

    def update(self, seq_id, done: int, total: int, stage: str | None = None) -> None:
        """Prompt tokens `done` of `total` (stage: the batch engine's "target" / "drafter", where it says)."""
        now = time.perf_counter()
        e = self._entries.setdefault(seq_id, {"start": now, "logged": now, "first": done})
        e["done"], e["total"], e["stage"] = done, total, stage
        if now - e["logged"] >= self.every and done < total:
            e["logged"] = now
            rate = (done - e["first"]) / (now - e["start"])
            print(f"prefill: request {seq_id}: {done}/{total} tokens, {rate:.0f} tok/s", file=self.out or sys.stderr,
                  flush=True)
        self._publish()

    def finish(self, seq_id) -> None:
        if self._entries.pop(seq_id, None) is not None:
            self._publish()

    def replace(self, current: list[dict]) -> None:
        """The engine's own list ({"id", "done", "total"(, "stage")} each, e.g. BatchEngine.prefilling()): the
        ones gone are finished, the others updated."""
        ids = {p["id"] for p in current}
        for gone in [i for i in self._entries if i not in ids]:
            del self._entries[gone]
        for p in current:
            self.update(p["id"], p["done"], p["total"], p.get("stage"))
        self._publish()

    def pending_tokens(self) -> int:
        return sum(p["total"] - p["done"] for p in self.snapshot)

    def _publish(self) -> None:
        self.snapshot = [{"id": i, "done": e["done"], "total": e["total"], **({"stage": e["stage"]} if e["stage"] else {})}
                         for i, e in self._entries.items()]
