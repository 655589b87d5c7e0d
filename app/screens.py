"""The modal screen that chooses a model to switch to (loading shows in the main screen: widgets.LoadingPanel,
so what is typed meanwhile is kept)."""

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from .settings import DRAFTERS
from .worker import LoadRequest


class OpenModelScreen(ModalScreen[LoadRequest | None]):
    """Pick a model (hub id, folder or .gguf; empty = the embedded default) and a drafter."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, model: str | None, drafter: str, draft_model: str | None) -> None:
        super().__init__()
        self.model, self.drafter, self.draft_model = model, drafter, draft_model

    def compose(self) -> ComposeResult:
        with Vertical(id="open-box"):
            yield Label("Switch model", id="open-title")
            yield Label("Model: hub id, local folder or .gguf file (empty = embedded default)")
            yield Input(value=self.model or "", placeholder="e.g. mlx-community/Qwen3-0.6B-4bit", id="open-model")
            yield Label("Drafter")
            yield Select([(d, d) for d in DRAFTERS], value=self.drafter, allow_blank=False, id="open-drafter")
            yield Label("Draft model (draft) or checkpoint folder (dflash, gemma4-assistant)")
            yield Input(value=self.draft_model or "", placeholder="path or hub id", id="open-draft-model")
            with Horizontal(id="open-buttons"):
                yield Button("Load", variant="primary", id="open-load")
                yield Button("Cancel", id="open-cancel")

    def _request(self) -> LoadRequest:
        model = self.query_one("#open-model", Input).value.strip() or None
        drafter = self.query_one("#open-drafter", Select).value
        draft_model = self.query_one("#open-draft-model", Input).value.strip() or None
        return LoadRequest(model, str(drafter), draft_model)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self._request() if event.button.id == "open-load" else None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(self._request())

    def action_cancel(self) -> None:
        self.dismiss(None)
