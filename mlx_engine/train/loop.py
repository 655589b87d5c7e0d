"""The training loop every head trainer shares (train-mtp, train-eagle3): resume from a checkpoint, step
until --steps, --stop-after or --minutes (with --fit-minutes, until the schedule fitted to --minutes), log
and checkpoint on the way, keep a checkpoint on Ctrl-C. The trainer (mtp.Trainer or a subclass) does the
steps, the checkpoints and `refit`."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .corpus import log
from .inputs import TrainInputError


def resume_and_train(trainer, args, ckpt: Path, subset, t_start: float, announce) -> tuple[list, float]:
    """--resume from the checkpoint in `ckpt`, announce(), train to --steps, checkpoint on Ctrl-C and at the
    end. Returns (the loss history, seconds trained over every run)."""
    history, elapsed_before = [], 0.0
    if args.resume:
        if (ckpt / "state.json").is_file():
            try:
                st = trainer.load(ckpt)
            except (ValueError, KeyError) as e:  # another head's shapes, a missing array
                raise TrainInputError(f"--resume: the checkpoint in {ckpt} does not fit this head ({e})") from None
            history, elapsed_before = st.get("history", []), st.get("train_seconds", 0.0)
            log(f"resumed from {ckpt} at step {trainer.step}")
        else:
            log(f"no checkpoint in {ckpt}: starting from scratch")
    announce()

    def extra():
        return {"subset": None if subset is None else subset.tolist(), "history": history,
                "train_seconds": elapsed_before + (time.perf_counter() - t_train),
                "args": {k: v for k, v in vars(args).items() if k not in ("resume", "stop_after", "minutes")}}

    t_train = time.perf_counter()
    try:
        train_loop(trainer, args, ckpt, extra, history, t_start, t_train, trainer.step)
    except KeyboardInterrupt:  # keep what was trained: a checkpoint to --resume from
        trainer.save(ckpt, extra())
        log(f"interrupted at step {trainer.step}: checkpoint saved in {ckpt}; run the same command with --resume "
            f"to continue")
        raise
    trainer.save(ckpt, extra())
    return history, elapsed_before + (time.perf_counter() - t_train)


FIT_AFTER = 20  # steps timed (after the first, which compiles) before --fit-minutes fits the schedule
FIT_OVERRUN = 1.5  # a fitted run still stops at 1.5x --minutes (the machine slowed after the timing)


def fitted_steps(step: int, steps: int, per_step: float, seconds_left: float, margin: float = 0.95) -> int:
    """--fit-minutes: the total steps the rest of the budget holds at `per_step` seconds a step (`margin` of
    it, for the estimate's error and the head's writing), at least one more, never more than `steps`."""
    return min(steps, step + max(1, int(margin * max(seconds_left, 0.0) / per_step)))


def train_loop(trainer, args, ckpt: Path, extra, history: list, t_start: float, t_train: float,
               start_step: int) -> None:
    """Steps until --steps (or --stop-after, --minutes; with --fit-minutes, until the fitted --steps),
    logging and checkpointing on the way."""
    t_log, slots_log, acc = time.perf_counter(), 0.0, []
    fitting, t_first = bool(args.fit_minutes and args.minutes), None
    while trainer.step < args.steps:
        loss, agree, n = trainer.train_step()
        if fitting and trainer.step == start_step + 1:
            t_first = time.perf_counter()
        elif fitting and trainer.step == start_step + 1 + FIT_AFTER:
            now = time.perf_counter()
            fit = fitted_steps(trainer.step, args.steps, (now - t_first) / FIT_AFTER,
                               args.minutes * 60 - (now - t_start))
            if fit < args.steps:
                log(f"--fit-minutes: {args.steps} steps do not fit in {args.minutes} min; the schedule now "
                    f"ends at step {fit}")
                trainer.refit(fit)
            fitting = False  # fitted: the schedule's end is the run's end
        acc.append((loss, agree))
        slots_log += n
        s = trainer.step
        if s % args.log_every == 0 or s == args.steps:
            now = time.perf_counter()
            rate = slots_log / max(now - t_log, 1e-9)
            per_step = (now - t_train) / max(s - start_step, 1)
            eta = per_step * (args.steps - s)
            ml, ma = float(np.mean([a for a, _ in acc])), float(np.mean([b for _, b in acc]))
            history.append([s, round(ml, 4), round(ma, 4)])
            lr = float(trainer.opt.learning_rate) if hasattr(trainer.opt, "learning_rate") else args.lr
            log(f"step {s}/{args.steps}  loss {ml:.4f}  top1-agree {ma:.3f}  lr {lr:.2e}  "
                f"{rate:.0f} tok/s  ETA {eta / 60:.1f} min")
            t_log, slots_log, acc = now, 0.0, []
        if s % args.ckpt_every == 0:
            trainer.save(ckpt, extra())
        if args.stop_after and s - start_step >= args.stop_after:
            break
        # fitted, the schedule's end is the run's end; the clock only stops a run that slowed down badly
        budget = args.minutes * 60 * (FIT_OVERRUN if args.fit_minutes and not fitting else 1.0)
        if args.minutes and time.perf_counter() - t_start > budget:
            log(f"time budget of {args.minutes} min reached at step {s}")
            break
