"""What an agent reads from the server (issue 54), on a tiny model whose checkpoint carries a generation_config.json:
/v1/models' context window, drafter, mode and sampling defaults; the prefix cache's share of a prompt in each
API's own usage field (a resent prompt: what the engine reused; a cold one: 0); keepalives on a stream while its
prefill is slowed on purpose, in each API's form; a request resent after its client left leaves one job running;
the checkpoint's sampling as the defaults of a request that names none, each value a request names winning."""

import json
import threading
import time

import anthropic
import httpx2 as httpx
import openai
import pytest

from mlx_engine.models.generation_config import sampling_defaults
from mlx_engine.serve.main import defaults_line
from model_dirs import save_tiny
from serve_util import RunningServer

WINDOW = 1024
RECOMMENDED = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3, "do_sample": True,
               "max_new_tokens": 99, "eos_token_id": 0}
LONG = " ".join(f"item {i} is the {i % 7}th colour of the quick brown fox" for i in range(5))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp("agent") / "model", "llama", seed=3, max_position_embeddings=WINDOW)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    s = RunningServer("--model", str(folder), "--max-tokens", "8", "--keepalive", "0.2", "--no-prefix-cache-dir")
    engine = s.service.worker.engine
    s.slow = 0.0  # seconds each engine step sleeps while a prompt is being prefilled (a slow prefill on purpose)
    s.seen = []  # the sampling each request reached the engine with
    step, add = engine.step, engine.add

    def slowed_step():
        if s.slow and engine.prefilling():
            time.sleep(s.slow)
        return step()

    def recorded_add(seq_id, prompt, max_tokens, sampling=None, *a, **kw):
        s.seen.append(sampling)
        return add(seq_id, prompt, max_tokens, sampling, *a, **kw)

    engine.step, engine.add = slowed_step, recorded_add
    yield s
    s.close()


def health(server) -> dict:
    return httpx.get(server.base + "/health").json()


def hit_tokens(server) -> int:
    return health(server)["prefix_cache"]["hit_tokens"]


def test_models_say_the_window_the_drafter_the_mode_and_the_checkpoint_sampling(server):
    card = httpx.get(server.base + "/v1/models").json()["data"][0]
    assert card["id"] == server.model and card["object"] == "model"
    assert card["context_length"] == card["max_model_len"] == WINDOW == server.service.context_length
    assert card["drafter"] == "none" and card["mode"] == "continuous"
    assert card["sampling_defaults_source"] == "generation_config.json"
    assert card["sampling_defaults"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
                                         "repetition_penalty": 1.3, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert "temperature 0.7" in defaults_line(server.service) and "top_k 5" in defaults_line(server.service)
    assert openai.OpenAI(base_url=server.base + "/v1", api_key="none").models.list().data[0].id == server.model


def test_generation_config_reads_only_sampling_and_keeps_do_sample_false_greedy(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1, "top_k": "x"}))
    assert sampling_defaults(tmp_path) == {"repetition_penalty": 1.1}
    assert sampling_defaults(tmp_path / "missing") == {} and sampling_defaults(tmp_path / "m.gguf") == {}


def test_checkpoint_sampling_is_the_default_and_a_named_value_wins_in_every_api(server):
    oa = server.client()
    msgs = [{"role": "user", "content": "hello"}]
    server.seen.clear()
    oa.chat.completions.create(model=server.model, messages=msgs, max_tokens=2)
    oa.chat.completions.create(model=server.model, messages=msgs, max_tokens=2, temperature=0,
                               extra_body={"repetition_penalty": 1.0, "top_k": None})
    oa.completions.create(model=server.model, prompt="hello", max_tokens=2, top_p=0.5)
    oa.responses.create(model=server.model, input="hello", max_output_tokens=2, temperature=0.2)
    an = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)
    an.messages.create(model=server.model, max_tokens=2, messages=msgs)
    an.messages.create(model=server.model, max_tokens=2, messages=msgs, extra_body={"top_k": 2})
    got = [(s.temperature, s.top_k, s.top_p, s.repetition_penalty) for s in server.seen]
    assert got == [(0.7, 5, 0.9, 1.3),  # nothing named: the checkpoint's
                   (0.0, 5, 0.9, 1.0),  # temperature and repetition_penalty named; top_k null = not named
                   (0.7, 5, 0.5, 1.3), (0.2, 5, 0.9, 1.3), (0.7, 5, 0.9, 1.3), (0.7, 2, 0.9, 1.3)]


def test_cached_tokens_are_the_reused_prefix_in_all_three_apis(server):
    oa = server.client()
    an = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)

    def chat(tag):
        r = oa.chat.completions.create(model=server.model, max_tokens=2, temperature=0,
                                       messages=[{"role": "user", "content": tag + LONG}])
        return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    def responses(tag):
        r = oa.responses.create(model=server.model, input=tag + LONG, max_output_tokens=2, temperature=0)
        return r.usage.input_tokens_details.cached_tokens, r.usage.input_tokens

    def messages(tag):
        m = an.messages.create(model=server.model, max_tokens=2,
                               messages=[{"role": "user", "content": tag + LONG}])
        u = m.usage  # Anthropic's three input counts add up to the prompt
        assert u.cache_creation_input_tokens == 0
        return u.cache_read_input_tokens, u.input_tokens + u.cache_read_input_tokens

    def streamed_messages(tag):
        with an.messages.stream(model=server.model, max_tokens=2,
                                messages=[{"role": "user", "content": tag + LONG}]) as s:
            u = s.get_final_message().usage
        return u.cache_read_input_tokens, u.input_tokens + u.cache_read_input_tokens

    def streamed_chat(tag):
        chunks = list(oa.chat.completions.create(model=server.model, max_tokens=2, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": tag + LONG}]))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens, chunks[-1].usage.prompt_tokens

    for i, ask in enumerate([chat, responses, messages, streamed_messages, streamed_chat]):
        tag = f"Request {i} of a kind of its own. "
        before = hit_tokens(server)
        cold, prompt = ask(tag)
        assert cold == 0 and hit_tokens(server) == before, ask.__name__  # nothing reused: says 0
        again, prompt_again = ask(tag)  # the same prompt resent: its prefix comes from the prefix cache
        reused = hit_tokens(server) - before
        assert prompt_again == prompt and again == reused and 0 < again < prompt, (ask.__name__, again, reused, prompt)


def sse_lines(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", server.base + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_stream_gets_keepalives_while_its_prefill_is_slow_and_a_plain_answer_none(server):
    msgs = [{"role": "user", "content": "Keepalive please. " + LONG}]
    server.slow = 0.3
    try:
        chat = sse_lines(server, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 3,
                                                          "stream": True, "temperature": 0})
        first_text = next(i for i, ln in enumerate(chat) if '"content": "' in ln and '"content": ""' not in ln)
        assert chat[1:first_text].count(": keepalive") >= 2, chat[:first_text]  # after the role chunk, before text
        assert chat[-1] == "data: [DONE]"
        resp = sse_lines(server, "/v1/responses", {"model": "m", "input": "Keepalive again. " + LONG,
                                                   "max_output_tokens": 3, "stream": True, "temperature": 0})
        assert resp.count(": keepalive") >= 2 and resp[-1].startswith("data: ") and ("response.completed" in resp[-1] or "response.incomplete" in resp[-1])
        msg = sse_lines(server, "/v1/messages", {"model": "m", "max_tokens": 3, "stream": True, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "And pings. " + LONG}]})
        events = [ln.removeprefix("event: ") for ln in msg if ln.startswith("event: ")]
        start = events.index("content_block_start")
        assert events[0] == "message_start" and events[1:start].count("ping") >= 3, events  # one at once, then more
        # the SDKs read through them: the same text as the plain answer, which has no keepalive in its body
        text = "".join(c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
            model="m", messages=msgs, max_tokens=3, temperature=0, stream=True) if c.choices)
    finally:
        server.slow = 0.0
    plain = server.client().chat.completions.create(model="m", messages=msgs, max_tokens=3, temperature=0)
    assert text == plain.choices[0].message.content


def test_a_request_resent_after_its_client_left_leaves_one_job_running(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "Resent. " + LONG}], "max_tokens": 3,
            "stream": True, "temperature": 0}
    before = health(server)
    server.slow = 0.3
    try:
        with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # its first chunk: the job is in; then the client gives up
            deadline = time.time() + 30
            while not health(server)["prefilling"] and time.time() < deadline:
                time.sleep(0.05)
        second = {}
        t = threading.Thread(target=lambda: second.update(lines=sse_lines(server, "/v1/chat/completions", body)))
        t.start()
        deadline, states = time.time() + 30, []
        while time.time() < deadline:  # until the first one is counted cancelled
            h = health(server)
            states.append((h["running"], h["queued"], len(h["prefilling"])))
            if h["cancelled"] > before["cancelled"]:
                break
            time.sleep(0.05)
        assert h["cancelled"] == before["cancelled"] + 1, states
        after_cancel = health(server)
        assert after_cancel["running"] + after_cancel["queued"] <= 1 and len(after_cancel["prefilling"]) <= 1
        t.join(60)
        assert second["lines"][-1] == "data: [DONE]"
        end = health(server)
        assert end["served"] == before["served"] + 1 and end["running"] == 0 and end["cancelled"] == h["cancelled"]
    finally:
        server.slow = 0.0


def test_no_generation_config_keeps_the_server_defaults(tmp_path):
    folder = save_tiny(tmp_path / "model", "llama", seed=3)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    s = RunningServer("--model", str(folder), "--no-generation-config", "--no-prefix-cache-dir")
    try:
        card = httpx.get(s.base + "/v1/models").json()["data"][0]
        assert card["sampling_defaults_source"] == "server" and card["sampling_defaults"]["temperature"] == 0.0
        assert card["context_length"] == 4096  # a config naming no window: the server's 4096
    finally:
        s.close()


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
def test_cached_tokens_on_a_hybrid_and_a_sliding_window_model(tmp_path, family):
    """The reused share where the prefix tree restores a recurrent checkpoint (qwen3_next) or sliding windows
    (gpt_oss): 0 cold, then exactly the tokens the tree reused."""
    s = RunningServer("--model", str(save_tiny(tmp_path / "model", family, seed=3)), "--max-tokens", "2",
                      "--no-prefix-cache-dir")
    try:
        oa = s.client()
        ask = [{"role": "user", "content": "A question of its own. " + LONG}]
        cold = oa.chat.completions.create(model=s.model, max_tokens=2, temperature=0, messages=ask).usage
        before = hit_tokens(s)
        again = oa.chat.completions.create(model=s.model, max_tokens=2, temperature=0, messages=ask).usage
        reused = hit_tokens(s) - before
        assert cold.prompt_tokens_details.cached_tokens == 0 and again.prompt_tokens == cold.prompt_tokens
        assert again.prompt_tokens_details.cached_tokens == reused and 0 < reused < again.prompt_tokens
    finally:
        s.close()
