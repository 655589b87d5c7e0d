"""The modes a bench run compares, and how each one generates."""

import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..core.engine import Engine, GenerationConfig
from ..sampling import SamplingConfig


@dataclass
class Result:
    """One generation: decoded tokens after the first, their time, and acceptance counters."""

    tokens: int
    seconds: float
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)
    peak_memory: int = 0
    wall: float = 0.0  # seconds from the call to the last token, prefill included (end to end)
    forced: int = 0  # tokens the grammar drafted and the target accepted (structured suites)
    grammar_seconds: float = 0.0  # host time of the grammar's masks, cuts and forced runs
    valid: bool | None = None  # the answer is valid for its schema or tools (structured suites)
    finished: bool | None = None  # the answer ended on a stop token, not at --max-tokens (structured suites)


def run_mlx_lm(model, prompt: list[int], max_tokens: int, temp: float, seed: int, draft_model=None, k: int = 0,
               stop: frozenset = frozenset()) -> Result:
    """mlx-lm's own generate_step / speculative_generate_step, ended after a `stop` token (counted, as the
    engine counts it)."""
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    mx.reset_peak_memory()
    start = time.perf_counter()
    sampler = make_sampler(temp=temp)
    if draft_model is None:
        steps = ((tok, False) for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler))
    else:
        steps = ((tok, d) for tok, _, d in speculative_generate_step(
            mx.array(prompt), model, draft_model, num_draft_tokens=k, max_tokens=max_tokens, sampler=sampler))
    accepted = n = 0
    t0 = None
    for n, (tok, from_draft) in enumerate(steps):
        if n == 0:
            t0 = time.perf_counter()
        accepted += bool(from_draft)
        if int(tok) in stop:
            break
    end = time.perf_counter()
    seconds = end - t0
    cycles = n - accepted  # every non-draft token closes one verify cycle (the first came from prefill)
    return Result(n, seconds, cycles=max(cycles, 1), drafted=k * max(cycles, 1) if draft_model is not None else 0,
                  accepted=accepted, peak_memory=mx.get_peak_memory(), wall=end - start)


def run_engine(engine: Engine, prompt: list[int], max_tokens: int, temp: float, seed: int, k,
               stop: frozenset = frozenset()) -> Result:
    cfg = GenerationConfig(max_tokens=max_tokens, num_draft=k, sampling=SamplingConfig(temperature=temp), seed=seed,
                           stop_tokens=stop)
    start = time.perf_counter()
    for _ in engine.generate(prompt, cfg):
        pass
    wall = time.perf_counter() - start
    s = engine.stats
    return Result(s.generated - 1, s.decode_time, s.cycles, s.drafted, s.accepted, list(s.drafted_at),
                  list(s.accepted_at), s.peak_memory, wall)


@dataclass
class Mode:
    name: str
    run: object  # (prompt, max_tokens, temp, seed) -> Result
    group: str  # "mlx-lm" or "engine"
