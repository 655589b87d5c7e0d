"""Fixtures for structured-output tests: a byte-level BPE trained on JSON-like text (so forced text has
several tokenizations), tiny models over its vocabulary, grammars, and the reference: plain constrained
greedy decoding by mlx-lm's own generate_step with a logits processor that drives llguidance directly
(none of the engine's grammar code)."""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tiny_models
from mlx_engine.grammar import grammar_tokenizer, json_schema

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# a schema a tiny random model finishes: enums, bounded integers, booleans, short strings, an array
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["tool", "answer", "question"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["kind", "count", "ok", "tags", "note"],
    "additionalProperties": False,
}


def _corpus() -> list[str]:
    rows = []
    for i in range(60):
        obj = {"kind": ["tool", "answer", "question"][i % 3], "count": i, "ok": i % 2 == 0,
               "tags": ["red", "green", "blue"][: i % 4], "note": "abc"[: i % 4], "name": f"item {i}"}
        rows += [json.dumps(obj), json.dumps(obj, separators=(",", ":"))]
    return rows + ["The quick brown fox jumps over the lazy dog.", "Hello, world! 12345"]


@functools.cache
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() <= VOCAB
    return tok


def eos() -> int:
    return tokenizer().token_to_id("<|im_end|>")


def think_end() -> int:
    return tokenizer().token_to_id("</think>")


def llg_tokenizer():
    return grammar_tokenizer(tokenizer(), VOCAB, [eos()])


def schema_grammar(schema=SCHEMA):
    return json_schema(schema, llg_tokenizer(), "test")


def encode(text: str) -> list[int]:
    return tokenizer().encode(text).ids


def decode(tokens) -> str:
    return tokenizer().decode([t for t in tokens if t != eos()])


@functools.cache
def target(family: str = "llama", seed: int = 1):
    return tiny_models.build(family, seed=seed, vocab=VOCAB)[0]


PROMPT = [5, 40, 77, 120, 9, 33, 200, 41]


def reference(model, prompt: list[int], grammar, n: int, reasoning: bool = False) -> list[int]:
    """Plain constrained greedy decoding, up to n tokens or the end-of-answer token (included): mlx-lm's
    generate_step, each step's logits masked by llguidance's own matcher fed the tokens so far (before the
    reasoning end marker, when `reasoning`, nothing is masked)."""
    matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.source, log_level=0)
    bitmask = llg_numpy.allocate_token_bitmask(1, VOCAB)
    state = {"seen": 0, "free": reasoning}

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens.tolist()[len(prompt):]
        for t in generated[state["seen"]:]:
            if state["free"]:
                state["free"] = t != think_end()
            else:
                assert matcher.consume_token(t), matcher.get_error()
        state["seen"] = len(generated)
        if state["free"]:
            return logits
        llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        out = np.array(logits.astype(mx.float32))
        llg_numpy.apply_token_bitmask_inplace(out, bitmask)
        return mx.array(out)

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=[processor]):
        out.append(int(tok))
        if out[-1] == eos():
            break
    return out


class LegalGuesser:
    """A host drafter whose drafts the grammar always allows (legal tokens picked at random): a random
    model's own drafts are nearly always cut, these are accepted in part, so rollbacks happen under the
    grammar. Deterministic drafts (probs None). The answer starts at the token `begin` ends with; an
    answer the grammar does not hold (an unconstrained row of a batch) gets no drafts."""

    name = "guess"
    needs_hidden = False

    def __init__(self, grammar, seed: int = 0, vocab: int = VOCAB):
        self.grammar, self.vocab = grammar, vocab
        self.rng = np.random.default_rng(seed)

    def begin(self, tokens, hidden=None):
        self.answer = list(tokens[-1:])

    def propose(self, k, sampling, key):
        from mlx_engine.drafters.base import Draft
        from mlx_engine.grammar import GrammarViolation

        m = self.grammar.matcher()
        out = []
        try:
            m.consume(self.answer)
        except GrammarViolation:
            k = 0
        for _ in range(k):
            bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")[: self.vocab]
            allowed = [t for t in np.flatnonzero(bits).tolist() if t not in m.eos]
            if not allowed:
                break
            out.append(int(self.rng.choice(allowed)))
            m.consume(out[-1:])
        return Draft(mx.array(out, dtype=mx.int32), None, host_tokens=out)

    def commit(self, verdict, hidden=None):
        self.answer += verdict.tokens

    def max_draft(self):
        return None


# four schemas a tiny model finishes, one per row of a batch
SCHEMAS = [
    SCHEMA,
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["ok", "count"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue", "tool"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                      "kind": {"enum": ["answer", "question"]},
                                      "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50},
                                               "maxItems": 2}},
     "required": ["name", "kind", "tags"], "additionalProperties": False},
]
PROMPTS = [PROMPT, [9, 8, 7, 6, 5], [100, 101, 102], [44, 45, 46, 47, 48, 49]]
