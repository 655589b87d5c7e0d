"""Headless screenshot of the chat mid-answer:

    python -m app.screenshot --model M --prompt "..." --out chat.svg [--drafter ngram] [--after-tokens 48]
        [--plain-first 64] [--size 140x44]

Runs the real app without a terminal, sends the prompt, waits until `--after-tokens` tokens of the answer
have streamed and saves an SVG. `--plain-first N` first answers the same prompt with speculation off
(N tokens at most), starts a new chat and turns speculation back on, so the speedup over plain decoding
is filled in. Settings are not read from or written to the config folder.
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)

from .__main__ import num_draft_arg, temp_arg
from .settings import DRAFTERS, Settings


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m app.screenshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="hub id, folder or .gguf (default: the embedded default model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="the .svg file to write")
    p.add_argument("--drafter", choices=DRAFTERS, default="ngram")
    p.add_argument("--draft-model")
    p.add_argument("--num-draft", type=num_draft_arg, default=4)
    p.add_argument("--temp", type=temp_arg, default=0.0)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--after-tokens", type=int, default=48, help="answer tokens to wait for before the shot")
    p.add_argument("--plain-first", type=int, default=0, help="tokens of a plain (speculation off) turn first")
    p.add_argument("--no-colors", action="store_true", help="Markdown view instead of coloured draft tokens")
    p.add_argument("--size", default="140x44", help="terminal size, COLSxROWS")
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args(argv)


async def shoot(args) -> int:
    from .app import AppOptions, ChatApp

    cols, rows = (int(v) for v in args.size.lower().split("x"))
    settings = Settings(
        drafter=args.drafter if not args.draft_model or args.drafter != "ngram" else "draft",
        draft_model=args.draft_model, num_draft=args.num_draft, temperature=args.temp,
        max_tokens=args.max_tokens, color_drafts=not args.no_colors, speculation=True,
    )
    app = ChatApp(settings, AppOptions(model=args.model, save_settings=False))
    deadline = time.monotonic() + args.timeout

    async def until(pilot, cond, what: str):
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await pilot.pause(0.1)

    async def ask(pilot, text: str):
        app.query_one("#prompt").value = text
        await pilot.press("enter")

    def generated() -> int:
        return app.query_one("StatsPanel").snapshot.stats.get("generated", 0)

    async with app.run_test(size=(cols, rows)) as pilot:
        await until(pilot, lambda: app.model_name is not None or app.query(".error"), "the model to load")
        if app.model_name is None:
            errors = [str(m.render()) for m in app.query(".error")]
            print("error: " + " | ".join(errors), file=sys.stderr)
            app.save_screenshot(filename=Path(args.out).name, path=str(Path(args.out).parent or "."))
            return 1
        if args.plain_first > 0:
            app.settings.speculation = False
            app._push_live()
            app.settings.max_tokens = args.plain_first
            await ask(pilot, args.prompt)
            await until(pilot, lambda: app.generating is False and app.current is None, "the plain turn")
            app.settings.max_tokens = args.max_tokens
            await pilot.press("ctrl+n")
            app.settings.speculation = True
            app._push_live()
        await ask(pilot, args.prompt)
        await until(pilot, lambda: generated() >= args.after_tokens or not app.generating, "the answer")
        app.query_one("#prompt").cursor_blink = False
        await pilot.pause(0.5)  # let the Markdown finish re-rendering its blocks
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))
        print(f"saved {out} after {generated()} tokens")
        app.worker_thread.stop()
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    try:
        return asyncio.run(shoot(args))
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
