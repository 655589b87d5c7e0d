"""Keepalives on a streamed answer: while a stream waits for its next event (queued, its prompt being
prefilled, a drafter's stage) runner.events hands the adapter KEEPALIVE after every `--keepalive` seconds of
silence, and the adapter writes it in its API's own form: an SSE comment line on the OpenAI routes (every SSE
parser skips it: the openai SDKs, undici's / eventsource-parser's, Codex's), Anthropic's `ping` event on
/v1/messages. A prompt that takes minutes to prefill then no longer leaves the connection silent past a
client's body timeout (undici's: 300 s), which would abort and resend it. Non-streamed answers are left as
they are: a JSON body cannot carry anything before it is whole."""

from __future__ import annotations

DEFAULT_SECONDS = 5.0  # "every few seconds": far under any client's idle timeout, a few bytes each
KEEPALIVE = object()  # the event runner.events yields after `every` seconds with none from the engine
SSE_COMMENT = ": keepalive\n\n"  # an SSE comment: no event for the client, bytes on the wire
