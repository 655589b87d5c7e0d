"""`python -m mlx_engine.bench ceiling`: how fast ANY drafter that copies from the text could make a suite.

Prompt lookup and suffix decoding draft by copying: the tokens that followed an earlier occurrence of the
text's last few tokens, in this request's prompt and answer or in earlier requests. Their best case is an
oracle that knows the answer: at every position it drafts exactly the longest continuation of the answer
that the text written so far holds after an occurrence of its last `min_match` tokens, every draft
accepted. What remains is the target's own text, decoded a token a pass. This command computes that
oracle's speed for the target's greedy answers (temperature 0), with the verify costs measured on this
machine, so a speedup goal can be checked against what the model's answers allow before a drafter is
blamed.

For an answer a_0 .. a_{n-1} (a_0 comes from the prefill; the bench times the rest) and the texts known
before it (earlier requests' prompts and answers, then this prompt):

    L(i)   = the longest m such that a_i .. a_{i+m-1} == T[j .. j+m-1] for some known text T and position j
             whose preceding min_match tokens equal the last min_match tokens written (the known text
             includes a_0 .. a_{i-1}; a copy never runs past what is written)
    cost   = min over schedules: a pass at position i drafts m <= L(i) tokens, verifies m + 1 rows at
             c(m + 1) = t(m + 1) / t(1) and moves to i + m + 1; a plain step is m = 0, c(1) = 1
    speedup ceiling = (n - 1) / cost           (dynamic programming over positions: exact)

The free-rows ceiling takes c(r) = 1 for every r: verify passes as cheap as a decode step, the limit of
the verify kernels' goal. Both bound every drafter whose drafts are continuations of a match of at least
`min_match` tokens, trees included (each accepted path is such a continuation; the oracle verifies no
wasted rows, never drafts in vain and drafts for free): prompt lookup and the suffix drafter need 2
(the default). With 1 the oracle chooses in hindsight among every occurrence of a single token, which no
drafter can. A drafter that models the text (an MTP head, a draft model) can pass the ceiling where the
answer is not in the text.
"""

from __future__ import annotations

from .. import _platform  # noqa: F401  (OpenBLAS before mlx, on Linux)

import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass

from ..args import ArgumentParser, count
from .report import command, machine, writable_file

SEPARATOR = -1  # between known texts: a copy never crosses from one text into the next


def copy_lengths(known: list[list[int]], answer: list[int], min_match: int = 1, max_draft: int = 16) -> list[int]:
    """L(i) for i = 0 .. n-1 (L(0) = 0: a_0 comes from the prefill). `known`: the texts before the answer,
    the last one the prompt the answer continues."""
    text: list[int] = []
    for t in known[:-1]:
        text += list(t) + [SEPARATOR]
    text += list(known[-1]) if known else []
    text.append(answer[0])
    after: dict[tuple, list[int]] = defaultdict(list)  # min_match tokens -> the positions right after them
    indexed = min_match  # positions below this one are in `after`
    lengths = [0]
    for i in range(1, len(answer)):
        while indexed < len(text):  # a continuation starts inside the written text
            key = tuple(text[indexed - min_match : indexed])
            if SEPARATOR not in key:
                after[key].append(indexed)
            indexed += 1
        best = 0
        for j in after.get(tuple(text[-min_match:]), ()):
            m = 0
            while m < max_draft and i + m < len(answer) and j + m < len(text) and text[j + m] == answer[i + m]:
                m += 1
            best = max(best, m)
        lengths.append(best)
        text.append(answer[i])
    return lengths


def min_cost(lengths: list[int], cost: dict[int, float]) -> tuple[float, int]:
    """(the least cost of decoding positions 1 .. n-1, the passes it takes) over every schedule (module doc);
    cost[r]: a pass of r rows in decode steps (cost[1] = 1)."""
    n = len(lengths)
    best = [0.0] * (n + 1)
    passes = [0] * (n + 1)
    for i in range(n - 1, 0, -1):
        options = []
        for m in range(0, min(lengths[i], n - 1 - i) + 1):
            options.append((cost[m + 1] + best[i + m + 1], passes[i + m + 1] + 1))
        best[i], passes[i] = min(options)
    return best[1], passes[1]


@dataclass
class Ceiling:
    id: str
    prompt_tokens: int
    answer_tokens: int  # after the first (the bench's count)
    copyable: int  # answer tokens the oracle drafts (accepted) at the measured costs
    passes: int
    speedup: float  # at the measured verify costs
    passes_free: int
    speedup_free: float  # every pass as cheap as a decode step


def ceiling(id_: str, known: list[list[int]], answer: list[int], cost: dict[int, float], min_match: int,
            max_draft: int) -> Ceiling:
    lengths = copy_lengths(known, answer, min_match, max_draft)
    decoded = len(answer) - 1
    total, passes = min_cost(lengths, cost)
    free_total, free_passes = min_cost(lengths, {r: 1.0 for r in cost})
    return Ceiling(id_, len(known[-1]), decoded, decoded - passes, passes,
                   decoded / total if total else 1.0, free_passes, decoded / free_total if free_total else 1.0)


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m mlx_engine.bench ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model (default: the embedded SmolLM2-135M-Instruct, fp32)")
    ap.add_argument("--suite", default="edit", help="prompt suite in bench/prompts (default edit)")
    ap.add_argument("--prompts", type=count(1), default=8, help="prompts from the suite (default 8)")
    ap.add_argument("--max-tokens", type=count(2), default=160, help="answer tokens at most (default 160)")
    ap.add_argument("--min-match", type=count(1), default=2,
                    help="tokens of the written text a copy must follow (default 2, what prompt lookup and the suffix "
                         "drafter need; 1 lets the oracle pick, in hindsight, among every occurrence of one token)")
    ap.add_argument("--max-draft", type=count(1), default=16, help="longest draft of a pass (default 16)")
    ap.add_argument("--no-history", action="store_true",
                    help="copy from this request's prompt and answer only (default: earlier requests' too, as the "
                         "suffix drafter's shared cache does within a bench trial)")
    ap.add_argument("--trials", type=count(1), default=5, help="timed passes per row count (default 5)")
    ap.add_argument("--out", help="JSON results file")
    return ap


def main(argv: list[str] | None = None) -> int:
    return command(parser(), run, argv)


def run(args, argv) -> int:
    from ..core.engine import Engine, GenerationConfig
    from ..models import load
    from .suite import load_prompts, suite_file, suite_rows
    from .verify import time_verify_forward

    suite_file(args.suite)  # the cheap checks before the model loads
    out = writable_file(args.out, "--out") if args.out else None
    loaded = load(args.model)  # None: the embedded default
    tok = loaded.tokenizer
    prompts = load_prompts(args.suite, args.prompts, tok)
    ids = [r["id"] for r in suite_rows(args.suite, args.prompts)]
    stop = frozenset(getattr(tok, "eos_token_ids", None) or ())
    engine = Engine(loaded.model, None)
    rows, texts = [], []
    print(f"{'prompt':<10} {'prompt tok':>10} {'answer tok':>10} {'copyable':>8} {'passes':>6} "
          f"{'ceiling':>8} {'free rows':>9}", flush=True)
    for id_, prompt in zip(ids, prompts):
        config = GenerationConfig(max_tokens=args.max_tokens, num_draft=0, stop_tokens=stop)  # greedy
        answer = [t for step in engine.generate(prompt, config) for t in step.tokens]
        ms = time_verify_forward(loaded.model, len(prompt), args.max_draft + 1, args.trials)  # at this context
        cost = {r: ms[r] / ms[1] for r in ms}
        row = ceiling(id_, ([] if args.no_history else texts) + [prompt], answer, cost, args.min_match, args.max_draft)
        rows.append(row)
        texts += [prompt, answer]
        print(f"{row.id:<10} {row.prompt_tokens:>10} {row.answer_tokens:>10} {row.copyable:>8} {row.passes:>6} "
              f"{row.speedup:>7.2f}x {row.speedup_free:>8.2f}x", flush=True)
    decoded = sum(r.answer_tokens for r in rows)
    # the suite's figure weighs prompts as the bench does: all tokens over all time
    suite = decoded / sum(r.answer_tokens / r.speedup for r in rows)
    free = decoded / sum(r.answer_tokens / r.speedup_free for r in rows)
    print(f"{'suite':<10} {'':>10} {decoded:>10} {sum(r.copyable for r in rows):>8} {sum(r.passes for r in rows):>6} "
          f"{suite:>7.2f}x {free:>8.2f}x")
    if out is not None:
        result = {"suite": args.suite, "min_match": args.min_match, "max_draft": args.max_draft,
                  "history": not args.no_history, "speedup_ceiling": suite, "speedup_ceiling_free_rows": free,
                  "prompts": [asdict(r) for r in rows], "machine": machine(),
                  "argv": sys.argv[1:] if argv is None else argv}
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0
