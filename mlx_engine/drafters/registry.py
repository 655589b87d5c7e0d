"""Every drafter kind by name: the one factory the CLI, the chat, the bench and the server build drafters
with. A new kind adds a builder to BUILDERS (and the options it reads to DrafterOptions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .base import Drafter


class DrafterError(ValueError):
    """A drafter that cannot be built from these options (reported as `error: ...`, never a traceback)."""


@dataclass
class DrafterOptions:
    draft_model: str | None = None  # --drafter draft: a model with the target's tokenizer
    draft_vocab_subset: str | None = None  # --drafter draft: safetensors with a 'vocab_subset' id array
    mtp_weights: str | None = None  # --drafter mtp: a head file (default: found beside the model)


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """Refuse a draft whose vocabulary maps tokens to other ids than the target's."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv:
        return
    differing = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:3]
    raise DrafterError(
        f"draft model {draft_name} has another vocabulary than the target "
        f"(target {len(tv)} tokens, draft {len(dv)} tokens; e.g. {differing}); "
        "a draft must share the target's tokenizer"
    )


def _vocab(loaded) -> int:
    from ..target.model import Target

    return Target(loaded.model).vocab_size


def _ngram(opts: DrafterOptions, loaded) -> Drafter:
    from .ngram import NgramDrafter

    return NgramDrafter()


def _draft(opts: DrafterOptions, loaded) -> Drafter:
    from ..models import load
    from .draft_model import DraftModelDrafter

    if not opts.draft_model:
        raise DrafterError("--drafter draft needs --draft-model PATH")
    draft = load(opts.draft_model)
    check_same_tokenizer(loaded.tokenizer, draft.tokenizer, opts.draft_model)
    vocab = _vocab(loaded)
    subset = None
    if opts.draft_vocab_subset:
        from .vocab_subset import load_vocab_subset

        try:
            subset = load_vocab_subset(opts.draft_vocab_subset, vocab)
        except (OSError, ValueError) as e:
            raise DrafterError(f"--draft-vocab-subset: {e}") from None
    return DraftModelDrafter(draft.model, vocab, vocab_subset=subset)


def _mtp(opts: DrafterOptions, loaded) -> Drafter:
    from .mtp import load_mtp_drafter

    return load_mtp_drafter(loaded.model, loaded.path, loaded.config, mtp_weights=opts.mtp_weights)


BUILDERS: dict[str, Callable[[DrafterOptions, object], Drafter]] = {
    "ngram": _ngram,
    "draft": _draft,
    "mtp": _mtp,
}
KINDS = ("none", *BUILDERS)


def make_drafter(kind: str, loaded, opts: DrafterOptions | None = None) -> Drafter | None:
    """The drafter `kind` for the loaded target (None for 'none'). Options of another kind are refused."""
    opts = opts or DrafterOptions()
    if kind not in KINDS:
        raise DrafterError(f"unknown drafter {kind!r}; choose one of {', '.join(KINDS)}")
    if kind != "draft" and opts.draft_model:
        raise DrafterError("--draft-model is only used with --drafter draft")
    if kind != "draft" and opts.draft_vocab_subset:
        raise DrafterError("--draft-vocab-subset is only used with --drafter draft")
    return None if kind == "none" else BUILDERS[kind](opts, loaded)
