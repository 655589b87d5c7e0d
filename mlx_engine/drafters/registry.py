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
    eagle3: str | None = None  # --drafter eagle3: an EAGLE-3 checkpoint folder (HF layout)
    dflash: str | None = None  # --drafter dflash: a DFlash checkpoint folder (z-lab layout)
    assistant: str | None = None  # --drafter gemma4-assistant: a Gemma 4 assistant checkpoint folder

    @classmethod
    def for_kind(cls, kind: str, path: str | None, **kw) -> "DrafterOptions":
        """Options where one path names the drafter's checkpoint (the chat's one 'draft model' field): a
        draft model, an MTP head file or hub:OWNER/NAME, or a drafter checkpoint folder or hub repository."""
        field_name = PATH_FIELDS.get(kind.split("+")[-1])
        return cls(**{**kw, **({field_name: path} if field_name and path else {})})


PATH_FIELDS = {"draft": "draft_model", "mtp": "mtp_weights", "mtp-tree": "mtp_weights", "eagle3": "eagle3",
               "dflash": "dflash",
               "gemma4-assistant": "assistant"}  # kind -> the option its one path fills


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
    from ..target_model.model import Target

    return Target(loaded.model).vocab_size


def _ngram(opts: DrafterOptions, loaded) -> Drafter:
    from .ngram import NgramDrafter

    return NgramDrafter()


def _suffix(opts: DrafterOptions, loaded) -> Drafter:
    from .suffix import SuffixDrafter

    return SuffixDrafter()  # over the process's shared suffix cache (drafters/suffix_cache.py)


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


def _mtp_tree(opts: DrafterOptions, loaded) -> Drafter:
    from .mtp_tree import MTPTreeDrafter

    return MTPTreeDrafter.of(_mtp(opts, loaded))  # the head's top-k guesses as a token tree


def checkpoint_folder(value: str, flag: str) -> str:
    """A drafter's checkpoint folder as given, or a hub repository (hub:OWNER/NAME[@REV], or OWNER/NAME
    when no such folder exists) fetched whole into huggingface_hub's cache (drafter repos are small)."""
    from ..models.hub import HubError, fetch_repo, hub_ref

    try:
        ref = hub_ref(value)
        if ref is None:
            return value
        if ref.repo is None:
            raise DrafterError(f"{flag} hub: name the repository, hub:OWNER/NAME")
        return str(fetch_repo(ref, f"the {flag[2:]} checkpoint"))
    except HubError as e:
        where = "" if str(value).startswith("hub:") else f"no folder {value}, and "
        raise DrafterError(f"{flag} {value}: {where}{e}") from None


def _eagle3(opts: DrafterOptions, loaded) -> Drafter:
    from .eagle3 import Eagle3Error, load_eagle3_drafter

    if not opts.eagle3:
        raise DrafterError("--drafter eagle3 needs --eagle3 PATH (an EAGLE-3 checkpoint folder)")
    folder = checkpoint_folder(opts.eagle3, "--eagle3")
    try:
        return load_eagle3_drafter(folder, loaded.model)
    except (Eagle3Error, OSError) as e:
        raise DrafterError(f"--eagle3: {e}") from None


def _dflash(opts: DrafterOptions, loaded) -> Drafter:
    from .dflash import DFlashDrafter, DFlashError, load_dflash

    if not opts.dflash:
        raise DrafterError("--drafter dflash needs --dflash PATH (a DFlash checkpoint folder)")
    folder = checkpoint_folder(opts.dflash, "--dflash")
    try:
        return DFlashDrafter(load_dflash(folder), loaded.model)
    except (DFlashError, OSError, KeyError) as e:
        raise DrafterError(f"--dflash {opts.dflash}: {e}") from None


def _gemma4_assistant(opts: DrafterOptions, loaded) -> Drafter:
    from .gemma4_assistant import Gemma4AssistantDrafter, load_assistant

    if not opts.assistant:
        raise DrafterError("--drafter gemma4-assistant needs --assistant PATH (a Gemma 4 assistant checkpoint folder)")
    folder = checkpoint_folder(opts.assistant, "--assistant")
    try:
        return Gemma4AssistantDrafter(load_assistant(folder), loaded.model)
    except (ValueError, OSError, KeyError) as e:
        raise DrafterError(f"--assistant {opts.assistant}: {e}") from None


BUILDERS: dict[str, Callable[[DrafterOptions, object], Drafter]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft": _draft,
    "mtp": _mtp,
    "mtp-tree": _mtp_tree,
    "eagle3": _eagle3,
    "dflash": _dflash,
    "gemma4-assistant": _gemma4_assistant,
}


def _chain(model_kind: str, lookup: str = "ngram") -> Callable[[DrafterOptions, object], Drafter]:
    def build(opts: DrafterOptions, loaded) -> Drafter:
        from .chain import ChainDrafter

        return ChainDrafter(BUILDERS[model_kind](opts, loaded), BUILDERS[lookup](opts, loaded))

    return build


# chains: the n-gram (or suffix) draft when the context has a match, the model drafter otherwise (drafters/chain.py)
CHAINS = {f"ngram+{m}": _chain(m) for m in ("mtp", "eagle3")} | {"suffix+mtp": _chain("mtp", "suffix")}
BUILDERS.update(CHAINS)
KINDS = ("none", *BUILDERS)


def make_drafter(kind: str, loaded, opts: DrafterOptions | None = None) -> Drafter | None:
    """The drafter `kind` for the loaded target (None for 'none'). Options of another kind are refused."""
    opts = opts or DrafterOptions()
    if kind not in KINDS:
        raise DrafterError(f"unknown drafter {kind!r}; choose one of {', '.join(KINDS)}")
    if kind != "draft" and opts.draft_model:  # (chains take the options of their model drafter)
        raise DrafterError("--draft-model is only used with --drafter draft")
    if kind != "draft" and opts.draft_vocab_subset:
        raise DrafterError("--draft-vocab-subset is only used with --drafter draft")
    for field_name, owner in (("eagle3", "eagle3"), ("dflash", "dflash"), ("assistant", "gemma4-assistant")):
        if getattr(opts, field_name) and owner not in kind.split("+"):
            raise DrafterError(f"--{field_name} is only used with --drafter {owner}"
                               + (" (or a chain with it)" if owner == "eagle3" else ""))
    return None if kind == "none" else BUILDERS[kind](opts, loaded)
