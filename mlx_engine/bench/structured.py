"""`python -m mlx_engine.bench --suite json` / `--suite tools`: structured output under speculation.

Each prompt carries its grammar: the json suite a response_format (json_schema or json_object, the schema
also shown in a system message, as an instruction), the tools suite a forced tool call in the generic form
(grammar/requests.py; "auto" rows run as "required": the bench measures constrained decoding). Modes:

- `mlx-lm constrained`: mlx-lm's generate_step with llguidance's own matcher as a logits processor, the
  way a user adds a grammar to mlx-lm;
- `engine plain` (no grammar), `engine plain constrained` (masks only: the baseline of the goals),
  `engine grammar` (no drafter; the grammar drafts its forced tokens);
- for each drafter D: `engine D` (no grammar), `engine D constrained` (masks and cuts, no forced drafts),
  `engine grammar+D` (forced drafts ahead of D).

--modes takes these names exactly (comma-separated); `engine plain constrained` always runs. Beside the
usual figures: `forced_share` (emitted tokens the grammar drafted and the target accepted),
`grammar_us_per_token` (host time of masks, cuts and forced runs per emitted token), `valid` (answers
that parse and match their schema, or are a well-formed call of an offered tool; answers cut at
--max-tokens count as invalid), `finished` (answers that ended before --max-tokens) and `valid_finished`
(valid among the finished: a grammar's own failures, apart from answers cut short).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import mlx.core as mx

from ..core.engine import Engine, GenerationConfig
from ..grammar import grammar_tokenizer
from ..grammar.requests import CALL_CLOSE, CALL_OPEN, from_response_format, tools_system_text
from ..sampling import SamplingConfig
from ..toolcalls.formats import GENERIC
from ..toolcalls.grammars import forced_call
from .modes import Mode, Result

SUITES = ("json", "tools")


@dataclass
class StructuredPrompt:
    tokens: list[int]
    grammar: object  # mlx_engine.grammar.Grammar
    check: object  # text -> bool: a valid answer


def _json_check(schema):
    def check(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if schema is None:
            return isinstance(value, dict)
        try:
            import jsonschema
        except ImportError:  # the test extra has it; without it, parsing is the check
            return True
        try:
            jsonschema.validate(value, schema)
            return True
        except jsonschema.ValidationError:
            return False
    return check


def _call_check(tools):
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}

    def check(text: str) -> bool:
        calls = [c for c in text.split(CALL_OPEN)[1:]]
        if not calls:
            return False
        for c in calls:
            body = c.split(CALL_CLOSE)[0]
            try:
                call = json.loads(body)
            except ValueError:
                return False
            if call.get("name") not in schemas or not _json_check(schemas[call["name"]])(json.dumps(call.get("arguments"))):
                return False
        return True
    return check


def load_structured(suite: str, rows: list[dict], loaded) -> list[StructuredPrompt]:
    tok = loaded.tokenizer
    llg = grammar_tokenizer(tok, loaded.vocab_size, list(getattr(tok, "eos_token_ids", None) or ()))
    out = []
    for r in rows:
        messages = list(r["messages"])
        if suite == "json":
            fmt = r["response_format"]
            schema = fmt.get("json_schema", {}).get("schema")
            grammar = from_response_format(fmt, llg)
            note = ("Answer with JSON that matches this schema: " + json.dumps(schema)) if schema else \
                "Answer with a JSON object."
            check = _json_check(schema)
        else:
            tools, choice = r["tools"], r.get("tool_choice", "required")
            named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
            offered = [t for t in tools if named is None or t["function"]["name"] == named]
            grammar = forced_call(GENERIC, offered, llg, parallel=False)
            note = tools_system_text(tools)
            check = _call_check(offered)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + note}
        else:
            messages.insert(0, {"role": "system", "content": note})
        tokens = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        out.append(StructuredPrompt(tokens, grammar, check))
    return out


def _valid(p: StructuredPrompt, tokens: list[int], tokenizer, stop) -> bool:
    if not tokens or tokens[-1] not in stop:
        return False
    return bool(p.check(tokenizer.decode([t for t in tokens if t not in stop])))


def run_constrained_engine(engine: Engine, p: StructuredPrompt, max_tokens: int, temp: float, seed: int, k,
                           grammar: bool, drafts: bool, stop: frozenset, tokenizer) -> Result:
    cfg = GenerationConfig(max_tokens=max_tokens, num_draft=k, sampling=SamplingConfig(temperature=temp), seed=seed,
                           stop_tokens=stop, grammar=p.grammar if grammar else None, grammar_drafts=drafts)
    start = time.perf_counter()
    tokens = [t for step in engine.generate(p.tokens, cfg) for t in step.tokens]
    wall = time.perf_counter() - start
    s = engine.stats
    return Result(s.generated - 1, s.decode_time, s.cycles, s.drafted, s.accepted, list(s.drafted_at),
                  list(s.accepted_at), s.peak_memory, wall, forced=s.forced_accepted, grammar_seconds=s.grammar_seconds,
                  valid=_valid(p, tokens, tokenizer, stop), finished=bool(tokens) and tokens[-1] in stop)


def run_mlx_lm_constrained(model, p: StructuredPrompt, max_tokens: int, temp: float, seed: int, stop: frozenset,
                           tokenizer) -> Result:
    """mlx-lm's generate_step with a logits processor that masks by llguidance's own matcher."""
    import llguidance
    import llguidance.numpy as llg_numpy
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    matcher = llguidance.LLMatcher(p.grammar.tokenizer, p.grammar.source, log_level=0)
    vocab = p.grammar.tokenizer.vocab_size
    bits = llg_numpy.allocate_token_bitmask(1, vocab)
    seen, spent = [0], [0.0]
    shifts = mx.arange(32, dtype=mx.int32)

    def processor(history: mx.array, logits: mx.array) -> mx.array:
        new = history[len(p.tokens) + seen[0]:].tolist()  # (waits for the step before: not the grammar's time)
        t0 = time.perf_counter()
        for t in new:
            if t not in stop:
                matcher.consume_token(t)
        seen[0] += len(new)
        llg_numpy.fill_next_token_bitmask(matcher, bits, 0)
        spent[0] += time.perf_counter() - t0
        allowed = ((mx.array(bits)[:, :, None] >> shifts) & 1).reshape(1, -1)[:, : logits.shape[-1]]
        return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)

    mx.random.seed(seed)
    mx.reset_peak_memory()
    start = time.perf_counter()
    tokens, t0 = [], None
    for n, (tok, _) in enumerate(generate_step(mx.array(p.tokens), model, max_tokens=max_tokens,
                                               sampler=make_sampler(temp=temp), logits_processors=[processor])):
        if n == 0:
            t0 = time.perf_counter()
        tokens.append(int(tok))
        if tokens[-1] in stop:
            break
    end = time.perf_counter()
    n = len(tokens) - 1
    return Result(n, end - t0, cycles=max(n, 1), peak_memory=mx.get_peak_memory(), wall=end - start,
                  grammar_seconds=spent[0], valid=_valid(p, tokens, tokenizer, stop),
                  finished=bool(tokens) and tokens[-1] in stop)


def build_structured_modes(args, model, drafters: dict, stop: frozenset, tokenizer) -> list[Mode]:
    """drafters: name -> a function making a fresh drafter."""
    modes = [Mode("mlx-lm constrained",
                  lambda p, n, t, s: run_mlx_lm_constrained(model, p, n, t, s, stop, tokenizer), "mlx-lm")]

    def engine_mode(name, drafter, k, grammar, drafts):
        engine = Engine(model, drafter)
        return Mode(name, lambda p, n, t, s: run_constrained_engine(engine, p, n, t, s, k, grammar, drafts, stop,
                                                                    tokenizer), "engine")

    modes += [engine_mode("engine plain", None, 0, False, False),
              engine_mode("engine plain constrained", None, 0, True, False),
              engine_mode("engine grammar", None, 0, True, True)]
    k = args.ks[0] if len(args.ks) == 1 else "auto"
    for name, make in drafters.items():
        modes += [engine_mode(f"engine {name}", make(), k, False, False),
                  engine_mode(f"engine {name} constrained", make(), k, True, False),
                  engine_mode(f"engine grammar+{name}", make(), k, True, True)]
    wanted = {m.strip() for m in args.modes.split(",") if m.strip()} if args.modes else None
    unknown = (wanted or set()) - {m.name for m in modes}
    if unknown:
        from .report import BenchInputError

        raise BenchInputError(f"--modes: no structured mode {', '.join(sorted(unknown))!s} (the structured suites take "
                              f"exact names: {', '.join(m.name for m in modes)})")
    # masks-only decoding is every speedup's baseline: always run
    return [m for m in modes if not wanted or m.name in wanted or m.name == "engine plain constrained"]
