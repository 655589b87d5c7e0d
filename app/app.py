"""The chat app: conversation (streamed Markdown), input box, live speculation stats, key bindings.

The model loads in the background (widgets.LoadingPanel above the input): what is typed meanwhile is
queued, shown as queued, and sent once the model has loaded. A prompt that does not fit the model's
context window is refused with a message before anything is sent to the engine; a long prompt shows its
prefill as a progress bar, and Esc stops it between two chunks.
"""

from dataclasses import dataclass, field

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Header, Input

from .controls import Controls
from .messages import (
    GenerationFinished, GenerationProgress, GenerationStarted, ModelLoaded, ModelLoadFailed, ModelLoading,
    PrefillProgress,
)
from .screens import OpenModelScreen
from .settings import Settings
from .speedup import SpeedupPairs
from .widgets import AssistantMessage, LoadingPanel, StatsPanel, SystemMessage, UserMessage
from .worker import EngineOptions, EngineWorker, GenerateRequest, LoadRequest

REASONS = {"stopped": "stopped", "eos": "", "max_tokens": "max tokens reached", "error": "error"}


@dataclass
class AppOptions:
    model: str | None = None  # None = the embedded default model
    save_settings: bool = True
    engine: EngineOptions = field(default_factory=EngineOptions)  # KV caches and the memory budget


class ChatApp(Controls, App):
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
    SystemMessage.queued { color: $text-warning; }
    LoadingPanel { height: auto; border: thick $primary; padding: 0 2; margin: 0 1; background: $surface; }
    LoadingPanel LoadingIndicator { height: 1; }
    #loading-title, #open-title { text-style: bold; }
    OpenModelScreen { align: center middle; }
    #open-box { width: 80; height: auto; border: thick $primary; padding: 1 2; background: $surface; }
    #open-buttons { height: auto; margin: 1 0 0 0; }
    #open-buttons Button { margin: 0 2 0 0; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("f2", "toggle_speculation", "Spec"),
        Binding("f3", "draft_less", "k-"),
        Binding("f4", "draft_more", "k+"),
        Binding("f8", "draft_auto", "k auto"),
        Binding("f5", "temp_down", "Temp-"),
        Binding("f6", "temp_up", "Temp+"),
        Binding("f7", "toggle_colors", "Colours"),
        Binding("ctrl+r", "answer_again", "Again"),
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
        self.worker_thread = EngineWorker(self.post_message, interval=interval, options=self.options.engine)
        self.model_source = self.options.model
        self.model_name: str | None = None
        self.drafter_name = "none"
        self.generating = False
        self.turn = 0
        self.history: list[dict] = []
        self.current: AssistantMessage | None = None
        self.pairs = SpeedupPairs()  # finished turns since the model was loaded, by prompt
        self.turn_key = ""  # what the running turn answers (speedup.prompt_key)
        self.loading: LoadingPanel | None = None
        self.queued: list[tuple[str, SystemMessage]] = []  # typed while loading: (text, its "queued" note)

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

    def _chat(self) -> VerticalScroll:
        return self.query_one("#chat", VerticalScroll)

    def add_system(self, text: str, error: bool = False, classes: str = "") -> SystemMessage:
        msg = SystemMessage(text, classes=" ".join(c for c in ("error" if error else "", classes) if c))
        self._follow(self._chat().mount(msg))
        return msg

    def _follow(self, awaitable=None) -> None:
        """Keep the conversation scrolled to the end when it was there already."""
        chat = self._chat()
        if chat.scroll_y >= chat.max_scroll_y - 2:
            chat.call_after_refresh(chat.scroll_end, animate=False)

    def _load(self, request: LoadRequest) -> None:
        self._close_loading()
        self.loading = LoadingPanel(request.model or "the default model")
        self.mount(self.loading, before=self.query_one("#prompt", Input))
        self.worker_thread.load(request)

    def _close_loading(self) -> None:
        if self.loading is not None:
            self.loading.remove()
            self.loading = None

    def _update_stats(self, snapshot, sample: bool) -> None:
        self.query_one(StatsPanel).update_stats(snapshot, self.pairs.summary(), sample)

    # -- worker messages -----------------------------------------------------------------------------
    def on_model_loading(self, msg: ModelLoading) -> None:
        if self.loading is not None and self.loading.is_mounted:
            self.loading.set_stage(msg.stage, msg.step, msg.total)

    async def on_model_loaded(self, msg: ModelLoaded) -> None:
        self._close_loading()
        self.model_name, self.drafter_name = msg.name, msg.drafter
        self.sub_title = f"{msg.name} ({msg.info}) | drafter {msg.drafter}"
        self.pairs = SpeedupPairs()
        stats = self.query_one(StatsPanel)
        stats.reset_history()
        self._update_stats(stats.snapshot, sample=False)
        self._push_live()
        self.add_system(f"Loaded {msg.name} ({msg.info}), drafter: {msg.drafter}.")
        if msg.warning:
            self.add_system(msg.warning, error=True)
            self.notify(msg.warning, severity="warning", timeout=8)
        notice = self.restored_k_notice()
        if notice:
            self.add_system(notice, classes="queued")
        await self._send_queued()

    def on_model_load_failed(self, msg: ModelLoadFailed) -> None:
        self._close_loading()
        self.add_system(msg.error, error=True)
        self.notify(msg.error, title="Model", severity="error", timeout=8)
        if self.queued:
            n = len(self.queued)
            self.add_system(f"{n} message{'s' if n > 1 else ''} typed while loading wait{'' if n > 1 else 's'} "
                            "for a model: ctrl+o opens one.", classes="queued")

    def on_generation_started(self, msg: GenerationStarted) -> None:
        self.turn_key = msg.key

    def on_prefill_progress(self, msg: PrefillProgress) -> None:
        if msg.turn == self.turn and self.current is not None:
            self.current.set_prefill(msg.done, msg.total)

    async def on_generation_progress(self, msg: GenerationProgress) -> None:
        if msg.turn != self.turn or self.current is None:
            return
        await self.current.add(msg.pieces)
        self._follow()
        self._update_stats(msg.snapshot, sample=True)

    async def on_generation_finished(self, msg: GenerationFinished) -> None:
        self.generating = False
        if msg.reason != "context" and msg.snapshot.stats:
            self.pairs.record(self.turn_key, msg.snapshot.timing)
        if msg.turn != self.turn or self.current is None:
            return  # a turn of a chat that was cleared
        if msg.reason == "context":
            await self._refuse_too_long(msg.error or "the prompt does not fit the model's context window")
            return
        if msg.snapshot.stats:
            self._update_stats(msg.snapshot, sample=False)
        self.current.finish(msg.text, REASONS.get(msg.reason, msg.reason))
        if msg.text:
            self.history.append({"role": "assistant", "content": msg.text})
        if msg.error:
            self.add_system(f"Generation failed: {msg.error}", error=True)
        self.current = None
        await self._send_queued()

    async def _refuse_too_long(self, why: str) -> None:
        """Nothing was generated: the message leaves the conversation (it stays shown) and goes back into an
        empty input box to be shortened."""
        await self.current.remove()
        self.current = None
        text = self.history.pop()["content"] if self.history and self.history[-1]["role"] == "user" else ""
        self.add_system(f"Not sent: {why}. Shorten the message, start a new chat (ctrl+n) or lower --max-tokens.",
                        error=True)
        box = self.query_one("#prompt", Input)
        if text and not box.value:
            box.value = text

    # -- input ---------------------------------------------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.loading is not None:  # kept, shown as queued, sent once the model has loaded
            event.input.value = ""
            await self._chat().mount(UserMessage(text))
            note = self.add_system("queued: sent once the model has loaded", classes="queued")
            self.queued.append((text, note))
            self.notify("The model is still loading: your message is queued and will be sent once it has loaded.")
            return
        if self.generating:
            self.notify("Still generating: press Esc to stop first.", severity="warning")
            return
        if self.model_name is None:
            self.notify("No model is loaded: press ctrl+o to open one.", severity="error")
            return
        event.input.value = ""
        await self._send(text)

    async def _send(self, text: str | None, shown: bool = False) -> None:
        """A new turn answering `text` (None: answer the conversation as it stands again); `shown`: its
        message is in the chat already (queued while loading, or answered again)."""
        if text is not None:
            self.history.append({"role": "user", "content": text})
        self.turn += 1
        self.current = AssistantMessage(self.settings.color_drafts)
        await self._chat().mount_all([self.current] if shown else [UserMessage(text), self.current])
        self._chat().scroll_end(animate=False)
        self.generating = True
        self.worker_thread.generate(
            GenerateRequest(self.turn, list(self.history), self.settings.temperature, self.settings.max_tokens)
        )

    async def _send_queued(self) -> None:
        if self.queued and not self.generating and self.model_name is not None and self.loading is None:
            text, note = self.queued.pop(0)
            await note.remove()
            await self._send(text, shown=True)

    # -- actions -------------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.worker_thread.stop()

    async def action_answer_again(self) -> None:
        """ctrl+r: the last message answered again (the answer replaced), e.g. with speculation flipped by
        F2 to measure the speedup on the same prompt."""
        if self.generating or self.loading is not None or self.model_name is None:
            self.notify("Nothing to answer again now (generating, loading or no model).", severity="warning")
            return
        if not any(m["role"] == "user" for m in self.history):
            self.notify("No message to answer again yet.", severity="warning")
            return
        if self.history[-1]["role"] == "assistant":
            self.history.pop()
        answers = self.query(AssistantMessage)
        if answers:
            await answers.last().remove()
        await self._send(None, shown=True)

    async def action_new_chat(self) -> None:
        self.worker_thread.stop()
        self.turn += 1
        self.current = None
        self.history = []
        await self._chat().remove_children()
        self.queued = []
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
