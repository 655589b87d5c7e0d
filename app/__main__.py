"""`python -m app [--model M] [--drafter none|draft|ngram|mtp|ngram+mtp|...] [--draft-model P] [--num-draft K|auto] [--temp T]`

Options given here override the saved settings for this run (settings.json in the config folder:
$MLX_ENGINE_CONFIG_DIR, else $XDG_CONFIG_HOME/mlx-engine, else ~/.config/mlx-engine).
"""

import argparse
import math

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
from mlx_engine.args import ArgumentParser, count
from mlx_engine.prepare import add_disk_args, add_memory_args

from .settings import DRAFTERS, Settings, settings_path


def num_draft_arg(value: str):
    if value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected an integer >= 1 or 'auto'") from None
    if not 1 <= k <= 16:
        raise argparse.ArgumentTypeError("expected 1..16 or 'auto'")
    return k


def temp_arg(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number >= 0") from None
    if not math.isfinite(t) or t < 0:
        raise argparse.ArgumentTypeError("expected a number >= 0")
    return t


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m app", description="mlx-engine chat: live draft acceptance and tok/s. Options "
                       "given here override the saved settings (" + str(settings_path()) + ") for this run.")
    p.add_argument("--model", help="hub id, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", choices=DRAFTERS, help="how drafts are made (default: saved setting, else ngram+mtp, falling back to ngram)")
    p.add_argument("--draft-model", help="the draft model for --drafter draft (same tokenizer as the target)")
    p.add_argument("--dflash", help="DFlash checkpoint folder (implies --drafter dflash)")
    p.add_argument("--assistant", help="Gemma 4 assistant checkpoint folder (implies --drafter gemma4-assistant)")
    p.add_argument("--num-draft", type=num_draft_arg,
                   help="tokens drafted per cycle (1..16), or 'auto' (default: saved setting, else auto)")
    p.add_argument("--temp", type=temp_arg, help="sampling temperature (default: saved setting, else 0 = greedy)")
    p.add_argument("--max-tokens", type=count(1), help="tokens per answer at most (default: saved setting, else 1024)")
    p.add_argument("--mtp-weights", help="the MTP head for an mtp drafter (ngram+mtp, mtp): a safetensors file, a folder "
                                        "with an index + head shards, or hub:OWNER/NAME (only the head's shards fetched)")
    add_memory_args(p)
    add_disk_args(p)  # (a prompt of an earlier session, a long system prompt, starts from disk)
    p.add_argument("--no-save", action="store_true", help="do not write settings.json")
    p.add_argument("--reset", action="store_true", help="ignore the saved settings (start from the defaults)")
    return p


def build_app(argv=None):
    from .app import AppOptions, ChatApp
    from .worker import EngineOptions

    args = parser().parse_args(argv)
    if args.mtp_weights and args.drafter is not None and not args.drafter.endswith("mtp"):
        parser().error(f"--mtp-weights goes with an mtp drafter (mtp, ngram+mtp), not --drafter {args.drafter}")
    for flag, kind in (("dflash", "dflash"), ("assistant", "gemma4-assistant")):  # one path field per drafter
        if getattr(args, flag):
            if args.draft_model or (args.drafter not in (None, kind)):
                parser().error(f"--{flag} goes with --drafter {kind} only (and without --draft-model)")
            args.drafter, args.draft_model = kind, getattr(args, flag)
    if args.mtp_weights:  # the one path field of the mtp kinds
        args.draft_model = args.mtp_weights
        args.drafter = args.drafter or "ngram+mtp"
    settings = Settings() if args.reset else Settings.load(settings_path())
    if args.drafter is not None and args.drafter != settings.drafter and args.draft_model is None:
        settings.draft_model = None  # a path saved for another kind of drafter is not this one's
    given = {"drafter": args.drafter or (args.draft_model and "draft"), "draft_model": args.draft_model,
             "num_draft": args.num_draft, "temperature": args.temp, "max_tokens": args.max_tokens}
    settings.restored = {k: v for k, v in settings.restored.items() if given.get(k) is None}  # overridden here
    if args.drafter is not None:
        settings.drafter = args.drafter
    if args.draft_model is not None:
        settings.draft_model = args.draft_model
        if args.drafter is None:
            settings.drafter = "draft"
    if args.num_draft is not None:
        settings.num_draft = args.num_draft
    if args.temp is not None:
        settings.temperature = args.temp
    if args.max_tokens is not None:
        settings.max_tokens = max(1, args.max_tokens)
    settings.__post_init__()
    engine = EngineOptions(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, draft_kv_bits=args.draft_kv_bits,
                           max_memory=args.max_memory, prefix_cache_dir=args.prefix_cache_dir,
                           prefix_disk_bytes=args.prefix_cache_disk)
    return ChatApp(settings, AppOptions(model=args.model, save_settings=not args.no_save, engine=engine))


def main(argv=None) -> None:
    build_app(argv).run()


if __name__ == "__main__":
    main()
