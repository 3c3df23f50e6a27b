"""The OpenAI HTTP API's request bodies (validated) and response shapes, as specgraph serves them.

Only what the server implements is declared; an unknown field is ignored, as OpenAI's own server
does, except ``echo``/``suffix``/``best_of``/``tools``, which are refused rather than silently
dropped. Extensions: ``top_k`` and ``speculation`` (``{"enabled": bool, "num_draft_tokens": int}``).
"""
from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Speculation(BaseModel):
    """Per-request speculative decoding (extension): off, or at most ``num_draft_tokens`` drafts."""

    enabled: bool = True
    num_draft_tokens: int | None = Field(default=None, ge=1, le=64)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: Union[str, list[str], None] = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1, None] = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: None = None

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
