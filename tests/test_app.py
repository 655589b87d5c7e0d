"""The TUI chat (app/): Pilot tests that drive the real app on a tiny random model saved to disk.

The model is a 2-layer llama with a byte-level BPE tokenizer trained here and a simple chat template, so
it loads through mlx_engine.models.load like any local folder. Its EOS logit is pinned to 0 so greedy
decoding never stops early (answers run until stopped or max tokens).
"""

import json
import sys
import time
from pathlib import Path

import pytest

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL_NAME = "tiny-llama"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "hello world, how are you today? I am fine, thank you.",
    "# Title\n\n- item one\n- item two\n\n`code` and **bold** text\n",
]


def save_tiny_model(out: Path, **config) -> Path:
    """A tiny random llama + tokenizer.json + tokenizer_config.json (chat template) in `out`; `config`:
    entries added to its config.json (e.g. max_position_embeddings, its context window)."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import tiny_models

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }))
    eos = tok.token_to_id("<|im_end|>")
    model, cfg = tiny_models.build("llama", vocab=tok.get_vocab_size())
    w = model.lm_head.weight
    model.lm_head.weight = mx.where(mx.arange(w.shape[0])[:, None] == eos, 0.0, w)  # never the argmax
    save_model(out, model)
    cfg["eos_token_id"] = eos
    save_config({**cfg, **config}, out / "config.json")
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "config"
    monkeypatch.setenv("MLX_ENGINE_CONFIG_DIR", str(d))
    return d


def make_app(*argv):
    from app.__main__ import build_app

    return build_app(list(argv))


async def until(pilot, cond, timeout: float = 10.0, step: float = 0.05):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        await pilot.pause(step)


async def loaded(pilot, app):
    await until(pilot, lambda: app.model_name is not None or app.query(".error"))


async def send(pilot, text: str, type_it: bool = False):
    if type_it:
        for ch in text:
            await pilot.press("space" if ch == " " else ch)
    else:
        pilot.app.query_one("#prompt").value = text
    await pilot.press("enter")


def system_texts(app) -> list[str]:
    return [str(m.render()) for m in app.query("SystemMessage")]


# -- pure parts --------------------------------------------------------------------------------------
def test_settings_roundtrip_and_broken_file(config_dir):
    from app.settings import Settings, settings_path

    assert settings_path() == config_dir / "settings.json"
    s = Settings(num_draft=7, temperature=0.7, speculation=False)
    assert s.save() is None
    assert Settings.load() == s
    settings_path().write_text("{not json")
    assert Settings.load() == Settings()
    settings_path().write_text(json.dumps({"num_draft": "lots", "temperature": -3, "drafter": "x", "junk": 1}))
    s = Settings.load()
    assert (s.num_draft, s.temperature, s.drafter) == ("auto", 0.0, "ngram")
    assert Settings(num_draft="auto").num_draft == "auto"
    assert Settings().num_draft == "auto"  # the default: drafts k = 1 from the first cycle, then what pays


@pytest.mark.anyio
async def test_restored_settings_are_shown_in_the_stats_panel(tiny_model, config_dir):
    from app.settings import Settings

    Settings(num_draft=1, temperature=0.2).save()
    app = make_app("--model", str(tiny_model), "--drafter", "ngram", "--no-save")
    assert app.settings.restored == {"num_draft": 1, "temperature": 0.2}
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        panel = app.query_one("StatsPanel")
        assert "restored from settings.json: k 1, temp 0.2" in panel.text
        await pilot.press("f4")  # changed here: no longer a restored value
        assert "restored from settings.json: temp 0.2" in panel.text
    # given on the command line: not restored; --reset: the defaults
    assert make_app("--temp", "0.5").settings.restored == {"num_draft": 1}
    assert make_app("--reset").settings == Settings()


def test_cli_overrides_saved_settings(config_dir):
    from app.settings import Settings

    Settings(num_draft=3, temperature=0.5, drafter="none").save()
    app = make_app("--num-draft", "auto", "--draft-model", "some/draft")
    assert app.settings.num_draft == "auto"
    assert app.settings.temperature == 0.5
    assert (app.settings.drafter, app.settings.draft_model) == ("draft", "some/draft")
    with pytest.raises(SystemExit):
        make_app("--num-draft", "0")


def test_piece_decoder_matches_full_decode(tiny_model):
    from mlx_engine.models import load

    from app.chat_text import PieceDecoder, decode, encode_chat

    tok = load(str(tiny_model)).tokenizer
    ids = tok.encode("héllo wörld, the quick brown fox 🦊 jumps")
    dec = PieceDecoder(tok)
    pieces = [p for i, t in enumerate(ids) if (p := dec.add(t, i % 2 == 0))]
    if (p := dec.flush()):
        pieces.append(p)
    assert "".join(t for t, _ in pieces) == decode(tok, ids)
    prompt = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")


# -- the app -----------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_chat_streams_and_stats_update_with_draft_model(tiny_model):
    """The target as its own draft model: everything is accepted at temperature 0."""
    app = make_app("--model", str(tiny_model), "--drafter", "draft", "--draft-model", str(tiny_model),
                   "--num-draft", "3", "--max-tokens", "60")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        assert app.model_name == MODEL_NAME and app.drafter_name == "draft"
        assert "accept      0.0 %" in app.query_one("StatsPanel").text
        await send(pilot, "hi", type_it=True)
        assert app.query("AssistantMessage")
        await until(pilot, lambda: not app.generating)
        (answer,) = app.query("AssistantMessage")
        assert len(answer.text) > 0 and answer.pieces
        assert any(from_draft for _, from_draft in answer.pieces)  # coloured apart
        panel = app.query_one("StatsPanel")
        assert "accept    100.0 %" in panel.text
        assert "draft k        3" in panel.text
        assert panel.snapshot.stats["generated"] == 60
        assert panel.snapshot.stats["acceptance_per_position"] == [1.0, 1.0, 1.0]
        assert app.history[-1] == {"role": "assistant", "content": answer.text}
        # a second turn keeps the whole conversation (re-prefilled: the prompt grew)
        first_prompt = panel.snapshot.reprefill
        await send(pilot, "again")
        await until(pilot, lambda: not app.generating)
        assert panel.snapshot.reprefill > first_prompt + 60
        assert [m["role"] for m in app.history] == ["user", "assistant", "user", "assistant"]
        # Markdown by default; the colour toggle shows accepted-draft tokens in another colour, and back
        assert all(m.query_one("Markdown").display for m in app.query("AssistantMessage"))
        await pilot.press("f7")
        assert app.settings.color_drafts
        colored = answer.query_one(".colored")
        assert colored.display and not answer.query_one("Markdown").display
        assert {span.style for span in answer.colored_text().spans} == {"bold green"}
        await pilot.press("f7")
        assert not app.settings.color_drafts and answer.query_one("Markdown").display


@pytest.mark.anyio
async def test_stop_mid_generation_and_toggle_speculation(tiny_model, config_dir):
    app = make_app("--model", str(tiny_model), "--drafter", "draft", "--draft-model", str(tiny_model),
                   "--num-draft", "2", "--max-tokens", "100000")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        await send(pilot, "tell me a long story")
        panel = app.query_one("StatsPanel")
        await until(pilot, lambda: panel.snapshot.timing.spec_tokens > 20)
        (answer,) = app.query("AssistantMessage")
        seen = len(answer.text)
        assert seen > 0 and app.generating  # streamed, still going
        # speculation off, live: the worker decodes plainly from the next cycle
        await pilot.press("f2")
        assert app.settings.speculation is False
        await until(pilot, lambda: panel.snapshot.k == 0 and panel.snapshot.timing.plain_tokens > 20)
        await until(pilot, lambda: len(answer.text) > seen)
        await pilot.press("f4")  # k+ while off: remembered for when it is back on
        await pilot.press("escape")
        await until(pilot, lambda: not app.generating)
        assert answer.border_subtitle == "stopped"
        assert 0 < panel.snapshot.stats["generated"] < 100000
        # one answer decoded both ways: compared with nothing (like with like only, app/speedup.py)
        assert "a turn with F2 midway counts for neither" in panel.text and "x  spec" not in panel.text
        # settings persisted
        saved = json.loads((config_dir / "settings.json").read_text())
        assert saved["speculation"] is False and saved["num_draft"] == 3
        # the app still works after a stop: a plain turn runs with k = 0
        await pilot.press("ctrl+n")
        assert not app.query("AssistantMessage") and app.history == []
        await pilot.press("f2")
        await pilot.press("f3", "f3", "f5", "f6", "f6")
        assert app.settings.num_draft == 1 and app.settings.temperature == pytest.approx(0.2)


@pytest.mark.anyio
async def test_bad_model_path_shows_error_not_traceback(tmp_path):
    app = make_app("--model", str(tmp_path / "no-such-model"))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: bool(app.query(".error")))
        assert app.loading is None and app.model_name is None
        (err,) = system_texts(app)
        assert "model not found" in err and "Traceback" not in err
        # typing without a model: a notification, no crash
        await send(pilot, "hi")
        assert not app.query("AssistantMessage")
        # switch model from the app: a folder without config.json is an error too
        (tmp_path / "empty").mkdir()
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.screen.__class__.__name__ == "OpenModelScreen")
        app.screen.query_one("#open-model").value = str(tmp_path / "empty")
        await pilot.click("#open-load")
        await until(pilot, lambda: len(app.query(".error")) == 2)
        assert "no config.json" in system_texts(app)[-1]
        assert app.is_running


@pytest.mark.anyio
async def test_switch_model_and_mtp_unavailable(tiny_model, tmp_path):
    app = make_app("--model", str(tmp_path / "missing"), "--max-tokens", "20")
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: bool(app.query(".error")))
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.screen.__class__.__name__ == "OpenModelScreen")
        app.screen.query_one("#open-model").value = str(tiny_model)
        app.screen.query_one("#open-drafter").value = "mtp"
        await pilot.click("#open-load")
        await until(pilot, lambda: app.model_name == MODEL_NAME)
        # the target loads; if no MTP drafter exists for it the loader's error is shown in the app
        if app.drafter_name == "none":
            assert "drafter 'mtp' unavailable" in system_texts(app)[-1]
        await send(pilot, "hi")
        await until(pilot, lambda: not app.generating)
        assert app.query("AssistantMessage")


@pytest.mark.anyio
async def test_no_default_model_asks_for_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_engine.models.default", None)  # as if it did not exist
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: bool(app.query(".error")))
        (err,) = system_texts(app)
        assert "--model" in err and "default" in err


def test_main_screen_snapshot(snap_compare, tiny_model):
    app = make_app("--model", str(tiny_model), "--drafter", "ngram", "--num-draft", "4", "--no-save")

    async def ready(pilot):
        await loaded(pilot, app)
        app.query_one("#prompt").cursor_blink = False
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(120, 36), run_before=ready)


@pytest.mark.anyio
async def test_num_draft_auto_runs(tiny_model):
    app = make_app("--model", str(tiny_model), "--drafter", "draft", "--draft-model", str(tiny_model),
                   "--num-draft", "auto", "--max-tokens", "30")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        await send(pilot, "hi")
        await until(pilot, lambda: not app.generating)
        panel = app.query_one("StatsPanel")
        assert "k auto" in panel.text
        assert panel.snapshot.stats["generated"] == 30
