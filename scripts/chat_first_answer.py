"""The chat's FIRST answer with default settings against plain decoding of the same prompt, headless.

    .venv/bin/python scripts/chat_first_answer.py [--prompts 3] [--rounds 2] [--max-tokens N]

Both sides run through the chat's own worker (app/worker.py: EngineWorker, the LivePolicy it installs
over the engine's adaptive policy) with the chat's default settings (app/settings.py: Settings()), each
on a freshly loaded embedded default model: "default" = the default drafter (mtp, the trained head) and
draft length (auto); "plain" = drafter none. Every first answer is a fresh worker, so auto starts with
no evidence, as in a new chat. Within a round the two run back to back on the same prompt, in an order
that alternates, so drift of a shared machine hits both alike. Reported per answer: decode tok/s (tokens
after the first over the engine's decode time), their ratio, the tokens, the cycle at which auto first
drafted, acceptance; then the median ratio. A benchmark, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_engine  # noqa: E402,F401  (OpenBLAS before mlx)
from app.messages import GenerationFinished, ModelLoaded, ModelLoadFailed  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.worker import EngineWorker, GenerateRequest, LivePolicy, LoadRequest  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "chat.jsonl"


class RecordingPolicy(LivePolicy):
    """The worker's LivePolicy, recording the k of every cycle (0: a plain stretch)."""

    def __init__(self, worker, inner):
        super().__init__(worker, inner)
        self.ks: list[int] = []

    def next_k(self) -> int:
        k = super().next_k()
        self.ks.append(k)
        return k


def wait_for(inbox: queue.Queue, kinds, timeout: float = 600.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        msg = inbox.get(timeout=timeout)
        if isinstance(msg, ModelLoadFailed):
            raise SystemExit(f"error: {msg.error}")
        if isinstance(msg, kinds):
            return msg
    raise SystemExit("error: timed out")


def first_answer(drafter: str, settings: Settings, messages: list[dict], max_tokens: int) -> dict:
    """A fresh chat worker: load the default model with `drafter`, answer once with the chat's settings."""
    inbox: queue.Queue = queue.Queue()
    worker = EngineWorker(inbox.put)
    worker.start()
    worker.set_live(settings.num_draft, settings.speculation)
    worker.load(LoadRequest(None, drafter, None))
    loaded = wait_for(inbox, ModelLoaded)
    policy = RecordingPolicy(worker, worker.engine.policy)
    worker.engine.policy = policy  # what the worker installs itself, plus a record of k
    worker.generate(GenerateRequest(1, messages, settings.temperature, max_tokens))
    done = wait_for(inbox, GenerationFinished)
    worker.shutdown(timeout=60)
    st = done.snapshot.stats
    drafting = [i + 1 for i, k in enumerate(policy.ks) if k > 0]
    return {"drafter": loaded.drafter, "decode_tps": st["decode_tps"], "generated": st["generated"],
            "acceptance": st["acceptance_rate"], "drafted": st["drafted"], "error": done.error,
            "first_drafting_cycle": drafting[0] if drafting else None, "ks": policy.ks[:24],
            "special_tokens_in_text": any(m in done.text for m in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="chat prompts from bench/prompts/chat.jsonl (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the prompts, order alternating (default 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default: the chat's setting)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    settings = Settings()  # the chat's defaults, not the saved settings of this machine
    max_tokens = args.max_tokens or settings.max_tokens
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    print(f"chat defaults: drafter {settings.drafter}, k {settings.num_draft}, temp {settings.temperature}, "
          f"max tokens {max_tokens}; load average {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for r in range(args.rounds):
        for i, row in enumerate(rows):
            order = ("mtp", "none") if (r + i) % 2 == 0 else ("none", "mtp")
            got = {d: first_answer(d, settings, row["messages"], max_tokens) for d in order}
            spec, plain = got["mtp"], got["none"]
            ratio = spec["decode_tps"] / plain["decode_tps"]
            results.append({"prompt": row["id"], "round": r, "order": order, "default": spec, "plain": plain,
                            "ratio": ratio, "load": os.getloadavg()[0]})
            print(f"{row['id']} round {r} ({order[0]} first): default {spec['decode_tps']:.2f} tok/s "
                  f"({spec['generated']} tok, acceptance {spec['acceptance']:.2f}, first drafted at cycle "
                  f"{spec['first_drafting_cycle']}, k {spec['ks'][:8]}, special tokens in the text: "
                  f"{spec['special_tokens_in_text'] or plain['special_tokens_in_text']}) | plain {plain['decode_tps']:.2f} tok/s "
                  f"({plain['generated']} tok) | ratio {ratio:.3f} | load {results[-1]['load']:.2f}", flush=True)
    ratios = [x["ratio"] for x in results]
    total = (sum(x["default"]["generated"] for x in results), sum(x["plain"]["generated"] for x in results))
    print(f"median ratio default/plain {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
          f"over {len(ratios)} first answers; tokens {total[0]} / {total[1]}; load average now {os.getloadavg()[0]:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(settings), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
