"""How far a model draft is verified under a grammar: up to its first position the drafter was unsure of.

Under a grammar the host reads a model draft before the verify pass anyway (to cut it at its first token
the grammar forbids, core/engine.py `_legal`). A drafter that knows how sure it was at each position
(`Draft.confidence`: the largest probability of the distribution the token was chosen from) lets the same
read also drop the positions from the first one below `CONFIDENT`: a verify row costs a fraction of a
step whether its draft is accepted or not, and a draft position the drafter was unsure of is rarely
accepted.

Lossless at any temperature: the decision to verify position i depends on the drafter's own distribution
there (not on the target, nor on the token drawn from it), so each emitted token still follows the
target's distribution: a dropped position's token is drawn by the target from its own (masked)
distribution, as the bonus token. (A grammar's cut is different: it depends on the token drawn, so the
acceptance rule is given that token's q, `Draft.cut_probs`.)

The threshold, measured: on this CPU (2 cores, fp32 SmolLM2-135M, context ~500) a verify row costs ~20% of
a decode step (a cycle with one head draft verified 93 ms, the same cycle with the draft dropped 79 ms, a
plain step 69 ms; json suite, 3 prompts), so a position pays when its acceptance is above ~0.2. The shipped
MTP head at the json suite's free positions (530 held-out positions, its first token chosen among the
grammar's, acceptance by its confidence): [0, 0.2) 31% of positions, accepted 0.03; [0.2, 0.3) 10%, 0.11;
[0.3, 0.4) 13%, 0.20; [0.4, 0.5) 10%, 0.37; [0.5, 0.7) 10%, 0.44; [0.7, 1] 25%, 0.80. On a GPU a row costs a
few percent of a step, where positions down to ~0.2 would pay: 0.3 drops what loses here and gives up
~0.01 tokens a position there. Through the engine (json suite, 8 prompts, k = 1, one trial): threshold 0
0.926x the grammar's drafts alone, 0.25 0.950x, 0.4 0.980x (the head's own step, ~10 ms a cycle, is what
keeps it below 1 here).
"""

from __future__ import annotations

CONFIDENT = 0.3


def confident_prefix(confidence: list[float], threshold: float = CONFIDENT) -> int:
    """How many leading draft positions have confidence >= threshold."""
    for i, c in enumerate(confidence):
        if not c >= threshold:  # (a NaN is not confident)
            return i
    return len(confidence)
