"""The request bodies of /v1/chat/completions and /v1/completions (pydantic), and what they ask of the
engine. Unknown fields are ignored, as OpenAI's clients send some we do not use; out-of-range values are
refused (400). Sampling extras beyond OpenAI's API: `top_k`, `min_p`, `repetition_penalty`, `num_draft`.
The default temperature is 0 (greedy), as in mlx-lm's server: a local server's default should be the
reproducible answer."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling import SamplingConfig


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    # per request: k >= 0 or auto (default: the server's); in continuous batching, a ceiling on the row's own k
    num_draft: Union[int, Literal["auto"], None] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @field_validator("num_draft")
    @classmethod
    def _num_draft(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError("num_draft must be >= 0 or 'auto'")
        return v

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty)

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Body):
    prompt: Union[str, list[str], list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("one prompt per request (a list of several prompts is not supported)")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        return v
