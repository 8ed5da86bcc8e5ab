"""Request / response bodies of the OpenAI-compatible API (pydantic models) and the error body.

Only what changes generation is modelled; unknown fields are ignored (as most OpenAI-compatible
servers do). Fields we cannot honour (n > 1, logprobs, penalties) are rejected with a clear
message instead of being silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, strict=True)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, strict=True)  # extension (vLLM-style); 0 or -1 = off
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, strict=True)
    logprobs: bool | int | None = None
    presence_penalty: float = Field(default=0.0, strict=True, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, strict=True, allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_LENGTH} characters")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value):
        if value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value):
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value):
        if value != 0:
            raise ValueError("presence/frequency penalties are not supported (they would change the target distribution)")
        return value

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message text; content parts other than text are rejected (this is a text-only model)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        unsupported = sorted({part.type for part in self.content if part.type != "text"})
        if unsupported:
            raise ValueError(f"only text content parts are supported, got {unsupported}")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, strict=True)

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, strict=True)
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value):
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value):
        if value not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value):
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value

    def single_prompt(self) -> str | list[int]:
        """One prompt: a string or token ids (a batch of prompts needs n separate requests here)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty")
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is empty")
        return prompt


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def describe_validation_error(error: ValidationError) -> tuple[str, str | None]:
    """A one-line message naming each bad field, and the first bad field (OpenAI's `param`)."""
    parts, first_param = [], None
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        first_param = first_param or (str(item["loc"][0]) if item["loc"] else None)
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return "invalid request: " + "; ".join(parts), first_param
