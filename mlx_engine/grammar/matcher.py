"""One sequence's grammar state: which tokens may come next, the tokens it forces, rollback.

A Matcher wraps llguidance's LLMatcher with the two things the engine needs beyond it:
- a reasoning gate: a reasoning model's answer is free text until its reasoning end marker (`</think>`);
  the grammar starts after the marker's last token, wherever it falls (in a draft too);
- end-of-answer tokens are never fed to llguidance (once a grammar is complete they are the only tokens
  it allows; the engine stops there), so rollback counts stay the engine's own.

Invariant kept by the engine: the matcher has consumed every emitted token (not the prompt). In a verify
cycle it is advanced through the draft's legal prefix while the masks are built (`masks`), then rolled
back to the accepted prefix and given the token that follows (`settle`): a rejected draft token never
stays in it.

Masks are llguidance's bitmasks: int32 words, bit j of word w allows token 32 w + j ([W] per row,
W = ceil(n_vocab / 32)); grammar/masks.py applies them to logits on the device.
"""

from __future__ import annotations

import time

import llguidance
import numpy as np


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow reached the matcher: a bug in the caller, never user input."""


class Matcher:
    def __init__(self, grammar, reasoning: bool = False):
        """grammar: grammar.spec.Grammar. reasoning: the answer starts inside the model's reasoning, so the
        grammar waits for `grammar.reasoning_end` (ignored when the grammar names none)."""
        self.grammar = grammar
        self._llg = llguidance.LLMatcher(grammar.tokenizer, grammar.source, log_level=0)
        if self._llg.is_error():
            raise GrammarViolation(self._llg.get_error())
        self.eos = frozenset(grammar.tokenizer.eos_tokens)
        self.marker = tuple(grammar.reasoning_end or ())
        self.tokens: list[int] = []  # every token consumed, in order
        self._fed: list[bool] = []  # whether each went to llguidance (not reasoning, not end-of-answer)
        self._start = None if (reasoning and self.marker) else 0  # index where the grammar begins; None: reasoning
        self.words = (grammar.tokenizer.vocab_size + 31) // 32
        self.seconds = 0.0  # host time spent computing masks, legal prefixes and forced runs (benches)
        # the mask of the state the matcher stands in, once computed ([1, W], read-only): a cycle asks for it
        # twice (a model drafter's first position, then the verify pass's first row); forgotten on any move
        self._here: np.ndarray | None = None

    # -- state ------------------------------------------------------------------------------------
    @property
    def reasoning(self) -> bool:
        """Still in the reasoning text: every token is allowed."""
        return self._start is None

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing but an end-of-answer token."""
        return not self.reasoning and self._llg.is_stopped()

    def consume(self, tokens) -> None:
        """Advance by emitted (or drafted, legal) tokens."""
        for t in tokens:
            self._here = None
            t = int(t)
            feed = not self.reasoning and t not in self.eos
            if feed and not self._llg.consume_token(t):
                raise GrammarViolation(f"token {t} is not allowed here: {self._llg.get_error()}")
            self.tokens.append(t)
            self._fed.append(feed)
            if self.reasoning and tuple(self.tokens[-len(self.marker):]) == self.marker:
                self._start = len(self.tokens)

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens (the reasoning gate reopens if its marker is forgotten)."""
        if n <= 0:
            return
        if n > len(self.tokens):
            raise ValueError(f"cannot roll back {n} of {len(self.tokens)} tokens")
        self._here = None
        fed = sum(self._fed[-n:])
        if fed and not self._llg.rollback(fed):
            raise GrammarViolation(f"rollback of {fed} tokens failed: {self._llg.get_error()}")
        del self.tokens[-n:], self._fed[-n:]
        if self._start is not None and len(self.tokens) < self._start:
            self._start = None

    # -- what may come next -----------------------------------------------------------------------
    def legal(self, tokens) -> int:
        """How many leading `tokens` the grammar allows from here (an end-of-answer token, when allowed,
        counts and ends the run: nothing after it is checked). The state is left as it was."""
        t0 = time.perf_counter()
        here = self._here  # the walk returns to this state: its mask still holds
        n, ended = 0, 0
        for t in tokens:
            t = int(t)
            if t in self.eos:
                ended = 1 if self.reasoning or self._llg.is_accepting() else 0
                break
            if not self.reasoning and self._llg.validate_tokens([t]) != 1:
                break
            self.consume([t])
            n += 1
        self.rollback(n)
        self._here = here
        self.seconds += time.perf_counter() - t0
        return n + ended

    def fill(self, out: np.ndarray) -> None:
        """The mask of the next token into `out` ([W] int32, C-contiguous)."""
        t0 = time.perf_counter()
        if self.reasoning:
            out[:] = -1
        else:
            self._llg.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self.seconds += time.perf_counter() - t0

    def fill_ended(self, out: np.ndarray) -> None:
        """The mask of a row after an end-of-answer token: end-of-answer tokens only (nothing after the end
        is emitted, and the matcher never sees anything but an end there)."""
        out[:] = 0
        words = out.view(np.uint32)
        for t in self.eos:
            words[t // 32] |= np.uint32(1 << (t % 32))

    def _fill_here(self, out: np.ndarray) -> None:
        """The mask of the state the matcher stands in into `out`: the one `mask` kept, if it did."""
        if self._here is not None:
            out[:] = self._here[0]
        else:
            self.fill(out)

    def mask(self) -> np.ndarray:
        """[1, W]: the mask of the next token (read-only: kept until the matcher moves)."""
        if self._here is None:
            out = np.empty((1, self.words), dtype=np.int32)
            self.fill(out[0])
            out.flags.writeable = False
            self._here = out
        return self._here

    def masks(self, draft) -> np.ndarray:
        """[len(draft) + 1, W]: row i the mask after draft[:i]. Consumes the draft (all of it must be legal:
        `legal` first); `settle` rolls back what the target rejects. An end-of-answer token ends the answer:
        the rows after it allow only end-of-answer tokens."""
        out = np.empty((len(draft) + 1, self.words), dtype=np.int32)
        ended = False
        for i, t in enumerate(draft):
            if ended:
                self.fill_ended(out[i])
                continue
            self._fill_here(out[i])
            self.consume([t])
            ended = int(t) in self.eos
        if ended:
            self.fill_ended(out[len(draft)])
        else:
            self._fill_here(out[len(draft)])
        return out

    def settle(self, drafted: int, kept: int, following: int) -> None:
        """After a verify pass over `drafted` consumed draft tokens: keep the first `kept`, then take the
        target's token that follows them."""
        self.rollback(drafted - kept)
        self.consume([following])

    def forced(self) -> list[int]:
        """The tokens the grammar drafts from here: the forced text as the model's tokenizer writes it, whole.

        llguidance's fast-forward tokens stop one short of the end of the forced text where its last token
        could merge with the free text after it (`"name": "` then the value: ` "` or ` "T`?; with a small
        vocabulary, ` ` + `[` before ` ["`, two tokens); forced TEXT is not forced TOKENS. Those held-back
        tokens are drafted here too, as a guess the target verifies like any draft: on the json suite the
        model writes the held-back token ~70% of the time (a rejected one costs a verify row, an accepted
        one a whole cycle). Nothing past the forced text is ever drafted."""
        if self.reasoning or self._llg.is_stopped():
            return []
        t0 = time.perf_counter()
        run = list(self._llg.compute_ff_tokens())
        whole = self.grammar.tokenizer.tokenize_bytes(self._llg.compute_ff_bytes())
        if len(whole) > len(run) and whole[: len(run)] == run:
            run = list(whole)
        self.seconds += time.perf_counter() - t0
        return run
