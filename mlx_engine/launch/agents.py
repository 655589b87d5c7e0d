"""What each coding agent is given to talk to this server, and only for the one run `launch` starts: environment
variables, command-line overrides, or a temporary settings file, never the user's own config files. Each agent
gets the base URL and key, the served model under every model name it asks for, the context window it should
compact at, a request timeout that fits a long prefill, and its non-essential traffic (telemetry, update
checks, model catalogues) off.

FIRST_PROMPT: the tokens of each agent's first request as measured against the embedded model (SmolLM2's
tokenizer; another tokenizer counts within some tens of percent): a window under it cannot take the agent's
first turn, and `launch` refuses before the agent starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TIMEOUT_SECONDS = 3600  # a request may wait this long: a long prompt's prefill on a slow machine takes minutes
KEY_VARIABLE = "MLX_ENGINE_LAUNCH_KEY"  # the variable Codex reads the key from (its provider's env_key)
COMPACT_AT = 0.8  # of the window: where an agent that takes a token limit compacts


@dataclass(frozen=True)
class Server:
    """The server as the agent should see it (read from its /v1/models)."""
    url: str  # http://host:port (no /v1)
    model: str
    context_length: int
    api_key: str | None = None

    @property
    def key(self) -> str:
        return self.api_key or "none"  # a server without a key takes any; agents refuse an empty one


@dataclass
class Setup:
    """How to start one agent: its argv after the executable (before the user's own arguments), the variables
    added to (or, where None, taken out of) its environment, and files written to a temporary folder whose
    path replaces `{dir}` in argv and env."""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


def output_tokens(window: int) -> int:
    """An answer's share of the window an agent should ask for (agents send 32000 to every model)."""
    return max(256, min(32000, window // 4))


def claude(s: Server) -> Setup:
    """Claude Code: the Anthropic API at the server, every model tier (and subagents) the served model. Its
    auto-compact window is floored at 100,000 tokens by Claude Code itself (2.1.x): a smaller window is set
    anyway, and the server's 400 context_length_exceeded is what a too-long conversation meets."""
    m = s.model
    return Setup(env={
        "ANTHROPIC_BASE_URL": s.url, "ANTHROPIC_AUTH_TOKEN": s.key, "ANTHROPIC_API_KEY": None,
        "ANTHROPIC_MODEL": m, "ANTHROPIC_DEFAULT_OPUS_MODEL": m, "ANTHROPIC_DEFAULT_SONNET_MODEL": m,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": m, "ANTHROPIC_DEFAULT_FABLE_MODEL": m, "ANTHROPIC_SMALL_FAST_MODEL": m,
        "CLAUDE_CODE_SUBAGENT_MODEL": m,
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(s.context_length),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(s.context_length),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output_tokens(s.context_length)),
        "API_TIMEOUT_MS": str(TIMEOUT_SECONDS * 1000),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    })


def toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a TOML basic string


def codex(s: Server) -> Setup:
    """Codex CLI: a provider of its own given by `-c` overrides on its command line (its config.toml untouched),
    speaking the Responses API; the key from KEY_VARIABLE."""
    p = "model_providers.mlx_engine"
    overrides = {
        "model_provider": toml_string("mlx_engine"), "model": toml_string(s.model),
        f"{p}.name": toml_string("mlx-engine"), f"{p}.base_url": toml_string(s.url + "/v1"),
        f"{p}.wire_api": toml_string("responses"), f"{p}.env_key": toml_string(KEY_VARIABLE),
        f"{p}.stream_idle_timeout_ms": str(TIMEOUT_SECONDS * 1000),
        "model_context_window": str(s.context_length),
        "model_auto_compact_token_limit": str(int(s.context_length * COMPACT_AT)),
        "check_for_update_on_startup": "false", "analytics.enabled": "false",
    }
    argv = [a for k, v in overrides.items() for a in ("-c", f"{k}={v}")]
    return Setup(argv=argv, env={KEY_VARIABLE: s.key})


def opencode(s: Server) -> Setup:
    """opencode: a provider (`@ai-sdk/openai-compatible`) in OPENCODE_CONFIG_CONTENT, merged over the user's
    config for this run only; the model's context and output limits are what opencode compacts by."""
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlx-engine": {
            "npm": "@ai-sdk/openai-compatible", "name": "mlx-engine",
            "options": {"baseURL": s.url + "/v1", "apiKey": s.key, "timeout": TIMEOUT_SECONDS * 1000},
            "models": {s.model: {"name": s.model, "tool_call": True,
                                 "limit": {"context": s.context_length, "output": output_tokens(s.context_length)}}},
        }},
        "model": f"mlx-engine/{s.model}", "small_model": f"mlx-engine/{s.model}",
        "autoupdate": False, "share": "disabled",
    }
    return Setup(env={"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                      "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1",
                      "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"})


def qwen(s: Server) -> Setup:
    """Qwen Code: OpenAI's three variables, and a settings file of its own (QWEN_CODE_SYSTEM_SETTINGS_PATH, which
    overrides the user's and project's settings for this run) for the auth type, context window, timeout,
    compression threshold and usage statistics."""
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": s.model, "generationConfig": {"timeout": TIMEOUT_SECONDS * 1000,
                                                        "contextWindowSize": s.context_length},
                  "chatCompression": {"contextPercentageThreshold": COMPACT_AT}},
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"enableAutoUpdate": False},
    }
    return Setup(env={"OPENAI_BASE_URL": s.url + "/v1", "OPENAI_API_KEY": s.key, "OPENAI_MODEL": s.model,
                      "QWEN_CODE_SYSTEM_SETTINGS_PATH": "{dir}/qwen-settings.json"},
                 files={"qwen-settings.json": json.dumps(settings, indent=1)})


def aider(s: Server) -> Setup:
    """aider: LiteLLM's openai/ provider at the server through OPENAI_API_BASE, its AIDER_* variables for the
    model, a model-metadata file (the window aider budgets by, no cost), the timeout, and analytics (for this
    session: AIDER_ANALYTICS, not AIDER_ANALYTICS_DISABLE, which writes "disabled" into ~/.aider for good) and
    update checks off."""
    name = f"openai/{s.model}"
    metadata = {name: {"max_input_tokens": s.context_length, "max_tokens": s.context_length,
                       "max_output_tokens": output_tokens(s.context_length), "input_cost_per_token": 0.0,
                       "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}}
    return Setup(env={"OPENAI_API_BASE": s.url + "/v1", "OPENAI_API_KEY": s.key, "AIDER_MODEL": name,
                      "AIDER_WEAK_MODEL": name, "AIDER_EDITOR_MODEL": name,
                      "AIDER_MODEL_METADATA_FILE": "{dir}/aider-models.json", "AIDER_TIMEOUT": str(TIMEOUT_SECONDS),
                      "AIDER_ANALYTICS": "false", "AIDER_CHECK_UPDATE": "false",
                      "AIDER_SHOW_RELEASE_NOTES": "false", "AIDER_SHOW_MODEL_WARNINGS": "false"},
                 files={"aider-models.json": json.dumps(metadata, indent=1)})


@dataclass(frozen=True)
class Agent:
    name: str
    executable: str
    configure: object  # Server -> Setup
    first_prompt: int  # tokens of its first request (see the module's docstring; 0: not measured, not checked)
    install: str  # how to get it


AGENTS = {a.name: a for a in [
    Agent("claude", "claude", claude, 20937, "npm install -g @anthropic-ai/claude-code"),  # 2.1.197, `-p`
    Agent("codex", "codex", codex, 6172, "npm install -g @openai/codex"),  # 0.171.0, `exec`
    Agent("opencode", "opencode", opencode, 7602, "npm install -g opencode-ai"),  # 1.18.33, `run`
    Agent("qwen", "qwen", qwen, 15754, "npm install -g @qwen-code/qwen-code"),  # 0.15.10, `-p`
    Agent("aider", "aider", aider, 0, "pip install aider-chat"),
]}


def too_small(agent: Agent, window: int) -> str | None:
    """Why a model's window cannot take this agent's first request, with the numbers and what to do (None: it can)."""
    if agent.first_prompt <= window:
        return None
    return (f"{agent.name}'s first request is about {agent.first_prompt:,} tokens (its system prompt and tools), more "
            f"than this model's context window of {window:,}: every turn would be refused. Serve a model with a "
            f"window of at least {agent.first_prompt + output_tokens(agent.first_prompt):,} tokens (--model), or "
            f"pass --force to start it anyway")
