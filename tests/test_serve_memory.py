"""The server with long contexts in mind: a quantized KV cache (--kv-bits) in continuous batching, the
memory budget (--max-memory: a request that can never fit is refused, one that does not fit beside the
running ones waits its turn) and the prefix cache shared by requests."""

import pytest

from mlx_engine.core.engine import Engine, GenerationConfig
from serve_util import RunningServer
from test_serve_batch import ask, together

QUESTIONS = ["What is the capital of France?", "Give me one tip for better sleep.", "Write a haiku about the sea."]


def alone_tokens(server, question, n, **engine_kw):
    """The same request decoded plainly alone by the single-sequence engine (same model, same cache kind)."""
    from mlx_engine import text as text_ops

    tok = server.service.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True))
    eos = frozenset(getattr(tok, "eos_token_ids", None) or ())
    model = server.service.worker.engine.target.model
    out = [t for s in Engine(model, **engine_kw).generate(prompt, GenerationConfig(max_tokens=n, num_draft=0,
                                                                                   stop_tokens=eos)) for t in s.tokens]
    return text_ops.decode(tok, out, text_ops.special_ids(tok))


def test_kv_bits_in_continuous_batching_equal_the_same_cache_alone():
    """Requests batched beside each other, with MTP drafts, prompts fed in chunks timed to the load: each
    equals its own plain decoding alone with the same cache (a quantized cache decodes batch invariant)."""
    s = RunningServer("--batching", "continuous", "--kv-bits", "4", "--max-tokens", "24")
    try:
        assert s.service.worker.mode == "continuous"  # a quantized cache batches; no fall back to the fair queue
        assert s.service.worker.status()["batch_invariant"]
        got = together(lambda q: ask(s, q, 24), [(q,) for q in QUESTIONS])
        for q, (text, _, _) in zip(QUESTIONS, got):
            assert text == alone_tokens(s, q, 24, kv_bits=4)
        assert s.service.worker.largest_batch >= 2
    finally:
        s.close()


def test_memory_budget_refuses_what_never_fits_and_queues_what_fits_later():
    from mlx_engine.core.memory import plan
    from mlx_engine.drafters.registry import DrafterOptions, make_drafter
    from mlx_engine.models import load
    from mlx_engine.target_model.model import Target

    m = load(None)
    b = plan(m.model, make_drafter("mtp", m, DrafterOptions()), Target(m.model), limit=1 << 40)
    limit = b.weights + 3000 * b.kv_per_token  # room for 3,000 positions of KV cache, no prefix cache
    s = RunningServer("--batching", "continuous", "--max-memory", str(limit), "--prefix-cache", "0")
    try:
        import openai

        with pytest.raises(openai.BadRequestError) as e:
            ask(s, QUESTIONS[0], 3500)
        assert e.value.code == "memory_budget_exceeded" and "at most" in e.value.message
        # 2 x (prompt + 1,600) positions do not fit at once: the second waits for the first, both are served
        got = together(lambda q: ask(s, q, 1600), [(q,) for q in QUESTIONS[:2]])
        assert all(text for text, _, _ in got)
        assert s.service.worker.largest_batch == 1
    finally:
        s.close()


def test_prefix_cache_serves_a_second_request_with_the_same_prefix():
    s = RunningServer("--batching", "continuous", "--max-tokens", "16")
    try:
        system = "You are a helpful assistant. " * 20  # a long shared system prompt
        client = s.client()
        for q in QUESTIONS[:2]:
            client.chat.completions.create(model=s.model, temperature=0, max_tokens=16, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": q}])
        status = s.service.worker.status()["prefix_cache"]
        assert status["hits"] >= 1 and status["hit_tokens"] >= 100 and status["bytes"] <= status["budget_bytes"]
    finally:
        s.close()
