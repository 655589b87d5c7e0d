"""`python -m mlx_engine COMMAND ...`"""

import sys

from . import cli
from ._version import __version__
from .args import ArgumentParser, interrupted


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m mlx_engine", description="Lossless speculative decoding on MLX.")
    parser.add_argument("--version", action="version", version=f"mlx-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_generate_args(sub.add_parser("generate", help="generate text with (or without) speculative decoding"))
    conv = sub.add_parser("convert", help="convert a model to MLX, keeping its MTP head (or adding one)")
    conv.add_argument("--hf-path", help="HF-layout or MLX folder, or hub repo id (default: the embedded "
                                        "SmolLM2-135M-Instruct, with its trained head)")
    conv.add_argument("--mlx-path", required=True,
                      help="output folder (must not exist); with --mtp-from and no --hf-path, an existing MLX "
                           "conversion to add the head to")
    conv.add_argument("-q", "--quantize", action="store_true", help="quantize the target")
    conv.add_argument("--q-bits", type=int, default=4, help="bits for the quantized target: 2, 3, 4, 5, 6, 8 (default 4)")
    conv.add_argument("--q-group-size", type=int, default=64, help="quantization group size: 32, 64, 128 (default 64)")
    conv.add_argument("--mtp-bits", type=int, default=None,
                      help="bits for the MTP head (default: 8 when the target is quantized, else float; 0 keeps it float)")
    conv.add_argument("--mtp-from", metavar="REPO_OR_PATH",
                      help="take the head from another checkpoint: hub:OWNER/NAME (downloads only the shards that "
                           "hold it), a folder, or a head file")
    conv.add_argument("--allow-missing-head", action="store_true",
                      help="convert a model whose family has MTP heads even when its checkpoint holds none")
    from .serve.main import add_serve_args

    add_serve_args(sub.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding, "
                                                "several clients decoded together (see --help)"))
    from .cache_command import add_cache_args

    add_cache_args(sub.add_parser("cache", help="list or clear the prefix cache's entries on disk"))
    from .launch.command import add_launch_args

    add_launch_args(sub.add_parser("launch", help="start a coding agent (claude, codex, opencode, qwen, aider) on "
                                                  "this server, configured for it for this run only (see --help)"))
    sub.add_parser("train-mtp", help="train an MTP head for a model that ships none (see --help)", add_help=False)
    sub.add_parser("train-eagle3", help="train an EAGLE-3 head for a model (see --help)", add_help=False)
    sub.add_parser("train-dflash", help="train a DFlash block drafter for a model (see --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["train-mtp"], ["train-eagle3"], ["train-dflash"]):
        if argv[0] == "train-mtp":
            from .train.mtp import main as train_main
        elif argv[0] == "train-eagle3":
            from .train.eagle3 import main as train_main
        else:
            from .train.dflash import main as train_main

        try:
            return train_main(argv[1:])
        except KeyboardInterrupt:  # the last checkpoint and the corpus saved so far stay: --resume
            return interrupted()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2, one `error:` line printed): a status, not an exception
        return e.code
    try:
        if args.command == "generate":
            return cli.run_generate(args)
        if args.command == "convert":
            return cli.run_convert(args)
        if args.command == "serve":
            from .serve.main import run_serve

            return run_serve(args)
        if args.command == "cache":
            from .cache_command import run_cache

            return run_cache(args)
        if args.command == "launch":
            from .launch.command import run_launch

            return run_launch(args)
    except cli.ERRORS as e:
        return cli.report_error(e)
    except KeyboardInterrupt:  # Ctrl-C: what was generated stays printed; no traceback
        return interrupted()
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before a command's own handler (while loading, in train-mtp)
        sys.exit(interrupted())
