"""The chat's live controls (a part of ChatApp): speculation on/off, the draft length k, the temperature,
draft colouring; the settings line of the stats panel, and which settings came back from settings.json."""

from .settings import settings_path, step_k
from .widgets import AssistantMessage, StatsPanel

AUTO_START_K = 1  # what auto drafts before it has evidence (policy.py: optimistic start)
TEMP_STEP = 0.1
RESTORED_LABELS = {"num_draft": "k", "temperature": "temp", "speculation": "spec", "color_drafts": "colour drafts",
                   "max_tokens": "max tokens", "draft_model": "draft model"}


class Controls:
    """Mixed into ChatApp: reads and changes `self.settings`, tells the worker (`self.worker_thread`)."""

    def _k_label(self) -> str:
        k = self.settings.num_draft
        return "auto (adaptive)" if k == "auto" else f"{k} (fixed)"

    def _push_live(self) -> None:
        self.worker_thread.set_live(self.settings.num_draft, self.settings.speculation)
        s = self.settings
        self.query_one(StatsPanel).set_settings_line(
            f"drafter {self.drafter_name} | k {self._k_label()} | spec {'on' if s.speculation else 'off'}\n"
            f"temp {s.temperature:.1f} | colour drafts {'on' if s.color_drafts else 'off'}" + self._restored_note(),
            self._live_k(),
        )

    def restored_in_force(self) -> dict:
        """Settings that came back from settings.json and are still in force (changed here: no longer)."""
        s = self.settings
        return {name: v for name, v in s.restored.items() if getattr(s, name) == v}

    def _restored_note(self) -> str:
        """Which settings came back from settings.json (while they are still in force), so none persists
        silently; a fixed k says how to go back to auto."""
        kept = [f"{RESTORED_LABELS.get(name, name)} {'on' if v is True else 'off' if v is False else v}"
                for name, v in self.restored_in_force().items()]
        if not kept:
            return ""
        undo = "F8: k auto, " if "num_draft" in self.restored_in_force() else ""
        return f"\nrestored from {settings_path().name}: {', '.join(kept)} ({undo}--reset: defaults)"

    def restored_k_notice(self) -> str | None:
        """The chat's line when a fixed k came back from settings.json (a fixed k can draft far too much)."""
        k = self.restored_in_force().get("num_draft")
        if k is None or k == "auto":
            return None
        return (f"Draft length k {k} (fixed) restored from {settings_path()}; auto adapts k to what pays. "
                "F8 sets k auto (F3/F4 step k: auto, 1, 2, ...); --reset starts from the defaults.")

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

    # -- actions (key bindings) ----------------------------------------------------------------------
    def action_toggle_speculation(self) -> None:
        self.settings.speculation = not self.settings.speculation
        self._push_live()
        self._save()
        state = "on" if self.settings.speculation else "off (plain decoding)"
        if self.drafter_name == "none" and self.settings.speculation:
            state += ", but no drafter is loaded"
        self.notify(f"Speculation {state}")

    def _set_k(self, k) -> None:
        self.settings.num_draft = k
        self._push_live()
        self._save()
        self.notify(f"Draft length k {self._k_label()}")

    def action_draft_more(self) -> None:
        self._set_k(step_k(self.settings.num_draft, +1))

    def action_draft_less(self) -> None:
        self._set_k(step_k(self.settings.num_draft, -1))

    def action_draft_auto(self) -> None:
        self._set_k("auto")

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
