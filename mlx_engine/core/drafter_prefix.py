"""The drafter's share of the prefix tree: a row's drafter state stored with its target entries when the
row leaves, and handed back to the drafter of a later row that starts from them, so a prefix-cache hit
re-feeds neither the target nor the drafter (an agent's next turn: without it an MTP head was fed the whole
8k-token conversation again, a minute here).

Drafters that keep it say so with `keepable()`, `prefix_states()` (their entries in the tree's position
frame, and how many positions they cover) and `restore(states, n)` (after `begin`: the first n positions'
entries, not fed again): the MTP heads (EAGLE-3 included: the same slots), a draft model, a chain of
either with prompt lookup (whose index is rebuilt from the tokens), DFlash (its context rows). Prompt lookup
and suffix drafters feed nothing on the device (their index is rebuilt from the tokens on the host). A
drafter fed on the device without these (or a sliding-window head) is fed the prompt again; `why_not`
says so for /health.
"""

from __future__ import annotations


def why_not(drafter) -> str | None:
    """None when `drafter`'s state can go to the prefix tree (or it has none to keep), else why not."""
    if drafter is None:
        return None
    keep = getattr(drafter, "keepable", None)
    if keep is None and not hasattr(drafter, "prefill_pending"):
        return None  # nothing is fed on the device (prompt lookup, suffix): rebuilt from the tokens on the host
    if keep is None:
        return f"the {drafter.name} drafter does not keep its state in the prefix tree (fed the prompt again on a hit)"
    if not keep():
        return f"the {drafter.name} drafter's cache is not a function of a prefix alone (a sliding window)"
    return None


def row_states(engine, s) -> tuple[list, int] | None:
    """Row s's drafter state in the tree's frame between steps: (per-layer states, positions), or None."""
    if engine.drafter_kept is not None:
        return None
    if engine.batched is not None and s in engine.adopted:
        return engine.batched.row_prefix_states(engine.adopted.index(s))
    p = engine.prefills.joining.get(s.id)
    drafter = p.drafter if p is not None else s.drafter
    if drafter is None or (p is not None and not p.sampled) or not hasattr(drafter, "prefix_states"):
        return None  # (prompt lookup and suffix drafters: nothing on the device to keep)
    return drafter.prefix_states()


def store(tree, fed: list[int], layers: list, hidden, drafter: tuple[list, int] | None,
          checkpoint: list | None = None) -> None:
    """A leaving row's entries of `fed` into the tree, with its drafter's for the positions they cover (and a
    recurrent model's checkpoint after all of them)."""
    if drafter is not None and drafter[1] > 0:
        states, n = drafter
        n = min(n, len(fed))
        tree.insert(fed[:n], layers, hidden[:n] if hidden is not None else None, drafter=states)
    tree.insert(fed, layers, hidden, checkpoint=checkpoint)
