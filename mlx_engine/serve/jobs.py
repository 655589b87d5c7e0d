"""One request on its way through the engine thread. The engine thread turns token ids into text (stop
strings included), splits it into reasoning, content and tool calls (toolcalls/stream.py), and hands plain
Python events to the HTTP side over an asyncio queue: Text, CallStart, CallArgs (toolcalls.stream), then
Done or Failed. The HTTP side cancels a job (the client left) by setting a flag the engine thread reads
between steps. Every job ends with exactly one terminal event (Done or Failed), which releases its place
in the server's queue."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

from ..sampling import SamplingConfig
from ..toolcalls.stream import Text, reader_for
from .stream import TextStream

_ids = itertools.count(1)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    num_draft: int | str | None = None  # None: the server's setting
    grammar: object = None  # mlx_engine.grammar.Grammar (response_format, a forced tool call), or None
    answer: object = None  # serve.turn.AnswerSpec: how the answer is split (None: all content)
    logprobs: int | None = None  # None: off; n: the chosen tokens' logprobs and the n most likely (Logprobs)


@dataclass(frozen=True)
class Logprobs:
    """The target's log-probabilities of tokens just emitted, in OpenAI's chat shape: one {"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]} per token."""
    entries: list


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (end of sequence or a stop string), "length", "tool_calls", "cancelled"
    prompt_tokens: int
    completion_tokens: int
    speculation: dict
    stop_sequence: str | None = None  # the stop string that ended it (None: end of sequence, or not "stop")
    cached_tokens: int = 0  # prompt tokens the engine reused (prefix cache, the previous turn's cache), not prefilled


@dataclass(frozen=True)
class Failed:
    message: str


GONE = object()  # put by the HTTP side itself when its client disconnects: stop waiting for the job


class Job:
    """Made on the HTTP side (inside the event loop); fed by the engine thread."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None, arrived: float | None = None):
        self.id = next(_ids)
        self.request = request
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.arrived = arrived if arrived is not None else self.submitted  # when its HTTP request came in
        self.name = f"request-{self.id}"  # the response's id once the HTTP side names it (logs, /health)
        self.on_end = None  # called once, by the engine thread, with the terminal event
        self.ended = False

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event) -> None:  # engine thread -> event loop
        if isinstance(event, (Done, Failed)):
            if self.ended:
                return
            self.ended = True
            if self.on_end is not None:
                self.on_end(self, event)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed (server shutting down)
            pass


class Output:
    """The engine side of a job: counts tokens, makes text, finds the end (EOS, a stop string, the limit)."""

    def __init__(self, job: Job, tokenizer, special: frozenset[int], eos: frozenset[int], metrics=None):
        self.job = job
        self.eos = eos
        self.metrics = metrics  # metrics.ServeMetrics: time to first token, inter-token latency
        answer = job.request.answer
        keep = marker_ids(tokenizer, answer) if answer is not None else frozenset()
        self.stream = TextStream(tokenizer, special - keep, job.request.stop, keep_special=bool(keep))
        self.splitter = reader_for(answer.fmt, answer.think, answer.reasoning, list(answer.tools)) \
            if answer is not None else None
        self.generated = 0
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def add(self, tokens: list[int], logprobs: list | None = None) -> bool:
        """Emit tokens (already cut at max_tokens and after an EOS by the engine), with the target's logprobs
        of them when the request asked (sampling.TokenLogprob, one per token). True when finished."""
        if self.finish_reason is not None:
            return True
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
            if self.metrics is not None and tokens:
                self.metrics.first_token(now - self.job.arrived)
        elif self.metrics is not None and tokens:
            self.metrics.later_tokens(now - self.last_token_time, len(tokens))
        if tokens:
            self.last_token_time = now
        self.generated += len(tokens)
        self.job.generated = self.generated  # (the request log's line)
        if logprobs:
            self.job.put(Logprobs([self._entry(lp) for lp in logprobs[: len(tokens)]]))
        self._put(self.stream.add(tokens))
        if self.stream.stopped or (tokens and tokens[-1] in self.eos):
            self.finish_reason = "stop"
        elif self.generated >= self.job.request.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _token(self, token: int, logprob: float) -> dict:
        text = self.stream.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _entry(self, lp) -> dict:
        return {**self._token(lp.token, lp.logprob), "top_logprobs": [self._token(t, v) for t, v in lp.top]}

    def _put(self, text: str, last: bool = False, truncated: bool = False) -> None:
        """Text on its way out: split (reasoning, content, calls) when the request has an answer spec; last: the
        answer ended (truncated: at its token limit, so a call still open was never finished)."""
        if self.splitter is None:
            if text:
                self.job.put(Text("content", text))
            return
        for event in self.splitter.feed(text) if text else []:
            self.job.put(event)
        if last:
            for event in self.splitter.finish(truncated=truncated):
                self.job.put(event)

    def finish(self, speculation: dict, reason: str | None = None, cached_tokens: int = 0) -> None:
        reason = reason or self.finish_reason or "length"
        self._put(self.stream.finish() if not self.stream.stopped else "", last=True, truncated=reason == "length")
        if reason == "stop" and self.splitter is not None and self.splitter.made_calls:
            reason = "tool_calls"
        self.job.put(Done(reason, len(self.job.request.prompt), self.generated, speculation,
                          self.stream.matched if self.stream.stopped else None, cached_tokens))


def marker_ids(tokenizer, answer) -> frozenset[int]:
    """Ids of the special tokens whose text the splitter reads (`<think>`, `<tool_call>`, DeepSeek's call
    markers, every marker a format lists): kept in the text, where every other special token is dropped."""
    from .turn import marker_texts

    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = inner.get_vocab() if hasattr(inner, "get_vocab") else {}
    out = set()
    for m in marker_texts(answer):
        if m in vocab:
            out.add(vocab[m])
        elif hasattr(inner, "encode"):  # a marker of several tokens (Gemma 4's `<|channel>thought`): its tokens
            out.update(inner.encode(m, add_special_tokens=False))
    return frozenset(out)


def speculation(drafted: int, accepted: int, cycles: int, generated: int, decode_time: float, drafter: str | None,
                forced: int = 0, forced_accepted: int = 0) -> dict:
    """The extra `speculation` field of a response: what drafting did for this request (`forced`: tokens its
    grammar drafted, counted apart from the drafter's)."""
    return {
        "drafter": drafter or "none",
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
        "verify_passes": cycles,
        "tokens_per_verify": round((generated - 1) / cycles, 4) if cycles else 0.0,
        "decode_tps": round((generated - 1) / decode_time, 2) if decode_time > 0 else 0.0,
        "forced": forced,
        "forced_accepted": forced_accepted,
    }
