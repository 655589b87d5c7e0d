"""The request bodies of /v1/chat/completions and /v1/completions (pydantic), and what they ask of the
engine. Every field is checked here, before anything is queued: JSON types as OpenAI documents them
(strict: `true` is not a number, `2.0` is not an integer), ranges, and `null` wherever OpenAI allows it
(null = the field's default). Fields this server cannot honour (`n > 1`, `echo`, `best_of`, ...) are
refused with a 400 naming them instead of being ignored; fields with no effect on the output (`user`,
`metadata`, ...) are ignored. presence_penalty, frequency_penalty and logit_bias act in the target and in
the acceptance rule alike (sampling.py); logprobs / top_logprobs (chat) and logprobs (completions) are the
target's (Step.logprobs). Tools (`tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls` and `tool` messages) and reasoning (`reasoning_content` in the
history, `chat_template_kwargs`, `reasoning_effort`) are taken (turn.py renders them). `response_format` (text, json_object,
json_schema; regex and lark as extensions, on completions too) is checked for its shape here and compiled
against the model's tokenizer in intake.py. Sampling extras beyond OpenAI's API: `top_k`, `min_p`,
`repetition_penalty`, `num_draft`. The default
temperature is 0 (greedy), as in mlx-lm's server: a local server's default should be the reproducible answer."""

from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import SamplingConfig

SEED_LIMIT = 2**63  # seeds are in [0, 2**63): MLX's key takes an unsigned 64-bit seed; OpenAI's is a signed int64


def check_text(value: str, what: str) -> str:
    """Text must encode as UTF-8: JSON's \\ud800 escapes make lone surrogates no tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate ({value[e.start]!r} at character {e.start}), "
                         f"which is not valid Unicode text") from None
    return value


class Unsupported(ValueError):
    pass


FORMATS = ("text", "json_object", "json_schema", "regex", "lark")  # response_format types (grammar/requests.py)


class NullIsDefault(BaseModel):
    """A request body: strict JSON types, unknown fields ignored, null where a field is optional = its default."""
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's optional fields take null for 'not given': drop them so their defaults apply."""
        if isinstance(data, dict):
            required = {name for name, f in cls.model_fields.items() if f.is_required()}
            return {k: v for k, v in data.items() if v is not None or k in required}
        return data


class StopSeedDraft(NullIsDefault):
    """stop, seed and num_draft, checked alike on chat completions, completions and responses."""
    stop: Union[str, list[str]] = Field(default_factory=list)
    seed: int | None = None
    # per request: k >= 0 or auto (default: the server's); in continuous batching, a ceiling on the row's own k
    num_draft: Union[int, Literal["auto"], None] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [check_text(s, "a stop sequence") for s in stops]

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if not 0 <= v < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {v}")
        return v

    @field_validator("num_draft")
    @classmethod
    def _num_draft(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError("num_draft must be >= 0 or 'auto'")
        return v


class _Body(StopSeedDraft):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] = Field(default_factory=dict)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict = Field(default_factory=dict)
    response_format: dict = Field(default_factory=lambda: {"type": "text"})

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise Unsupported(f"n = {v} is not supported: one choice per request (send {v} requests)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in v.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        kind = v.get("type")
        if kind not in FORMATS:
            raise Unsupported(f"response_format type {kind!r} is not supported: one of {', '.join(FORMATS)}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format json_schema needs a 'json_schema' object whose 'schema' is an object")
        if kind in ("regex", "lark") and not isinstance(v.get(kind), str):
            raise ValueError(f"response_format {kind} needs a '{kind}' string")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v):
        if not isinstance(v.get("include_usage", False), (bool, type(None))):
            raise ValueError("stream_options.include_usage must be true or false")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options.get("include_usage"))

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              logit_bias={int(k): v for k, v in self.logit_bias.items()})

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None
    tool_calls: list[dict] | None = None  # an assistant's calls: [{"id", "type": "function", "function": {...}}]
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's reasoning, sent back (DeepSeek's and vLLM's name)
    reasoning: str | None = None  # the same, as mlx-lm and OpenRouter name it

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v):
        for i, c in enumerate(v or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tool_calls[{i}] needs a 'function' object with a 'name'")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string")
        return v

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind != "text":
                    raise Unsupported(f"content part {i} is of type {kind!r}: only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} has no 'text' string")
                check_text(part["text"], f"content part {i}")
        elif isinstance(v, str):
            check_text(v, "the content")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts (all text: checked above)
            return "".join(p["text"] for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        """OpenAI's shape for turn.py: developer -> system, content parts joined, reasoning under one name."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                  if isinstance(c["function"].get("arguments", "{}"), str)
                                  else json.dumps(c["function"]["arguments"])}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content or self.reasoning:
            out["reasoning_content"] = self.reasoning_content or self.reasoning
        return out


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list = Field(default_factory=list)
    functions: list = Field(default_factory=list)
    tool_choice: Union[str, dict] = "auto"
    function_call: Union[str, dict] = "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict = Field(default_factory=dict)
    reasoning_effort: str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise Unsupported(f"tools[{i}]: only function tools are supported")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}].function needs a 'name'")
            if not isinstance(fn.get("parameters", {}), dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        return v

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v, info):
        if v and v != "none":
            raise Unsupported(f"{info.field_name} (the old function-calling fields) is not supported: use tools "
                              f"and tool_choice")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info):
        if v not in ("none", "auto") and not info.data.get("tools"):
            raise ValueError("tool_choice forces a call but no tools are given")
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, got {v!r}")
        if isinstance(v, dict) and not isinstance((v.get("function") or {}).get("name"), str):
            raise ValueError("tool_choice names a function as {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return v

    def template_kwargs(self) -> dict:
        out = dict(self.chat_template_kwargs)
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        return out

    @property
    def logprob_count(self) -> int | None:
        """The engine's logprobs setting: None off, else how many most likely tokens besides the chosen one."""
        return self.top_logprobs if self.logprobs else None


class CompletionRequest(_Body):
    prompt: Union[str, list[str], list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int = Field(default=1, ge=1)
    suffix: str = ""

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise Unsupported("one prompt per request (a list of several prompts is not supported)")
                v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
            check_text(v, "the prompt")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not 0 <= v <= 5:
            raise ValueError(f"logprobs must be in [0, 5] on completions, got {v}")
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _no_echo_or_suffix(cls, v, info):
        if v:
            raise Unsupported(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, v):
        if v != 1:
            raise Unsupported(f"best_of = {v} is not supported: one candidate per request")
        return v
