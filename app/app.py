"""The chat app: conversation (streamed Markdown), input box, live speculation stats, key bindings."""

from dataclasses import dataclass

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Header, Input

from .messages import (
    GenerationFinished, GenerationProgress, GenerationStarted, ModelLoaded, ModelLoadFailed, ModelLoading,
    TurnTiming,
)
from .screens import LoadingScreen, OpenModelScreen
from .settings import Settings
from .widgets import AssistantMessage, StatsPanel, SystemMessage, UserMessage
from .worker import EngineWorker, GenerateRequest, LoadRequest

AUTO_START_K = 1  # what auto drafts before it has evidence (policy.py: optimistic start); +/- start from it

TEMP_STEP = 0.1
RESTORED_LABELS = {"num_draft": "k", "temperature": "temp", "speculation": "spec", "color_drafts": "colour drafts",
                   "max_tokens": "max tokens", "draft_model": "draft model"}
REASONS = {"stopped": "stopped", "eos": "", "max_tokens": "max tokens reached", "error": "error"}


@dataclass
class AppOptions:
    model: str | None = None  # None = the embedded default model
    save_settings: bool = True


class ChatApp(App):
    TITLE = "mlx-engine"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #main { height: 1fr; }
    #chat { width: 1fr; padding: 0 1; }
    #stats { width: 44; border: round $accent; padding: 0 1; }
    #stats-spark { height: 3; margin: 0 0 1 0; }
    #prompt { margin: 0 1; }
    UserMessage { background: $boost; border-left: thick $primary; padding: 0 1; margin: 1 0 0 0; }
    AssistantMessage { height: auto; border: round $secondary; padding: 0 1; margin: 1 0 0 0; }
    AssistantMessage Markdown { margin: 0; padding: 0; }
    AssistantMessage .colored { height: auto; }
    SystemMessage { color: $text-muted; margin: 1 0 0 0; padding: 0 1; }
    SystemMessage.error { color: $text-error; border: round $error; }
    LoadingScreen, OpenModelScreen { align: center middle; }
    #loading-box { width: 70; height: auto; border: thick $primary; padding: 1 2; background: $surface; }
    #loading-box LoadingIndicator { height: 3; }
    #loading-title, #open-title { text-style: bold; margin: 0 0 1 0; }
    #open-box { width: 80; height: auto; border: thick $primary; padding: 1 2; background: $surface; }
    #open-buttons { height: auto; margin: 1 0 0 0; }
    #open-buttons Button { margin: 0 2 0 0; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("f2", "toggle_speculation", "Spec"),
        Binding("f3", "draft_less", "k-"),
        Binding("f4", "draft_more", "k+"),
        Binding("f5", "temp_down", "Temp-"),
        Binding("f6", "temp_up", "Temp+"),
        Binding("f7", "toggle_colors", "Colours"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "switch_model", "Model"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("plus", "draft_more", "k+", show=False),
        Binding("minus", "draft_less", "k-", show=False),
    ]

    def __init__(self, settings: Settings | None = None, options: AppOptions | None = None, interval: float = 0.1):
        super().__init__()
        self.settings = settings or Settings()
        self.options = options or AppOptions()
        self.worker_thread = EngineWorker(self.post_message, interval=interval)
        self.model_source = self.options.model
        self.model_name: str | None = None
        self.drafter_name = "none"
        self.generating = False
        self.turn = 0
        self.history: list[dict] = []
        self.current: AssistantMessage | None = None
        self.totals = TurnTiming()  # finished turns since the model was loaded
        self.turn_timing = TurnTiming()
        self.loading: LoadingScreen | None = None

    # -- layout --------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(id="chat")
            yield StatsPanel(id="stats")
        yield Input(placeholder="Type a message, Enter to send", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.worker_thread.start()
        self._push_live()
        self.sub_title = "no model"
        self._load(LoadRequest(self.model_source, self.settings.drafter, self.settings.draft_model))
        self.query_one("#prompt", Input).focus()

    def on_unmount(self) -> None:
        self.worker_thread.shutdown(timeout=1.0)

    # -- helpers -------------------------------------------------------------------------------------
    def effective_k(self) -> int | str:
        return self.settings.num_draft

    def _k_label(self) -> str:
        k = self.settings.num_draft
        if k == "auto":
            return "auto (adaptive)"
        return str(k)

    def _push_live(self) -> None:
        self.worker_thread.set_live(self.settings.num_draft, self.settings.speculation)
        s = self.settings
        self.query_one(StatsPanel).set_settings_line(
            f"drafter {self.drafter_name} | k {self._k_label()} | spec {'on' if s.speculation else 'off'}\n"
            f"temp {s.temperature:.1f} | colour drafts {'on' if s.color_drafts else 'off'}" + self._restored_note(),
            self._live_k(),
        )

    def _restored_note(self) -> str:
        """Which settings came back from settings.json (while they are still in force), so none persists
        silently."""
        from .settings import settings_path

        s = self.settings
        kept = [f"{RESTORED_LABELS.get(name, name)} {'on' if v is True else 'off' if v is False else v}"
                for name, v in s.restored.items() if getattr(s, name) == v]
        if not kept:
            return ""
        return f"\nrestored from {settings_path().name}: {', '.join(kept)} (--reset: defaults)"

    def _live_k(self) -> int:
        """The draft length the next cycle uses (0 = plain decoding)."""
        if not self.settings.speculation or self.drafter_name == "none":
            return 0
        k = self.settings.num_draft
        return AUTO_START_K if k == "auto" else int(k)

    def _save(self) -> None:
        if self.options.save_settings:
            err = self.settings.save()
            if err:
                self.notify(err, severity="warning")

    def _chat(self) -> VerticalScroll:
        return self.query_one("#chat", VerticalScroll)

    def add_system(self, text: str, error: bool = False) -> SystemMessage:
        msg = SystemMessage(text, classes="error" if error else "")
        self._follow(self._chat().mount(msg))
        return msg

    def _follow(self, awaitable=None) -> None:
        """Keep the conversation scrolled to the end when it was there already."""
        chat = self._chat()
        if chat.scroll_y >= chat.max_scroll_y - 2:
            chat.call_after_refresh(chat.scroll_end, animate=False)

    def _load(self, request: LoadRequest) -> None:
        what = request.model or "the default model"
        self.loading = LoadingScreen(what)
        self.push_screen(self.loading)
        self.worker_thread.load(request)

    def _close_loading(self) -> None:
        if self.loading is not None:
            if self.screen is self.loading:
                self.pop_screen()
            self.loading = None

    # -- worker messages -----------------------------------------------------------------------------
    def on_model_loading(self, msg: ModelLoading) -> None:
        if self.loading is not None and self.loading.is_mounted:
            self.loading.set_stage(msg.stage, msg.step, msg.total)

    def on_model_loaded(self, msg: ModelLoaded) -> None:
        self._close_loading()
        self.model_name, self.drafter_name = msg.name, msg.drafter
        self.sub_title = f"{msg.name} ({msg.info}) | drafter {msg.drafter}"
        self.totals, self.turn_timing = TurnTiming(), TurnTiming()
        stats = self.query_one(StatsPanel)
        stats.reset_history()
        stats.update_stats(stats.snapshot, self.totals, sample=False)
        self._push_live()
        self.add_system(f"Loaded {msg.name} ({msg.info}), drafter: {msg.drafter}.")
        if msg.warning:
            self.add_system(msg.warning, error=True)
            self.notify(msg.warning, severity="warning", timeout=8)

    def on_model_load_failed(self, msg: ModelLoadFailed) -> None:
        self._close_loading()
        self.add_system(msg.error, error=True)
        self.notify(msg.error, title="Model", severity="error", timeout=8)

    def on_generation_started(self, msg: GenerationStarted) -> None:
        self.turn_timing = TurnTiming()

    async def on_generation_progress(self, msg: GenerationProgress) -> None:
        if msg.turn != self.turn or self.current is None:
            return
        await self.current.add(msg.pieces)
        self._follow()
        self.turn_timing = msg.snapshot.timing
        self._update_stats(msg.snapshot, sample=True)

    def _update_stats(self, snapshot, sample: bool) -> None:
        totals = TurnTiming(**vars(self.totals))
        totals.add(self.turn_timing)
        self.query_one(StatsPanel).update_stats(snapshot, totals, sample)

    def on_generation_finished(self, msg: GenerationFinished) -> None:
        self.generating = False
        self.totals.add(msg.snapshot.timing)
        self.turn_timing = TurnTiming()
        if msg.turn != self.turn or self.current is None:
            return  # a turn of a chat that was cleared
        if msg.snapshot.stats:
            self.query_one(StatsPanel).update_stats(msg.snapshot, self.totals, sample=False)
        note = REASONS.get(msg.reason, msg.reason)
        self.current.finish(msg.text, note)
        if msg.text:
            self.history.append({"role": "assistant", "content": msg.text})
        if msg.error:
            self.add_system(f"Generation failed: {msg.error}", error=True)
        self.current = None

    # -- input ---------------------------------------------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("Still generating: press Esc to stop first.", severity="warning")
            return
        if self.model_name is None:
            self.notify("No model is loaded: press ctrl+o to open one.", severity="error")
            return
        event.input.value = ""
        self.history.append({"role": "user", "content": text})
        self.turn += 1
        self.current = AssistantMessage(self.settings.color_drafts)
        await self._chat().mount_all([UserMessage(text), self.current])
        self._chat().scroll_end(animate=False)
        self.generating = True
        self.worker_thread.generate(
            GenerateRequest(self.turn, list(self.history), self.settings.temperature, self.settings.max_tokens)
        )

    # -- actions -------------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.worker_thread.stop()

    def action_toggle_speculation(self) -> None:
        self.settings.speculation = not self.settings.speculation
        self._push_live()
        self._save()
        state = "on" if self.settings.speculation else "off (plain decoding)"
        if self.drafter_name == "none" and self.settings.speculation:
            state += ", but no drafter is loaded"
        self.notify(f"Speculation {state}")

    def _set_k(self, delta: int) -> None:
        k = self.settings.num_draft
        if k == "auto":
            k = AUTO_START_K
        self.settings.num_draft = max(1, min(16, int(k) + delta))
        self._push_live()
        self._save()

    def action_draft_more(self) -> None:
        self._set_k(+1)

    def action_draft_less(self) -> None:
        self._set_k(-1)

    def _set_temp(self, delta: float) -> None:
        self.settings.temperature = round(max(0.0, min(2.0, self.settings.temperature + delta)), 2)
        self._push_live()
        self._save()
        when = " (from the next turn)" if self.generating else ""
        self.notify(f"Temperature {self.settings.temperature:.1f}{when}")

    def action_temp_up(self) -> None:
        self._set_temp(TEMP_STEP)

    def action_temp_down(self) -> None:
        self._set_temp(-TEMP_STEP)

    def action_toggle_colors(self) -> None:
        self.settings.color_drafts = not self.settings.color_drafts
        for msg in self.query(AssistantMessage):
            msg.set_colored(self.settings.color_drafts)
        self._push_live()
        self._save()

    async def action_new_chat(self) -> None:
        self.worker_thread.stop()
        self.turn += 1
        self.current = None
        self.history = []
        await self._chat().remove_children()
        self.query_one("#prompt", Input).focus()

    def action_switch_model(self) -> None:
        if self.loading is not None:
            return

        def chosen(request: LoadRequest | None) -> None:
            if request is None:
                return
            self.worker_thread.stop()
            self.settings.drafter, self.settings.draft_model = request.drafter, request.draft_model
            self._save()
            self.model_source = request.model
            self._load(request)

        self.push_screen(OpenModelScreen(self.model_source, self.settings.drafter, self.settings.draft_model), chosen)

    async def action_quit(self) -> None:
        self.worker_thread.shutdown(timeout=1.0)
        self.exit()
