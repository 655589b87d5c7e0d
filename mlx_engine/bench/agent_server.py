"""`python -m mlx_engine.bench.longctx --agent-server`: a server as a coding agent and its neighbours load it.

An agent sends its whole session (bench/agent_session.py, ~8k tokens) every turn while other clients send
short chat requests ("hi", ~31 tokens, a few tokens answered) that arrive at random (Poisson, `rate` a
minute, seeded). Per drafter mode, one BatchEngine (what `serve` runs) with its prefix tree:

  idle       each short request's time to first token (TTFT) on the idle engine (the median of three);
  cold turn  the session fed cold: its TTFT, the time until its drafter drafts (its prefill with the
             drafter's share), and the TTFT of every short request that arrived meanwhile;
  next turn  the session + its answer + a follow-up, from the prefix tree: the same figures.

A short request's TTFT is counted from its arrival (the step running then included). Greedy; the steps
are the engine's own (one thread), so the figures are what a client of `serve` waits, less HTTP.
"""

from __future__ import annotations

import random
import statistics
import time

from ..core.batch_engine import BatchEngine
from ..drafters.registry import DrafterOptions, make_drafter


def _short(tokenizer, i: int) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": f"hi {i}"}], add_generation_prompt=True))


class _Clients:
    """The short requests: arrivals on a seeded Poisson clock, each TTFT recorded."""

    def __init__(self, engine, tokenizer, rate_per_min: float, max_tokens: int, seed: int):
        self.engine, self.tokenizer, self.max_tokens = engine, tokenizer, max_tokens
        self.rng = random.Random(seed)
        self.rate = rate_per_min / 60.0
        self.sent = 0
        self.next_at = None
        self.waiting: dict[str, float] = {}  # id -> arrival time, until its first token
        self.backlog: list[tuple[str, int]] = []  # arrived while the batch was full
        self.ttfts: list[float] = []
        self.spans: list[tuple[float, float]] = []  # each short request's (arrival, first token), as ttfts

    def start(self, now: float) -> None:
        self.next_at = now + self.rng.expovariate(self.rate) if self.rate > 0 else None
        self.ttfts, self.spans = [], []

    def arrive(self, now: float) -> None:
        """The requests that arrived by `now` join (past a full batch they wait, as in serve's queue)."""
        while self.next_at is not None and now >= self.next_at:
            self.sent += 1
            self.backlog.append((f"short{self.sent}", self.sent))
            self.waiting[f"short{self.sent}"] = self.next_at  # counted from when it arrived
            self.next_at += self.rng.expovariate(self.rate)
        while self.backlog and self.engine.free_slots() > 0:
            sid, i = self.backlog.pop(0)
            self.engine.add(sid, _short(self.tokenizer, i), self.max_tokens)

    def seen(self, seq_id, tokens: list[int], now: float) -> None:
        if seq_id in self.waiting and tokens:
            arrived = self.waiting.pop(seq_id)
            self.ttfts.append(now - arrived)
            self.spans.append((arrived, now))


def _slowest(spans, steps, n: int = 3) -> list[dict]:
    """Where the slowest short requests' waits went: the step in flight when each arrived (what was left
    of it) and every step until its first token, each with its rows and the tokens of prompts fed in it."""
    out = []
    for arrived, first in sorted(spans, key=lambda s: s[0] - s[1])[:n]:
        mine = [st for st in steps if st[1] > arrived and st[0] < first]
        out.append({"ttft_s": round(first - arrived, 3),
                    "in_flight_left_s": round(mine[0][1] - arrived, 3) if mine and mine[0][0] < arrived else 0.0,
                    "steps": [{"s": round(b - a, 3), "rows": rows, "fed": fed} for a, b, rows, fed in mine]})
    return out


def _turn(engine, clients, sid: str, prompt: list[int], max_tokens: int) -> dict:
    """One agent turn with the short clients arriving: its TTFT, its drafter's ready time, its answer."""
    t0 = time.perf_counter()
    engine.add(sid, prompt, max_tokens)
    clients.start(t0)
    first = ready = None
    answer = []
    steps = []  # (start, end, rows, {id: prompt tokens fed in the step}): where a slow short request waited

    def step():
        a = time.perf_counter()
        before = {p["id"]: (p["done"], p["total"]) for p in engine.prefilling()}
        outs = engine.step()
        after = {p["id"]: p["done"] for p in engine.prefilling()}
        # a prompt that left the list in this step was fed to its end in it; a new one's first count is what
        # its row took from the prefix tree or another row (the step that made the row)
        fed = {i: after.get(i, total) - done for i, (done, total) in before.items() if after.get(i, total) != done}
        fed |= {i: n for i, n in after.items() if i not in before}
        steps.append((a, time.perf_counter(), len(engine.seqs), fed))
        return outs

    while True:
        clients.arrive(time.perf_counter())
        outs = step()
        now = time.perf_counter()
        for o in outs:
            clients.seen(o.seq_id, o.tokens, now)
            if o.seq_id == sid:
                answer += o.tokens
                if o.tokens and first is None:
                    first = now - t0
        seq = next((s for s in engine.seqs if s.id == sid), None)
        if ready is None and first is not None and (seq is None or engine._ready_to_draft(seq) or
                                                    engine.drafter is None):
            ready = now - t0
        if seq is None and sid not in [p["id"] for p in engine.prefilling()]:
            break
    clients.next_at = None
    while clients.waiting:  # the short requests still in flight get their first token
        clients.arrive(time.perf_counter())
        outs = step()
        now = time.perf_counter()
        for o in outs:
            clients.seen(o.seq_id, o.tokens, now)
    while engine.running():
        engine.step()
    t = clients.ttfts
    return {"prompt_tokens": len(prompt), "ttft_s": round(first, 2), "drafter_ready_s": round(ready, 2),
            "shorts": len(t), "short_ttft_s": [round(x, 3) for x in t],
            "short_ttft_median_s": round(statistics.median(t), 3) if t else None,
            "short_ttft_max_s": round(max(t), 3) if t else None, "slowest_shorts": _slowest(clients.spans, steps),
            "answer": answer}


def run_mode(loaded, mode: str, session_tokens: list[int], follow_up_tokens, args, opts: DrafterOptions) -> dict:
    """One drafter mode: idle TTFT, the cold turn, the next turn (from the prefix tree)."""
    drafter = None if mode == "none" else make_drafter(mode, loaded, opts)
    engine = BatchEngine(loaded.model, drafter, prefix_cache_bytes=int(args.prefix_cache_gb * 2**30),
                         idle_budget=args.prefill_budget)
    tok = loaded.tokenizer
    idle = []
    for i in range(3):
        sid = f"idle{i}"
        engine.add(sid, _short(tok, 1000 + i), 4)
        t0, first = time.perf_counter(), None
        while engine.running():
            for o in engine.step():
                if o.seq_id == sid and o.tokens and first is None:
                    first = time.perf_counter() - t0
        idle.append(first)
    idle_ttft = statistics.median(idle)
    clients = _Clients(engine, tok, args.short_rate, args.short_max_tokens, args.seed)
    cold = _turn(engine, clients, "cold", session_tokens, args.max_tokens)
    nxt_prompt = follow_up_tokens(cold.pop("answer"))
    nxt = _turn(engine, clients, "next", nxt_prompt, args.max_tokens)
    nxt.pop("answer")
    for turn in (cold, nxt):
        turn["short_ttft_max_over_idle"] = round(turn["short_ttft_max_s"] / idle_ttft, 2) \
            if turn["short_ttft_max_s"] is not None else None
    tree = engine.prefix_cache.status() if engine.prefix_cache is not None else {}
    return {"mode": mode, "idle_short_ttft_s": round(idle_ttft, 3), "cold": cold, "next": nxt,
            "next_over_cold_ttft": round(nxt["ttft_s"] / cold["ttft_s"], 3),
            "next_over_cold_ready": round(nxt["drafter_ready_s"] / cold["drafter_ready_s"], 3),
            "drafter_state_in_tree": None if drafter is None else engine.drafter_kept or "kept", "prefix_tree": tree}
