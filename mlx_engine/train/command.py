"""What every trainer's command does around its training: parse the flags, do nothing for --steps 0, and
report bad input (a flag, a file, a model) as one `error:` line with exit status 2, no traceback."""

from __future__ import annotations

from ..args import run_main
from ..models import ModelLoadError
from .corpus import log
from .inputs import TrainInputError


def run_trainer(parser, train, argv, nothing: str) -> int:
    """`train(args)` for the parsed `argv`; `nothing`: what --steps 0 leaves undone, as the log says it."""

    def run(args) -> int:
        if args.steps == 0:
            log(f"--steps 0: nothing to train ({nothing})")
            return 0
        return train(args)

    return run_main(parser, run, argv, (TrainInputError, ModelLoadError))
