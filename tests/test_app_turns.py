"""The chat's turns, through Textual's Pilot on the tiny model of test_app.py: what is typed while the model
loads is queued and sent once loaded; F3/F4 reach `auto`, F8 sets it, a restored fixed k is shown with its
undo; the speedup compares answers to the same prompt only; a prompt beyond the context window is refused
before the engine sees it; a long prompt's prefill shows progress and Esc stops it within one chunk."""

import json
import threading
import time

import pytest

from test_app import (  # noqa: F401  (fixtures: anyio_backend, config_dir, tiny_model)
    MODEL_NAME, anyio_backend, config_dir, loaded, make_app, save_tiny_model, send, system_texts, tiny_model, until,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def texts(app, kind: str) -> list[str]:
    return [str(m.render()) for m in app.query(kind)]


# -- pure parts --------------------------------------------------------------------------------------
def test_k_steps_through_auto_and_holds_at_the_ends():
    from app.settings import K_MAX, step_k

    assert step_k("auto", +1) == 1 and step_k(1, -1) == "auto" and step_k("auto", -1) == "auto"
    assert step_k(3, +1) == 4 and step_k(3, -1) == 2 and step_k(K_MAX, +1) == K_MAX
    k = 13
    for _ in range(13):
        k = step_k(k, -1)
    assert k == "auto"  # a restored k 13 goes back to auto with F3 alone


def test_speedup_pairs_compare_the_same_prompt_only():
    from app.messages import TurnTiming
    from app.speedup import SpeedupPairs

    pairs = SpeedupPairs()
    assert pairs.summary().ratio is None and "no answer measured yet" in pairs.summary().reason
    pairs.record("code-edit", TurnTiming(spec_tokens=400, spec_time=4.0))  # 100 tok/s, prompt lookup's best case
    assert "no plain (spec off) turn yet" in pairs.summary().reason
    pairs.record("story", TurnTiming(plain_tokens=100, plain_time=5.0))  # 20 tok/s on another prompt
    assert pairs.summary().ratio is None and "no prompt answered both ways" in pairs.summary().reason  # not 5x
    pairs.record("story", TurnTiming(spec_tokens=150, spec_time=6.0))  # 25 tok/s on the same prompt
    s = pairs.summary()
    assert s.pairs == 1 and s.ratio == pytest.approx(25 / 20) and s.spec_tps == pytest.approx(25)
    pairs.record("story", TurnTiming(spec_tokens=10, spec_time=1.0, plain_tokens=10, plain_time=1.0))
    assert pairs.mixed == 1 and pairs.summary().ratio == pytest.approx(25 / 20)  # a mixed turn changes nothing


# -- typing while the model loads --------------------------------------------------------------------
@pytest.mark.anyio
async def test_messages_typed_while_loading_are_queued_and_sent_once_loaded(tiny_model, monkeypatch):
    import app.worker as worker

    release, real_load = threading.Event(), worker.load_model

    def slow_load(path):
        release.wait(30)
        return real_load(path)

    monkeypatch.setattr(worker, "load_model", slow_load)
    app = make_app("--model", str(tiny_model), "--drafter", "ngram", "--max-tokens", "12", "--no-save")
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.loading is not None and app.loading.is_mounted)
        assert app.focused is app.query_one("#prompt")  # the input is usable while loading
        await send(pilot, "hi there", type_it=True)
        await send(pilot, "and again")
        assert texts(app, "UserMessage") == ["hi there", "and again"] and not app.query("AssistantMessage")
        assert texts(app, ".queued") == ["queued: sent once the model has loaded"] * 2
        assert app.query_one("#prompt").value == ""
        release.set()
        await until(pilot, lambda: len(app.history) == 4 and not app.generating, timeout=30)
        assert [m["role"] for m in app.history] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in app.history[::2]] == ["hi there", "and again"]
        assert not app.query(".queued") and len(app.query("AssistantMessage")) == 2
        assert texts(app, "UserMessage") == ["hi there", "and again"]  # each shown once


# -- the draft length keys ---------------------------------------------------------------------------
@pytest.mark.anyio
async def test_k_keys_reach_auto_and_a_restored_fixed_k_is_shown_and_undone(tiny_model, config_dir):
    from app.settings import Settings

    Settings(num_draft=13).save()
    app = make_app("--model", str(tiny_model), "--drafter", "ngram")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        panel = app.query_one("StatsPanel")
        (notice,) = [t for t in system_texts(app) if "restored" in t]
        assert "k 13 (fixed)" in notice and "F8 sets k auto" in notice and "--reset" in notice
        assert "restored from settings.json: k 13 (F8: k auto" in panel.text
        await pilot.press("f8")
        assert app.settings.num_draft == "auto" and "k auto (adaptive)" in panel.text
        assert "restored from" not in panel.text
        assert json.loads((config_dir / "settings.json").read_text())["num_draft"] == "auto"
        await pilot.press("f4")
        assert app.settings.num_draft == 1
        await pilot.press("f4", "f4")
        assert app.settings.num_draft == 3
        await pilot.press("f3", "f3", "f3")  # 2, 1, then auto again
        assert app.settings.num_draft == "auto"
        await pilot.press("f3")
        assert app.settings.num_draft == "auto"
        assert app.worker_thread._num_draft == "auto"  # the worker drafts with auto from the next cycle


# -- the speedup, like with like ---------------------------------------------------------------------
@pytest.mark.anyio
async def test_the_speedup_compares_answers_to_the_same_prompt(tiny_model):
    app = make_app("--model", str(tiny_model), "--drafter", "draft", "--draft-model", str(tiny_model),
                   "--num-draft", "3", "--max-tokens", "40", "--no-save")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        panel = app.query_one("StatsPanel")
        await send(pilot, "hi")  # speculative, everything accepted
        await until(pilot, lambda: not app.generating and app.current is None)
        assert "no plain (spec off) turn yet" in panel.text
        await pilot.press("f2")
        await send(pilot, "tell me more")  # plain, on another prompt: no comparison
        await until(pilot, lambda: not app.generating and app.current is None)
        assert "no prompt answered both ways yet" in panel.text and "x  spec" not in panel.text
        await pilot.press("f2", "ctrl+r")  # the same prompt answered again, speculation on
        await until(pilot, lambda: not app.generating and app.current is None)
        assert [m["content"] for m in app.history if m["role"] == "user"] == ["hi", "tell me more"]
        assert len(app.query("AssistantMessage")) == 2  # the answer was replaced, not added
        (pair,) = [t for t in app.pairs.turns.values() if len(t) == 2]
        want = pair["spec"].spec_tps / pair["plain"].plain_tps
        s = app.pairs.summary()
        assert s.pairs == 1 and s.ratio == pytest.approx(want)
        assert f"{want:5.2f}x  spec {pair['spec'].spec_tps:.1f} / plain {pair['plain'].plain_tps:.1f} tok/s, 1 prompt" \
            in panel.text


# -- the context window ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_context_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("ctx") / MODEL_NAME, max_position_embeddings=96)


@pytest.mark.anyio
async def test_a_prompt_beyond_the_context_window_is_refused_before_the_engine(small_context_model):
    app = make_app("--model", str(small_context_model), "--drafter", "ngram", "--max-tokens", "16", "--no-save")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        assert "context 96 tokens" in texts(app, "SystemMessage")[0]
        engine, calls = app.worker_thread.engine, []
        real_generate = engine.generate
        engine.generate = lambda *a, **k: calls.append(a) or real_generate(*a, **k)
        from app.chat_text import encode_chat

        def tokens(text):
            return len(encode_chat(app.worker_thread.loaded.tokenizer, [{"role": "user", "content": text}]))

        too_long = "the quick brown fox jumps over the lazy dog " * 12
        words = "the quick brown fox jumps over the lazy dog".split()
        no_room = next(t for n in range(1, 200) if 80 < tokens(t := " ".join(words[i % 9] for i in range(n))) < 96)
        for text, said in ((too_long, "context window is 96 tokens"),
                           (no_room, f"ask for at most {96 - tokens(no_room)} new tokens")):
            await send(pilot, text)
            await until(pilot, lambda: not app.generating and bool(app.query(".error")))
            (err,) = texts(app, ".error")
            assert err.startswith("Not sent:") and said in err and "ctrl+n" in err, err
            assert calls == [] and app.history == [] and not app.query("AssistantMessage")
            assert app.query_one("#prompt").value == text.strip()  # back in the box, to be shortened
            await app.query_one(".error").remove()
            app.query_one("#prompt").value = ""
        await send(pilot, "hi")  # a prompt that fits goes through
        await until(pilot, lambda: not app.generating and app.current is None)
        assert len(calls) == 1 and [m["role"] for m in app.history] == ["user", "assistant"]


# -- a long prompt: progress, and Esc between chunks -------------------------------------------------
@pytest.mark.anyio
async def test_a_long_prefill_shows_progress_and_esc_stops_it_within_one_chunk(tiny_model):
    from app.messages import PrefillProgress

    app = make_app("--model", str(tiny_model), "--drafter", "ngram", "--max-tokens", "8", "--no-save")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        worker = app.worker_thread
        worker.prefill_step, worker.prefill_bar_min = 16, 32
        events, real_post, real_stop, pressed = [], worker.post, worker.stop, threading.Event()

        def post(msg):  # on the worker thread, between two prefill chunks
            real_post(msg)
            if isinstance(msg, PrefillProgress):
                events.append(("chunk", time.monotonic(), msg.done, msg.total))
                if msg.done >= 64:
                    pressed.wait(10)  # the prompt is being read when Esc lands (no race with a fast prefill)

        def stop():
            events.append(("stop", time.monotonic()))
            real_stop()
            pressed.set()

        worker.post, worker.stop = post, stop
        await send(pilot, "the quick brown fox jumps over the lazy dog " * 40)
        await until(pilot, lambda: app.current is not None and app.current.prefill is not None
                    and app.current.prefill[0] >= 64)
        answer = app.current
        bar = answer.query_one(".prefill")
        assert bar.display and "reading the prompt" in answer.border_subtitle
        await pilot.press("escape")
        await until(pilot, lambda: not app.generating)
        stopped_at = next(t for kind, t, *_ in events if kind == "stop")
        after = [e for e in events if e[0] == "chunk" and e[1] > stopped_at]
        assert len(after) <= 1  # the chunk under way ends; no other starts
        chunks = [e for e in events if e[0] == "chunk"]
        done, total = chunks[-1][2], chunks[-1][3]
        assert chunks[0][2] == 0 and 0 < done < total and all(b[2] - a[2] == 16 for a, b in zip(chunks, chunks[1:]))
        assert answer.text == "" and not bar.display
        assert answer.border_subtitle.startswith(f"stopped while reading the prompt ({done:,} of {total:,} tokens")
        # answered again: the cache kept what was read, so only the rest is prefilled
        await pilot.press("ctrl+r")
        await until(pilot, lambda: not app.generating and app.current is None, timeout=30)
        panel = app.query_one("StatsPanel")
        assert panel.snapshot.reprefill <= total - done + 1 and app.history[-1]["role"] == "assistant"


# -- memory: --kv-bits, --max-memory -----------------------------------------------------------------
@pytest.mark.anyio
async def test_kv_bits_that_the_model_cannot_take_fail_the_load_with_the_reason(tiny_model):
    app = make_app("--model", str(tiny_model), "--drafter", "ngram", "--kv-bits", "4", "--no-save")  # head dim 12
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: bool(app.query(".error")))
        (err,) = texts(app, ".error")
        assert "cannot be quantized to 4 bits in groups of 64" in err, err


@pytest.mark.anyio
async def test_a_message_over_the_memory_budget_is_not_sent(tiny_model):
    from mlx_engine.core.memory import plan
    from mlx_engine.models import load
    from mlx_engine.target_model.model import Target

    m = load(str(tiny_model))
    b = plan(m.model, None, Target(m.model))
    budget = b.base + 60 * b.kv_per_token  # room for 60 positions beside the weights
    app = make_app("--model", str(tiny_model), "--drafter", "ngram", "--max-tokens", "16", "--max-memory",
                   str(budget), "--no-save")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app)
        await send(pilot, "the quick brown fox jumps over the lazy dog " * 8)
        await until(pilot, lambda: not app.generating and bool(app.query(".error")))
        (err,) = texts(app, ".error")
        assert "KV cache" in err and "--max-memory" in err and not app.query("AssistantMessage"), err
        await app.query_one(".error").remove()
        app.query_one("#prompt").value = ""
        await send(pilot, "hi")  # one that fits goes through
        await until(pilot, lambda: not app.generating and app.current is None)
        assert [m["role"] for m in app.history] == ["user", "assistant"]
