"""A tool-call stream reader (toolcalls.stream.reader_for, the Splitter) fed text cut at given places, its events
merged as an OpenAI client merges deltas: every family's reader tests read answers through this one helper."""

from __future__ import annotations

from mlx_engine.toolcalls.stream import CallArgs, CallStart, Text


def fed(reader, text: str, cuts=(), truncated: bool = False) -> list:
    """The events of `text` fed in pieces cut at `cuts`, then the answer's end."""
    events, at = [], 0
    for c in sorted(cuts) + [len(text)]:
        events += reader.feed(text[at:c])
        at = c
    return events + reader.finish(truncated=truncated)


def merged(events: list) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(reasoning, content, [(name, arguments text, id)]): calls in order, each id given once, with its start."""
    out, calls = {"reasoning": "", "content": ""}, []
    for e in events:
        if isinstance(e, Text):
            out[e.kind] += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls) and e.id
            calls.append([e.name, "", e.id])
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.text
    return out["reasoning"], out["content"], [tuple(c) for c in calls]


def read(reader, text: str, cuts=(), truncated: bool = False) -> tuple[str, str, list[tuple[str, str, str]]]:
    """merged(fed(...)), and the reader's made_calls agreeing with the calls it handed out."""
    answer = merged(fed(reader, text, cuts, truncated))
    assert reader.made_calls == bool(answer[2])
    return answer
