"""Command-line parsing shared by every command (generate, convert, train-mtp, the bench, the chat).

Bad input gives ONE line, `error: ...` naming the flag and the value, and exit status 2 (argparse's own
format prints the usage block first). The `type=` helpers below check values the way the commands need
them: finite numbers, counts >= 1, comma-separated lists.
"""

from __future__ import annotations

import argparse
import math
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: `error: argument --ks: ... (see PROG --help)`, exit status 2."""

    def error(self, message: str):  # noqa: D102  (argparse's hook)
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (flags without a default or help are left alone)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _number(text: str, kind, what: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def count(minimum: int = 1):
    """An integer >= minimum."""

    def parse(text: str) -> int:
        value = _number(text, int, f"an integer >= {minimum}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def finite(minimum: float | None = None):
    """A finite float (nan and inf refused), >= minimum when given."""
    what = "a finite number" + (f" >= {minimum:g}" if minimum is not None else "")

    def parse(text: str) -> float:
        value = _number(text, float, what)
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


def int_list(minimum: int = 1):
    """Comma-separated integers, each >= minimum: "1,2,3" -> [1, 2, 3]."""

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {minimum}, got {text!r}")
        try:
            return [count(minimum)(t) for t in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= {minimum}, got {text!r}") from None

    parse.__name__ = "integer list"
    return parse


def float_list(minimum: float | None = None):
    """Comma-separated finite numbers, each >= minimum: "0,0.7" -> [0.0, 0.7]."""
    what = "comma-separated finite numbers" + (f" >= {minimum:g}" if minimum is not None else "")

    def parse(text: str) -> list[float]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        try:
            return [finite(minimum)(t) for t in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    parse.__name__ = "number list"
    return parse


def fail(message: str) -> int:
    """Report bad input found after parsing (a missing file, a model that does not load): exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_main(parser, run, argv, errors: tuple) -> int:
    """A command's main: parse argv (--help or a bad flag: argparse's exit status and its one `error:`
    line), then run(args); an exception of `errors` (bad input met after parsing: a missing file, a model
    that does not load) is one `error:` line and exit status 2, no traceback."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    try:
        return run(args)
    except errors as e:
        return fail(str(e))


INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)


def interrupted() -> int:
    """Ctrl-C: no traceback, the shell's status 130."""
    print("\ninterrupted", file=sys.stderr, flush=True)
    return INTERRUPTED

