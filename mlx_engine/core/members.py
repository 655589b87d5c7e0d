"""Who drafts each cycle, and by which draft-length policy.

A drafter may name, before each cycle, which of its members drafts (`next_member()`; a chain: "ngram"
when the context has a match, else its model drafter) or that none has a draft now (None: prompt lookup
without a match), decided on the host from the committed tokens. Under `auto`, every member of a chain
other than its `primary` keeps its own adaptive policy (acceptance, costs and k), so prompt lookup drafts
long where the text copies while the model drafter keeps its own short k, or stops where it does not pay.
"""

from .policy import FixedPolicy

DEFAULT_MAX_K = 8


def settings(drafter, max_draft: int | None = None, member: str | None = None) -> dict:
    """The adaptive policy's settings for a drafter: 8 drafts at most, and the drafter's own
    `policy_settings` (prompt lookup: up to 16, its first burst at 16, since its drafts cost nothing on
    the device), then those of the member (`member_settings[member]`: a long n-gram match's prior);
    `max_draft` caps them all."""
    out = {"max_k": DEFAULT_MAX_K, **getattr(drafter, "policy_settings", {}),
           **getattr(drafter, "member_settings", {}).get(member, {})}
    if max_draft:
        out["max_k"] = max_draft
    if "bootstrap_k" in out:
        out["bootstrap_k"] = min(out["bootstrap_k"], out["max_k"])
    return out


def next_member(drafter) -> str | None:
    """Who drafts the next cycle: a member's name, the drafter's own, or None (no drafter or no draft)."""
    if drafter is None:
        return None
    return drafter.next_member() if hasattr(drafter, "next_member") else drafter.name


def policies(drafter, policy, own: dict, num_draft, max_draft: int | None = None) -> tuple:
    """(the policy of this generation, {member: its own policy}). `own` holds the members' policies across
    generations and is filled here. Only under `auto`, and only when `policy` can make one (`for_member`):
    a replaced engine policy without it serves every member (the chat's live one has it: each member's
    own policy under the same live controls)."""
    if drafter is None or num_draft != "auto":
        return FixedPolicy(0 if drafter is None else num_draft), {}
    if not hasattr(policy, "for_member"):
        return policy, {}
    primary = getattr(drafter, "primary", None)
    for name, member in getattr(drafter, "members", {}).items():
        if name != primary and name not in own:
            own[name] = policy.for_member(**settings(member, max_draft, name))
    return policy, own


def observe_plain(policy, default, own: dict, seconds: float, tokens: int) -> None:
    """`policy` asked for a plain stretch of `tokens` tokens that took `seconds`. A plain token costs the
    same whichever member's policy timed it, so every policy of the generation takes the new measure: a
    member's policy then never spends a plain stretch of its own timing it (prompt lookup's first burst
    would be followed by 8 plain tokens in the middle of a copy)."""
    policy.observe(0, 0, seconds, tokens=tokens)
    cost = getattr(_adaptive(policy), "cost", {}).get(0)
    if cost is not None:
        for other in (default, *own.values()):
            if isinstance(getattr(_adaptive(other), "cost", None), dict):
                _adaptive(other).cost[0] = cost


def _adaptive(policy):
    return getattr(policy, "inner", None) or policy  # the chat's live policy wraps the adaptive one


def begin(policy, own: dict, regime) -> None:
    """A new generation for the policy and each member's own."""
    for p in {id(p): p for p in (policy, *own.values())}.values():
        p.begin(regime)
