"""Prompt lookup: draft the continuation of the earlier occurrence that shares the longest suffix with
the committed tokens.

The match rule: among earlier positions whose last `min_ngram` tokens equal the context's last
`min_ngram`, take the one whose backward match with the context's end is longest (compared up to
`max_ngram` tokens), the most recent one on a tie. A longer match predicts acceptance: on the edit suite
(SmolLM2-135M, greedy, offline over its outputs) a 1-token match had its first token accepted 15% of
the time, a 2-token match 40%, 3 or more ~80%, with 7-10 tokens accepted on average. The longest match also keeps the alignment with the
copied source across cycles: after a full accept the aligned occurrence matches further back than any
recent repeat of a few tokens (a "most recent n-gram" rule jumps to those).

A continuation that runs into the end of the context repeats with the period of the match.

No match, no draft: `next_member()` is None and the engine decodes plainly until one appears, without a
verify pass and without telling the draft-length policy (its statistics are those of matched drafts).

Two members, one per class of match, so that under `auto` each keeps its own acceptance and k: "ngram"
(a match shorter than `long_match`) and "ngram:long". While the output copies its source, each full accept
lengthens the match by k + 1, and those continuations are accepted almost whole; a short match (just
after an edit, a repeated phrase) is mostly rejected early. Traced on the edit suite (SmolLM2-135M,
greedy, 128 tokens, 12 prompts): drafts after a 2-4-token match kept 1.4-2.4 tokens of ~8, after a
9-12-token match ~6 of ~8 (68% whole); one policy over both settled at k ~ 5 for both.
"""

import mlx.core as mx

from ..sampling import SamplingConfig
from .base import Draft, Verdict


class NgramDrafter:
    name = "ngram"
    needs_hidden = False
    # the adaptive policy's settings (core/members.py): drafts of up to 16 (a verify of 17 tokens of a small
    # model costs ~2 steps on a CPU), its first burst at 16: drafts cost nothing on the device, so one
    # burst measures every position at once
    policy_settings = {"max_k": 16, "bootstrap_k": 16}
    # a long match's continuation is accepted almost whole (above: ~0.97 per position): its policy starts
    # from that prior, so the few long-match cycles of an answer are not spent climbing from 0.5
    long_name = "ngram:long"
    member_settings = {long_name: {"prior_acceptance": 0.9}}

    def __init__(self, min_ngram: int = 2, max_ngram: int = 64, max_candidates: int = 256, long_match: int = 8):
        """min_ngram: fewest matching tokens that make a draft; max_ngram: longest backward match compared
        (longer ones tie, the most recent wins); max_candidates: most recent occurrences examined;
        long_match: the match length from which a draft belongs to the "ngram:long" member."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if long_match < min_ngram:
            raise ValueError(f"need long_match >= min_ngram, got {long_match} < {min_ngram}")
        self.min_ngram, self.max_ngram, self.max_candidates = min_ngram, max_ngram, max_candidates
        self.long_match = long_match
        self.members = {self.name: self, self.long_name: self}  # each class of match has its own policy
        self.primary = self.name  # the engine's own policy serves short matches
        self.tokens: list[int] = []
        self.index: dict[tuple, list[int]] = {}  # min_ngram-gram -> end positions with a successor, in order
        self._indexed = 0
        self._match: tuple[int, tuple[int, int] | None] = (-1, None)  # (len(tokens), (end, length)) cached

    def begin(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        self.tokens = list(tokens)
        self.index = {}
        self._indexed = 0
        self._match = (-1, None)

    def _update_index(self) -> None:
        # index the n-grams ending at positions that already have a successor token
        n, toks = self.min_ngram, self.tokens
        for end in range(max(self._indexed, n - 1), len(toks) - 1):
            self.index.setdefault(tuple(toks[end + 1 - n : end + 1]), []).append(end)
        self._indexed = max(self._indexed, len(toks) - 1)

    def match(self) -> tuple[int, int] | None:
        """(end, length): the earlier occurrence ending at `end` whose backward match with the context's
        end is longest (`length` tokens, at least min_ngram); None when there is none."""
        toks = self.tokens
        if self._match[0] == len(toks):
            return self._match[1]
        self._update_index()
        found = None
        if len(toks) > self.min_ngram:
            last, best = len(toks) - 1, 0
            for end in reversed(self.index.get(tuple(toks[-self.min_ngram :]), [])[-self.max_candidates :]):
                m = self.min_ngram
                while m < self.max_ngram and end - m >= 0 and toks[end - m] == toks[last - m]:
                    m += 1
                if m > best:  # strictly longer: on a tie the more recent (seen first) stays
                    found, best = (end, m), m
                    if m == self.max_ngram:
                        break
        self._match = (len(toks), found)
        return found

    def lookup(self, k: int) -> list[int]:
        """The k tokens after the match. A continuation that reaches the end of the context goes on with
        the same period (text that repeats every p tokens is predicted to keep repeating: a loop, a list of
        like lines) instead of stopping at the end."""
        found = self.match() if k > 0 else None
        if not found:
            return []
        toks, start = self.tokens, found[0] + 1
        out = toks[start : start + k]
        while len(out) < k:  # out[j] = context[start + j], the context extended by the draft itself
            out.append(out[start + len(out) - len(toks)])
        return out

    def next_member(self) -> str | None:
        """Who drafts the next cycle: "ngram" or "ngram:long" by the match's length, None without a match."""
        found = self.match()
        if not found:
            return None
        return self.long_name if found[1] >= self.long_match else self.name

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        found = self.lookup(k)
        return Draft(mx.array(found, dtype=mx.int32), None, host_tokens=found)

    def commit(self, verdict: Verdict, hidden: mx.array | None = None) -> None:
        self.tokens += verdict.tokens

    def max_draft(self) -> int | None:
        return None
