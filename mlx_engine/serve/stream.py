"""Token ids -> the text a client reads: special tokens dropped, incomplete UTF-8 held back, and the
text cut before the first stop string (the part of a stop string that may be starting is held back too,
so a client never sees text that a later token turns into a stop)."""

from __future__ import annotations

from .. import text as text_ops


class TextStream:
    def __init__(self, tokenizer, special: frozenset[int], stop: list[str] | None = None, keep_special: bool = False):
        """special: the ids dropped from the text; keep_special: other special tokens (markers a splitter
        reads) are decoded as their text."""
        self.tokenizer = tokenizer
        self.special = special
        self.keep_special = keep_special
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text handed out so far
        self.stopped = False  # a stop string was found: the text ends before it
        self.matched: str | None = None  # which stop string (Anthropic's stop_sequence names it)

    def add(self, tokens: list[int]) -> str:
        """Take new token ids; return the text that can be sent now."""
        if self.stopped:
            return ""
        self.ids += text_ops.visible(tokens, self.special)
        self.text = text_ops.decode_visible(self.tokenizer, self.ids, keep_special=self.keep_special)
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(cut)
        safe = len(self.text)
        while safe > self.sent and self.text[safe - 1] == "\ufffd":  # an incomplete multi-byte character
            safe -= 1
        return self._take(max(self.sent, safe - self._partial_stop(self.text[:safe])))

    def finish(self) -> str:
        """The rest of the text at the end of the generation."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _find_stop(self) -> int | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best, self.matched = i, s
        return best

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return hold
