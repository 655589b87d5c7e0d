"""Who drafts each cycle, and by which draft-length policy.

A drafter may name, before each cycle, which of its members drafts (`next_member()`; a chain: "ngram"
when the context has a match, else its model drafter) or that none has a draft now (None: prompt lookup
without a match), decided on the host from the committed tokens. Under `auto`, every member of a chain
other than its `primary` keeps its own adaptive policy (acceptance, costs and k), so prompt lookup drafts
long where the text copies while the model drafter keeps its own short k, or stops where it does not pay.
"""

from .policy import FixedPolicy

DEFAULT_MAX_K = 8


def settings(drafter, max_draft: int | None = None) -> dict:
    """The adaptive policy's settings for a drafter: 8 drafts at most, and the drafter's own
    `policy_settings` (prompt lookup: up to 16, its first burst at 16, since its drafts cost nothing on
    the device); `max_draft` caps them all."""
    out = {"max_k": DEFAULT_MAX_K, **getattr(drafter, "policy_settings", {})}
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
    a replaced engine policy without it (the chat's live one) serves every member."""
    if drafter is None or num_draft != "auto":
        return FixedPolicy(0 if drafter is None else num_draft), {}
    if not hasattr(policy, "for_member"):
        return policy, {}
    primary = getattr(drafter, "primary", None)
    for name, member in getattr(drafter, "members", {}).items():
        if name != primary and name not in own:
            own[name] = policy.for_member(**settings(member, max_draft))
    return policy, own


def begin(policy, own: dict, regime) -> None:
    """A new generation for the policy and each member's own."""
    for p in {id(p): p for p in (policy, *own.values())}.values():
        p.begin(regime)
