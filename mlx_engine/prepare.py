"""What the commands share to set up a model and its drafter: the memory flags, --num-draft, the drafter, the
grammar, loading within a memory budget, and the usage error every command reports as one line. The
commands (generate in cli.py, serve, the chat in app/) import it; it imports the engine's floor and below."""

import argparse

import mlx.core as mx

from .core.memory import MemoryBudget, MemoryBudgetError, device_memory, parse_size
from .drafters import registry
from .drafters.registry import DrafterError, DrafterOptions
from .models import LoadedModel, load, parameter_bytes
from .target_model.cache import KV_BITS, KV_GROUP_SIZES


class UsageError(ValueError):
    """Bad input from the command line; reported as `error: ...` with exit status 2."""


def size(text: str, allow_zero: bool = False) -> int:
    """A memory size: 16GB, 512MiB, 1.5g or bytes."""
    try:
        return parse_size(text, allow_zero)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_or_zero(text: str) -> int:
    """A memory size, or 0 (off)."""
    return size(text, allow_zero=True)


size.__name__ = size_or_zero.__name__ = "size"


def add_memory_args(p: argparse.ArgumentParser, prefix_cache: bool = False) -> None:
    """--kv-bits, --kv-group-size, --draft-kv-bits, --max-memory (and the prefix cache's budget for the
    commands that serve several prompts): the same flags for generate, serve and the chat."""
    p.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None,
                   help="quantize the target's KV cache to this many bits (default: full precision); decoding then "
                        "runs batch invariant unless --no-batch-invariant (a float-level difference flips a "
                        "quantization code), so speculative output equals plain decoding with the same cache")
    p.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=64,
                   help="values per quantization group of the KV cache (default 64; must divide the head dimension)")
    p.add_argument("--draft-kv-bits", type=int, choices=KV_BITS, default=None,
                   help="quantize the drafter's own KV cache (a draft model's, an MTP or EAGLE-3 head's) separately "
                        "from the target's (default: full precision)")
    p.add_argument("--max-memory", type=size, default=None, metavar="SIZE",
                   help="memory budget for weights + KV caches, e.g. 12GB (default: MLX's memory limit for this "
                        "device); what does not fit is refused with a message instead of swapping")
    if prefix_cache:
        p.add_argument("--prefix-cache", type=size_or_zero, default=None, metavar="SIZE",
                       help="memory for cached prompt prefixes shared across requests (default: a tenth of the "
                            "memory budget; 0 = off)")
        add_disk_args(p)


def add_disk_args(p: argparse.ArgumentParser, default_on: bool = True) -> None:
    """The prefix cache's disk tier: --prefix-cache-dir, --no-prefix-cache-dir, --prefix-cache-disk."""
    from .core.disk_prefix import default_folder

    p.add_argument("--prefix-cache-dir", default=str(default_folder()) if default_on else None, metavar="DIR",
                   help="keep cached prompt prefixes on disk too, in DIR, so a restart does not prefill an agent's "
                        f"prompt again (default: {default_folder()}"
                        f"{'' if default_on else ', with this flag'}; MLX_ENGINE_CACHE_DIR moves it)")
    p.add_argument("--no-prefix-cache-dir", dest="prefix_cache_dir", action="store_const", const=None,
                   help="keep cached prefixes in RAM only")
    p.add_argument("--prefix-cache-disk", type=size, default=None, metavar="SIZE",
                   help="bytes the prefix cache may keep on disk, least recently used first (default 16 GiB, at "
                        "most a quarter of the disk's free space at start)")


def parse_num_draft(text) -> int | str:
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"--num-draft must be an integer >= 0 or 'auto', got {text!r}") from None
    if k < 0:
        raise UsageError(f"--num-draft must be >= 0, got {k}")
    return k


def make_drafter(args, target: LoadedModel):
    opts = DrafterOptions(draft_model=args.draft_model, draft_vocab_subset=getattr(args, "draft_vocab_subset", None),
                          mtp_weights=getattr(args, "mtp_weights", None), eagle3=getattr(args, "eagle3", None),
                          dflash=getattr(args, "dflash", None), assistant=getattr(args, "assistant", None))
    try:
        return registry.make_drafter(args.drafter, target, opts)
    except DrafterError as e:
        raise UsageError(str(e)) from None


def grammar_of(args, loaded: LoadedModel):
    """--grammar compiled against the model's tokenizer (None without the flag)."""
    if getattr(args, "grammar", None) is None:
        return None
    if args.ignore_eos:
        raise UsageError("--grammar ends the answer where its text is complete: drop --ignore-eos")
    from .grammar import GrammarError, grammar_tokenizer
    from .grammar.requests import from_flag

    try:
        eos = list(getattr(loaded.tokenizer, "eos_token_ids", None) or ())
        return from_flag(args.grammar, grammar_tokenizer(loaded.tokenizer, loaded.vocab_size, eos))
    except (GrammarError, ValueError) as e:
        raise UsageError(f"--grammar: {e}" if not str(e).startswith("--grammar") else str(e)) from None


def load_within_budget(model: str | None, max_memory: int | None) -> LoadedModel:
    """Load a model, its weights counted against the memory budget before they are read (lazily loaded
    folders; a GGUF is decoded whole first)."""
    loaded = load(model, lazy=True)
    budget = MemoryBudget(max_memory or device_memory(), parameter_bytes(loaded.model), 0, what=loaded.path.name)
    try:
        budget.check_load()
    except MemoryBudgetError as e:
        raise UsageError(str(e)) from None
    mx.eval(loaded.model.parameters())
    return loaded
