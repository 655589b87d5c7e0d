"""A stand-in coding agent for the `launch` tests: writes what it was given (its arguments, its environment, the
files its variables name, as they are while it runs) to $STUB_OUT as JSON, then asks the server one question the
way the agent would (its own API, base URL, key and model name, all from what it was given) and records the
answer's status. Exits with $STUB_EXIT (default 0)."""

import json
import os
import sys
import urllib.request

FILES = ("QWEN_CODE_SYSTEM_SETTINGS_PATH", "AIDER_MODEL_METADATA_FILE")


def ask(url: str, key: str, body: dict, anthropic: bool = False) -> int:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if anthropic:
        headers["x-api-key"] = key
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def question(agent: str, env: dict, argv: list[str]) -> int:
    hi = [{"role": "user", "content": "hi"}]
    if agent == "claude":
        return ask(env["ANTHROPIC_BASE_URL"] + "/v1/messages", env["ANTHROPIC_AUTH_TOKEN"],
                   {"model": env["ANTHROPIC_DEFAULT_SONNET_MODEL"], "max_tokens": 1, "messages": hi}, anthropic=True)
    if agent == "codex":
        pairs = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-c")
        base = json.loads(pairs["model_providers.mlx_engine.base_url"])
        key = env[json.loads(pairs["model_providers.mlx_engine.env_key"])]
        return ask(base + "/responses", key, {"model": json.loads(pairs["model"]), "input": "hi",
                                              "max_output_tokens": 1})
    if agent == "opencode":
        provider = json.loads(env["OPENCODE_CONFIG_CONTENT"])["provider"]["mlx-engine"]
        model = next(iter(provider["models"]))
        return ask(provider["options"]["baseURL"] + "/chat/completions", provider["options"]["apiKey"],
                   {"model": model, "max_tokens": 1, "messages": hi})
    if agent == "qwen":
        return ask(env["OPENAI_BASE_URL"] + "/chat/completions", env["OPENAI_API_KEY"],
                   {"model": env["OPENAI_MODEL"], "max_tokens": 1, "messages": hi})
    return ask(env["OPENAI_API_BASE"] + "/chat/completions", env["OPENAI_API_KEY"],
               {"model": env["AIDER_MODEL"].removeprefix("openai/"), "max_tokens": 1, "messages": hi})


def main() -> int:
    env = dict(os.environ)
    files = {name: open(env[name]).read() for name in FILES if name in env}
    record = {"argv": sys.argv[1:], "env": env, "files": files}
    record["status"] = question(env["STUB_AGENT"], env, sys.argv[1:])
    with open(env["STUB_OUT"], "w") as f:
        json.dump(record, f)
    return int(env.get("STUB_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
