"""`python -m mlx_engine COMMAND ...`"""

import argparse
import sys

from . import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_engine", description="Lossless speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_generate_args(sub.add_parser("generate", help="generate text with (or without) speculative decoding"))
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cli.run_generate(args)
    except cli.ERRORS as e:
        return cli.report_error(e)
    return 1


if __name__ == "__main__":
    sys.exit(main())
