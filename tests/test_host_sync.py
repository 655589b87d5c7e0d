"""The loop performs one host synchronisation per cycle."""

import re
from pathlib import Path

import pytest

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter, SamplingConfig, host
from test_greedy_equality import PROMPT, noisy_copy, target

LOOP_SOURCES = ["core", "sampling.py", "target_model", "drafters"]


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
@pytest.mark.parametrize("drafter", ["draft", "ngram", "none"])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_one_host_sync_per_cycle(family, drafter, temp):
    d = {"draft": lambda: DraftModelDrafter(noisy_copy(family), tiny_models.VOCAB), "ngram": NgramDrafter,
         "none": lambda: None}[drafter]()
    engine = Engine(target(family), d)
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=48, num_draft=3, sampling=SamplingConfig(temperature=temp)))
    next(gen)  # prefill and the first token
    before = dict(host.counts)
    cycles = sum(1 for _ in gen)
    assert cycles == engine.stats.cycles > 0
    assert host.counts["read"] - before["read"] == cycles
    assert host.counts["wait"] == before["wait"]


def test_profiling_adds_syncs_only_on_profiled_cycles():
    engine = Engine(target("llama"), DraftModelDrafter(noisy_copy("llama"), tiny_models.VOCAB))
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=40, num_draft=2, profile_every=4))
    next(gen)
    before = host.total()
    cycles = sum(1 for _ in gen)
    profiled = engine.stats.profiled_cycles
    assert profiled == (cycles + 3) // 4
    assert host.total() - before == cycles + 2 * profiled  # draft and verify boundaries
    assert engine.stats.time_verify > 0 and engine.stats.time_draft > 0


def test_loop_code_never_reads_the_device_directly():
    """All device reads and waits go through mlx_engine.host, which the tests above count."""
    root = Path(__file__).parent.parent / "mlx_engine"
    files = [p for name in LOOP_SOURCES for p in ((root / name).rglob("*.py") if (root / name).is_dir() else [root / name])]
    pattern = re.compile(r"\.item\(\)|\.tolist\(\)|mx\.eval\(|np\.array\(|np\.asarray\(")
    offenders = [f"{p.name}:{i + 1}" for p in files for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert offenders == []
