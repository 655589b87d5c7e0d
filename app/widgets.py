"""Widgets: the chat messages and the live stats panel."""

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, LoadingIndicator, Markdown, ProgressBar, Sparkline, Static

from .messages import Snapshot
from .speedup import Speedup

DRAFT_STYLE = "bold green"  # tokens from accepted drafts
TARGET_STYLE = ""  # tokens the target produced itself
BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(frac: float, width: int) -> str:
    frac = max(0.0, min(1.0, frac))
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    s = "█" * full + (BLOCKS[part] if part else "")
    return s.ljust(width)


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class LoadingPanel(Vertical):
    """Shown above the input while the worker loads a model; the input stays usable (what is typed is
    queued and sent once the model has loaded)."""

    def __init__(self, what: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.what = what

    def compose(self) -> ComposeResult:
        yield Label(f"Loading {self.what}", id="loading-title")
        yield LoadingIndicator()
        yield ProgressBar(total=4, show_eta=False, id="loading-progress")
        yield Label("starting", id="loading-stage")

    def set_stage(self, stage: str, step: int, total: int) -> None:
        self.query_one(ProgressBar).update(total=total, progress=step)
        self.query_one("#loading-stage", Label).update(stage)


class UserMessage(Static):
    pass


class SystemMessage(Static):
    """Notes and errors from the app (shown in the conversation, never a traceback)."""


class AssistantMessage(Vertical):
    """Streams as Markdown; or, with draft colouring on, as text with accepted-draft tokens coloured."""

    def __init__(self, colored: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pieces: list[tuple[str, bool]] = []
        self.colored = colored
        self.final_text: str | None = None
        self.prefill: tuple[int, int] | None = None  # (done, total) while a long prompt is read

    def compose(self) -> ComposeResult:
        yield ProgressBar(show_eta=False, classes="prefill")
        yield Markdown(classes="md")
        yield Static(classes="colored")

    def on_mount(self) -> None:
        self.query_one(".prefill", ProgressBar).display = False
        self._apply_mode()

    def set_prefill(self, done: int, total: int) -> None:
        """A long prompt being read: a progress bar until the first token comes (Esc stops between chunks)."""
        self.prefill = (done, total)
        if not self.is_mounted or not self.children:
            return
        bar = self.query_one(".prefill", ProgressBar)
        bar.display = True
        bar.update(total=total, progress=done)
        self.border_subtitle = f"reading the prompt: {done:,} / {total:,} tokens (Esc stops)"

    def _end_prefill(self) -> None:
        if self.is_mounted and self.children and self.query_one(".prefill", ProgressBar).display:
            self.query_one(".prefill", ProgressBar).display = False
            self.border_subtitle = ""

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else "".join(t for t, _ in self.pieces)

    def colored_text(self) -> Text:
        out = Text()
        for piece, from_draft in self.pieces:
            out.append(piece, style=DRAFT_STYLE if from_draft else TARGET_STYLE)
        return out

    def _apply_mode(self) -> None:
        md, colored = self.query_one(Markdown), self.query_one(".colored", Static)
        md.display, colored.display = not self.colored, self.colored
        if self.colored:
            colored.update(self.colored_text())
        else:
            md.update(self.text)

    def set_colored(self, colored: bool) -> None:
        if colored != self.colored:
            self.colored = colored
            self._apply_mode()

    async def add(self, pieces: list[tuple[str, bool]]) -> None:
        self._end_prefill()
        self.pieces += pieces
        if not self.is_mounted or not self.children:
            return  # being removed (new chat, quitting): keep the text, draw nothing
        if self.colored:
            self.query_one(".colored", Static).update(self.colored_text())
        else:
            await self.query_one(Markdown).append("".join(t for t, _ in pieces))

    def finish(self, text: str, note: str | None) -> None:
        self._end_prefill()
        if note == "stopped" and not text and self.prefill is not None:
            done, total = self.prefill
            note = f"stopped while reading the prompt ({done:,} of {total:,} tokens; sent again, it goes on from there)"
        streamed = "".join(t for t, _ in self.pieces)
        self.final_text = text
        if not self.colored and text != streamed and self.is_mounted:
            self.query_one(Markdown).update(text)  # the exact decode of all tokens
        if note:
            self.border_subtitle = note


class StatsPanel(VerticalScroll):
    """decode tok/s + sparkline, prompt tok/s, acceptance, mean accepted length, per-position bars,
    draft length, time split, peak memory, speedup over plain decoding on the same prompts (app/speedup.py)."""

    BAR = 14

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.history: deque[float] = deque(maxlen=60)
        self.snapshot = Snapshot()
        self.speedup = Speedup(reason="no answer measured yet")
        self.settings_line = ""
        self.live_k = 0  # the draft length in force before any cycle has run
        self.text = ""  # plain text of the panel as last rendered (tests read it)

    def compose(self) -> ComposeResult:
        yield Static(id="stats-rate")
        yield Sparkline(list(self.history), id="stats-spark")
        yield Static(id="stats-body")

    def on_mount(self) -> None:
        self.border_title = "Speculation"
        self.refresh_stats()

    def reset_history(self) -> None:
        self.history.clear()
        self.query_one(Sparkline).data = list(self.history)

    def update_stats(self, snapshot: Snapshot, speedup: Speedup, sample: bool) -> None:
        self.snapshot, self.speedup = snapshot, speedup
        if sample and snapshot.interval_tps > 0:
            self.history.append(snapshot.interval_tps)
            self.query_one(Sparkline).data = list(self.history)
        self.refresh_stats()

    def set_settings_line(self, line: str, live_k: int) -> None:
        self.settings_line = line
        self.live_k = live_k
        self.refresh_stats()

    def refresh_stats(self) -> None:
        if not self.is_mounted:
            return
        st, snap = self.snapshot.stats, self.snapshot
        rate = Text()
        rate.append("decode  ", style="dim")
        rate.append(f"{st.get('decode_tps', 0.0):8.1f}", style="bold")
        rate.append(" tok/s", style="dim")
        self.query_one("#stats-rate", Static).update(rate)

        t = Text()
        t.append("prompt  ", style="dim")
        t.append(f"{st.get('prompt_tps', 0.0):8.1f}", style="bold")
        t.append(f" tok/s  ({snap.reprefill} tok)\n", style="dim")
        t.append("accept  ", style="dim")
        t.append(f"{100 * st.get('acceptance_rate', 0.0):7.1f} %", style="bold")
        t.append(f"  {st.get('accepted', 0)}/{st.get('drafted', 0)}\n", style="dim")
        t.append("mean    ", style="dim")
        t.append(f"{st.get('mean_accepted_length', 0.0):8.2f}", style="bold")
        t.append(" tok/verify\n", style="dim")
        k = snap.k if st else self.live_k
        t.append("draft k ", style="dim")
        t.append(f"{k:8d}", style="bold")
        if not k:
            t.append("  (plain decode)\n", style="dim")
        else:
            t.append(f"  (last {snap.last_draft})\n" if st else "\n", style="dim")

        t.append("\nacceptance per position\n", style="dim")
        per = st.get("acceptance_per_position", [])
        if not per:
            t.append("  -\n", style="dim")
        for i, a in enumerate(per[:12]):
            t.append(f"{i + 1:3d} ", style="dim")
            t.append(bar(a, self.BAR), style="green")
            t.append(f" {100 * a:3.0f}%\n")

        t.append("\ntime split (profiled cycles)\n", style="dim")
        cycles, prof = st.get("cycles", 0), st.get("profiled_cycles", 0)
        if cycles and prof and st.get("decode_time", 0) > 0:
            per_cycle = st["decode_time"] / cycles
            d = st["time_draft"] / prof
            v = st["time_verify"] / prof
            other = max(0.0, per_cycle - d - v)
            total = d + v + other or 1.0
            parts = [("draft", d / total, "magenta"), ("verify", v / total, "blue"), ("other", other / total, "grey50")]
            line = Text("    ")
            width = self.BAR + 5
            for _, f, style in parts:
                line.append("█" * round(f * width), style=style)
            t.append_text(line)
            t.append("\n")
            for name, f, style in parts:
                t.append(f"    {name:<7}", style=style)
                t.append(f"{100 * f:5.1f} %\n")
        else:
            t.append("  -\n", style="dim")

        t.append("\npeak mem ", style="dim")
        t.append(human_bytes(st.get("peak_memory", 0)) + "\n", style="bold")

        t.append("\nspeedup vs plain (same prompt)\n", style="dim")
        sp = self.speedup
        if sp.ratio is not None:
            t.append(f"  {sp.ratio:5.2f}x", style="bold green" if sp.ratio >= 1 else "bold red")
            prompts = f"{sp.pairs} prompt" + ("s" if sp.pairs != 1 else "")
            t.append(f"  spec {sp.spec_tps:.1f} / plain {sp.plain_tps:.1f} tok/s, {prompts}\n", style="dim")
        else:
            t.append(f"  - {sp.reason}\n    F2 then ctrl+r: same prompt again\n", style="dim")
        if self.settings_line:
            t.append("\n" + self.settings_line, style="dim")
        self.query_one("#stats-body", Static).update(t)
        self.text = rate.plain + "\n" + t.plain
