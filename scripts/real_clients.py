"""Real clients against a running `serve`: the official openai and anthropic SDKs (structured output, tools,
the Responses API) and a long prompt streamed (anthropic) with a short one (openai) arriving 3 s later.

    .venv/bin/python -m mlx_engine serve --drafter mtp --port 8765 &
    .venv/bin/python scripts/real_clients.py [URL=http://127.0.0.1:8765] [REPEAT=1]

REPEAT: copies of bench/prompts/long.jsonl's first text in the long prompt (4: ~6.6k tokens). Every answer is
checked (jsonschema for the JSON and the tool arguments); the times printed are what each client waited.
"""
import json
import sys
import threading
import time
from pathlib import Path

import anthropic
import jsonschema
import openai

ROOT = Path(__file__).resolve().parents[1]

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8765"
oa = openai.OpenAI(base_url=base + "/v1", api_key="x")
an = anthropic.Anthropic(base_url=base, api_key="x")
row = json.loads(open(str(ROOT / "mlx_engine/train/data/prompts_json_eval.jsonl")).readline())
schema = row["response_format"]["json_schema"]["schema"]

t = time.time()
r = oa.chat.completions.create(model="default", messages=row["messages"], response_format=row["response_format"],
                               max_tokens=300, temperature=0)
text = r.choices[0].message.content
jsonschema.validate(json.loads(text), schema)
print(f"openai json_schema: valid, {r.usage.completion_tokens} tokens, {time.time()-t:.1f} s: {text[:120]}")

tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
          "strict": True, "parameters": {"type": "object", "properties": {"city": {"type": "string"},
          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
          "additionalProperties": False}}}]
t = time.time()
r = oa.chat.completions.create(model="default", messages=[{"role": "user", "content": "What's the weather in Porto in celsius?"}],
                               tools=tools, tool_choice="required", max_tokens=100, temperature=0)
call = r.choices[0].message.tool_calls[0]
args = json.loads(call.function.arguments)
jsonschema.validate(args, tools[0]["function"]["parameters"])
print(f"openai tool_choice required: {call.function.name}({args}), finish={r.choices[0].finish_reason}, {time.time()-t:.1f} s")

t = time.time()  # tool_choice auto with a strict tool: free text, or a call held to the schema
r = oa.chat.completions.create(model="default", messages=[{"role": "user", "content": "What's the weather in Porto in celsius?"}],
                               tools=tools, tool_choice="auto", max_tokens=100, temperature=0)
msg = r.choices[0].message
for call in msg.tool_calls or []:
    jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
print(f"openai tool_choice auto (strict tool): calls {[(c.function.name, c.function.arguments) for c in msg.tool_calls or []]}, "
      f"text {(msg.content or '')[:60]!r}, finish={r.choices[0].finish_reason}, {time.time()-t:.1f} s")

t = time.time()
m = an.messages.create(model="default", max_tokens=100, messages=[{"role": "user", "content": "Weather in Graz, fahrenheit?"}],
                       tools=[{"name": "get_weather", "description": "Current weather for a city",
                               "input_schema": tools[0]["function"]["parameters"]}],
                       tool_choice={"type": "tool", "name": "get_weather"})
use = [b for b in m.content if b.type == "tool_use"][0]
jsonschema.validate(use.input, tools[0]["function"]["parameters"])
print(f"anthropic tool_choice tool: {use.name}({use.input}), stop={m.stop_reason}, {time.time()-t:.1f} s")

t = time.time()
rr = oa.responses.create(model="default", input="Say hello in French, one word.", max_output_tokens=16)
print(f"openai responses: {rr.output_text!r}, {time.time()-t:.1f} s")

# a long prompt streamed (anthropic SDK) while a short one (openai SDK, streamed) arrives 3 s later
long_text = json.loads(open(str(ROOT / "bench/prompts/long.jsonl")).readline())["messages"][0]["content"]
long_text = (long_text + "\n\n") * int(sys.argv[2] if len(sys.argv) > 2 else 1)
res = {}
def long_req():
    t0 = time.time(); first = None; n = 0
    with an.messages.stream(model="default", max_tokens=32, messages=[{"role": "user", "content": long_text}]) as s:
        for ev in s.text_stream:
            first = first or time.time() - t0; n += 1
        fin = s.get_final_message()
    res["long"] = (first, time.time() - t0, fin.usage.input_tokens, fin.usage.output_tokens)
th = threading.Thread(target=long_req); th.start()
time.sleep(3)
t0 = time.time(); first = None
st = oa.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
for ch in st:
    if ch.choices and ch.choices[0].delta.content and first is None:
        first = time.time() - t0
print(f"short beside long: first token after {first:.2f} s (openai stream)")
th.join()
f, tot, inp, out = res["long"]
print(f"long (anthropic stream): {inp} prompt tokens, first token {f:.1f} s, done {tot:.1f} s, {out} tokens")
