"""What every trainer's command does around its training: parse the flags, do nothing for --steps 0, and
report bad input (a flag, a file, a model) as one `error:` line with exit status 2, no traceback."""

from __future__ import annotations

from ..args import fail
from ..models import ModelLoadError
from .corpus import log
from .inputs import TrainInputError


def run_trainer(parser, train, argv, nothing: str) -> int:
    """`train(args)` for the parsed `argv`; `nothing`: what --steps 0 leaves undone, as the log says it."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag (one `error:` line printed)
        return e.code
    if args.steps == 0:
        log(f"--steps 0: nothing to train ({nothing})")
        return 0
    try:
        return train(args)
    except (TrainInputError, ModelLoadError) as e:
        return fail(str(e))
