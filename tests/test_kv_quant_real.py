"""A quantized KV cache on the embedded model's real shapes, where stock passes are not enough: on this CPU a
prompt fed in chunks of 8 instead of one piece, or MTP verify passes instead of decode steps, change a key by
float error, flip its 4-bit code and change the greedy output (seen: a 0.17 logit gap at the first
difference). A quantized cache therefore decodes batch invariant by default, its prompt in passes the
contract covers: here the output is independent of the chunking, of speculation and of batching."""

import functools

import mlx.core as mx

import pytest

from mlx_engine import Engine, GenerationConfig
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.drafters.registry import DrafterOptions, make_drafter

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
N = 24


@functools.cache
def embedded():
    from mlx_engine.models import load

    m = load(None)
    prompts = [list(m.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in QUESTIONS]
    return m, prompts, frozenset(m.tokenizer.eos_token_ids)


def decode(engine, prompt, stop, k=0, step=512):
    cfg = GenerationConfig(max_tokens=N, num_draft=k, stop_tokens=stop, prefill_step=step)
    return [t for s in engine.generate(prompt, cfg) for t in s.tokens]


def test_chunking_and_speculation_change_no_token():
    m, prompts, stop = embedded()
    plain = Engine(m.model, kv_bits=4)
    assert plain.batch_invariant
    mtp = Engine(m.model, make_drafter("mtp", m, DrafterOptions()), kv_bits=4)
    for p in prompts:
        ref = decode(plain, p, stop)
        assert decode(plain, p, stop, step=5) == ref
        assert decode(mtp, p, stop, k="auto") == ref
        assert mtp.stats.drafted > 0


@pytest.mark.parametrize("first_chunk", [3, 32])
def test_batched_rows_equal_each_request_alone(first_chunk):
    """Requests joining a running batch at different steps, prompt chunks of another size than the engine
    alone feeds: every request's tokens equal its own decoding alone. The first chunk's size is set, not
    measured: 32 is over the contract's 16 rows, so the engine's cap on a quantized cache's chunks is what
    keeps the prompt's codes those of decoding alone, on any machine (the sizer grows later chunks by the
    clock, at most twofold: from its own first of 8 they never passed 16 on these 37-token prompts)."""
    from mlx_engine.core.chunk_sizer import ChunkSizer

    m, prompts, stop = embedded()
    engine = BatchEngine(m.model, make_drafter("mtp", m, DrafterOptions()), kv_bits=4, prefix_cache_bytes=0)
    assert engine.batch_invariant and engine.max_k + 1 < 32
    engine.prefills.sizer = ChunkSizer(first=first_chunk, largest=engine.prefills.prefill_step)
    out, done, steps = {0: [], 1: []}, set(), 0
    engine.add(0, prompts[0], N, stop_tokens=stop)
    while len(done) < 2:
        if steps == 2:
            engine.add(1, prompts[1], N, stop_tokens=stop)
        for o in engine.step():
            out[o.seq_id] += o.tokens
            done |= {o.seq_id} if o.finished else set()
        steps += 1
    alone = Engine(m.model, kv_bits=4)
    assert [out[0], out[1]] == [decode(alone, p, stop) for p in prompts]


def test_the_prompts_entries_are_those_of_token_by_token_decoding_whatever_the_chunking():
    """The prompt's quantized entries (codes, scales, biases) bit for bit the same fed in one call, in
    chunks of 5 or token by token (the engine feeds a quantized cache's prompt in covered passes)."""
    m, prompts, stop = embedded()

    def entries(step):
        engine = Engine(m.model, kv_bits=4)
        decode(engine, prompts[1], stop, step=step)
        n = len(prompts[1])
        return [x[..., :n, :] for c in engine.cache for part in (c.keys, c.values) for x in part]

    ref = entries(512)
    for step in (5, 1):
        assert all(mx.array_equal(a, b).item() for a, b in zip(ref, entries(step))), step
