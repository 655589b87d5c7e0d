"""Widgets: the chat messages and the live stats panel."""

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Sparkline, Static

from .messages import Snapshot, TurnTiming

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

    def compose(self) -> ComposeResult:
        yield Markdown(classes="md")
        yield Static(classes="colored")

    def on_mount(self) -> None:
        self._apply_mode()

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
        self.pieces += pieces
        if not self.is_mounted or not self.children:
            return  # being removed (new chat, quitting): keep the text, draw nothing
        if self.colored:
            self.query_one(".colored", Static).update(self.colored_text())
        else:
            await self.query_one(Markdown).append("".join(t for t, _ in pieces))

    def finish(self, text: str, note: str | None) -> None:
        streamed = "".join(t for t, _ in self.pieces)
        self.final_text = text
        if not self.colored and text != streamed and self.is_mounted:
            self.query_one(Markdown).update(text)  # the exact decode of all tokens
        if note:
            self.border_subtitle = note


class StatsPanel(VerticalScroll):
    """decode tok/s + sparkline, prompt tok/s, acceptance, mean accepted length, per-position bars,
    draft length, time split, peak memory, speedup over plain decoding since the app started."""

    BAR = 14

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.history: deque[float] = deque(maxlen=60)
        self.snapshot = Snapshot()
        self.totals = TurnTiming()
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

    def update_stats(self, snapshot: Snapshot, totals: TurnTiming, sample: bool) -> None:
        self.snapshot, self.totals = snapshot, totals
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

        t.append("\nspeedup vs plain (since load)\n", style="dim")
        tot = self.totals
        sp = tot.speedup
        if sp is not None:
            t.append(f"  {sp:5.2f}x", style="bold green" if sp >= 1 else "bold red")
            t.append(f"  spec {tot.spec_tps:.1f} / plain {tot.plain_tps:.1f} tok/s\n", style="dim")
        else:
            need = "off" if not tot.plain_tps else "on"
            t.append(f"  - needs a turn with spec {need} (F2)\n", style="dim")
        if self.settings_line:
            t.append("\n" + self.settings_line, style="dim")
        self.query_one("#stats-body", Static).update(t)
        self.text = rate.plain + "\n" + t.plain
