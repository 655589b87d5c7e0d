"""Long prompts in the single-sequence engine: prefill in chunks (equal to one piece), progress per chunk,
a stop between chunks that keeps what was fed, and the context window checked before any work."""

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine import Engine, GenerationConfig, NgramDrafter
from mlx_engine.core.context import ContextLengthError
from mlx_engine.sampling import SamplingConfig
from mlx_engine.target_model.model import Target
from reference import mlx_lm_greedy
from test_greedy_equality import target

RNG = np.random.default_rng(3)
LONG = RNG.integers(0, tiny_models.VOCAB, 300).tolist()


def tokens_of(engine, prompt, n=24, **kw):
    return [t for s in engine.generate(prompt, GenerationConfig(max_tokens=n, **kw)) for t in s.tokens]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_next"])
def test_chunked_prefill_logits_equal_one_piece_within_float_error(family):
    """Chunks change the attention's reduction lengths (masked keys add exact zeros, but in another
    grouping), so logits agree to float error, not bit for bit; the greedy tokens agree (next test)."""
    t = Target(target(family))
    one, _ = t.forward(mx.array(LONG), t.make_cache())
    cache, parts = t.make_cache(), []
    for i in range(0, len(LONG), 37):
        parts.append(t.forward(mx.array(LONG[i : i + 37]), cache)[0])
    chunked = mx.concatenate(parts)
    assert chunked.shape == one.shape
    np.testing.assert_allclose(np.array(chunked), np.array(one), atol=1e-4, rtol=1e-4)
    assert mx.array_equal(chunked.argmax(-1), one.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
@pytest.mark.parametrize("step", [1, 37, 4096])
def test_chunked_prefill_greedy_output_equals_mlx_lm(family, step):
    expected = mlx_lm_greedy(target(family), LONG, 24)
    assert tokens_of(Engine(target(family)), LONG, num_draft=0, prefill_step=step) == expected
    assert tokens_of(Engine(target(family), NgramDrafter()), LONG, num_draft=3, prefill_step=step) == expected


def test_progress_is_reported_chunk_by_chunk():
    calls = []
    engine = Engine(target("llama"))
    tokens_of(engine, LONG, n=2, num_draft=0, prefill_step=64, on_prefill=lambda d, t: calls.append((d, t)))
    body = len(LONG) - 1  # the last prompt token is fed alone, with the first decode
    assert calls == [(0, body)] + [(min(i + 64, body), body) for i in range(0, body, 64)]
    # a second turn reports only the tokens it prefills (the common prefix is reused)
    calls.clear()
    tokens_of(engine, LONG + [1, 2, 3], n=2, num_draft=0, prefill_step=64, on_prefill=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, calls[-1][1]) and calls[-1][1] <= 4


def test_stop_between_chunks_keeps_what_was_fed_and_the_next_run_is_exact():
    engine = Engine(target("llama"), NgramDrafter())
    chunks = []

    def stop():
        chunks.append(1)
        return len(chunks) > 2  # two chunks fed, then stop

    steps = list(engine.generate(LONG, GenerationConfig(max_tokens=8, prefill_step=50, should_stop=stop)))
    assert steps == [] and engine.stats.cancelled
    assert engine._cached == LONG[:100] and engine.cache[0].offset == 100
    # the same prompt again: the 100 fed tokens are reused, the output is exact
    out = tokens_of(engine, LONG, num_draft=3, prefill_step=50)
    assert engine.stats.reused_tokens == 100 and not engine.stats.cancelled
    assert out == mlx_lm_greedy(target("llama"), LONG, 24)


def test_a_prefill_cut_short_mid_pass_is_not_reused():
    """An exception inside a prefill pass (Ctrl-C) leaves the cache ahead of the tokens recorded: the
    next generation starts afresh instead of trusting it."""
    engine = Engine(target("llama"))

    def boom(done, total):
        if done >= 50:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tokens_of(engine, LONG, prefill_step=50, on_prefill=boom)
    engine.cache[0].update_and_fetch(*(mx.zeros((1, 2, 3, 12)),) * 2)  # as if a pass had run, unrecorded
    assert tokens_of(engine, LONG, num_draft=0) == mlx_lm_greedy(target("llama"), LONG, 24)
    assert engine.stats.reused_tokens == 0


def test_context_window_is_checked_before_any_work():
    engine = Engine(target("llama"), context_length=310)
    with pytest.raises(ContextLengthError, match="at most 10 new tokens"):
        next(engine.generate(LONG, GenerationConfig(max_tokens=11)))
    assert engine.cache == []  # nothing was prefilled
    with pytest.raises(ContextLengthError, match="context window is 300"):
        next(Engine(target("llama"), context_length=300).generate(LONG, GenerationConfig(max_tokens=1)))
    assert len(tokens_of(engine, LONG, n=10, num_draft=0)) == 10


def test_cli_refuses_more_tokens_than_the_context_before_any_work(capsys):
    from mlx_engine.__main__ import main
    from mlx_engine.models.default import default_model_path

    default_model_path()  # a fresh machine's one-time download is not this command's output
    capsys.readouterr()
    assert main(["generate", "--prompt-tokens", "1,2,3", "--max-tokens", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the prompt (3 tokens) plus 100000 new tokens exceed this model's context window of "
                   "8192 tokens: ask for at most 8189 new tokens (--max-tokens 100000)"]


def test_cli_prefill_bar_follows_the_chunks():
    from mlx_engine.cli import PrefillBar

    bar = PrefillBar(min_tokens=100)
    bar(0, 50)
    assert bar.bar is None  # short prompts get no bar
    bar(0, 300)
    opened = bar.bar
    assert opened is not None
    bar(128, 300)
    bar(300, 300)
    assert bar.bar is None and opened.disable or opened.n == 300


@pytest.mark.parametrize("drafter", ["none", "ngram", "mtp"])
def test_prefix_tree_serves_a_conversation_after_another_and_stays_exact(drafter, tmp_path_factory):
    """Conversation A, then B (the engine's own cache now holds B), then A's next turn: it starts from the
    tree's copy of A, and its output equals a cold run's."""
    if drafter == "mtp":
        from mlx_engine.drafters.mtp import load_head
        from test_mtp_helpers import OracleMTP, load_hf, make

        folder = make(tmp_path_factory, "deepseek_v3")
        model, config = load_hf(folder)
        make_drafter = lambda: OracleMTP(load_head(model, folder, config), model)  # noqa: E731
    else:
        model = target("llama")
        make_drafter = (lambda: NgramDrafter()) if drafter == "ngram" else (lambda: None)  # noqa: E731
    engine = Engine(model, make_drafter(), prefix_cache_bytes=1 << 30)
    tree = engine.held.prefix_cache
    a1, b1 = LONG[:120], LONG[150:260]
    out_a = tokens_of(engine, a1, num_draft=3)
    tokens_of(engine, b1, num_draft=3)
    a2 = a1 + out_a + [5, 6, 7]
    out = tokens_of(engine, a2, num_draft=3)
    assert engine.stats.reused_tokens >= len(a1) + len(out_a) - 1
    assert out == mlx_lm_greedy(model, a2, 24)
    cold = Engine(model, make_drafter())
    assert tokens_of(cold, a2, num_draft=3) == out and cold.stats.reused_tokens == 0
    assert tree.status()["hits"] >= 1


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_a_prompt_the_tree_holds_whole_still_feeds_its_last_token(sampling):
    """The tree holds the whole prompt, its last token included (the same prompt again, or one ending
    inside an earlier answer), while the engine's own cache holds another conversation: only the first
    len(prompt) - 1 tokens come from the tree, the last is fed for its logits (taken from the tree too, it
    would be fed a second time on top of its own entry), and the output equals a cold run's, greedy and
    sampled with a seed."""
    model = target("llama")
    engine = Engine(model, NgramDrafter(), prefix_cache_bytes=1 << 30)
    a, b = LONG[:40], LONG[200:240]
    out_a = tokens_of(engine, a, num_draft=3)
    for prompt in (a, a + out_a[:10]):  # the tree holds a + out_a[:-1]: all of either
        tokens_of(engine, b, num_draft=3)  # the engine's own cache now holds b
        assert engine.held.prefix_cache.match(prompt) == len(prompt)
        got = tokens_of(engine, prompt, num_draft=3, sampling=sampling, seed=7)
        assert engine.stats.reused_tokens == len(prompt) - 1
        cold = Engine(model, NgramDrafter())
        assert got == tokens_of(cold, prompt, num_draft=3, sampling=sampling, seed=7)
        assert cold.stats.reused_tokens == 0


def test_prefix_tree_is_refused_by_name_for_a_recurrent_cache():
    engine = Engine(target("qwen3_next"), prefix_cache_bytes=1 << 30)
    assert engine.held.prefix_cache is None and "ArraysCache" in engine.held.prefix_cache_off


@pytest.mark.parametrize("flags, message", [
    (["--max-memory", "100MB"], "needs 0.50 GiB of weights, more than the memory budget of 0.09 GiB (--max-memory)"),
    (["--max-memory", "560MB", "--max-tokens", "8000"], "this request needs 0.34 GiB of KV cache for 8003 tokens"),
    (["--drafter", "ngram", "--draft-kv-bits", "4"], "--draft-kv-bits: the ngram drafter keeps no quantizable KV cache"),
    (["--trace"], "--trace adds the cycles to the --json output: give --json too"),
])
def test_cli_refuses_what_does_not_fit_or_does_nothing(capsys, flags, message):
    from mlx_engine.__main__ import main

    assert main(["generate", "--prompt-tokens", "1,2,3"] + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_cli_kv_bits_decodes():
    import contextlib
    import io
    import json

    from mlx_engine.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()) as buf:
        assert main(["generate", "--prompt-tokens", "1,2,3", "--max-tokens", "6", "--ignore-eos", "--kv-bits", "4",
                     "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert len(out["tokens"]) == 6
