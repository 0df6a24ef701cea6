"""The OpenAI request bodies as pydantic models, and their validation errors as OpenAI's 400s.

    req = validate(CompletionRequest, body)   # -> the model, or APIError 400 naming the field (`param`)

Strict types (no "3" for 3, no true for 1), OpenAI's ranges, fields OpenAI does not define ignored (extra keys
are allowed, as OpenAI-compatible servers do). What depends on the server (its model name, context, cap on
max_tokens, the tokenizer) is checked afterwards by protocol.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

MAX_STOPS = 4  # OpenAI's limit on stop sequences
# Stop strings are matched in linear time whatever their length (engine._stop_hit, TextStream); a bound on the
# length bounds the matchers' tables; a longer stop string is refused, not cut.
MAX_STOP_CHARS = 512
MAX_MESSAGES = 2048  # messages in a chat at most: bounds the chat template's work (a 4 MB body holds 140,000)
ROLES = ("system", "user", "assistant", "tool", "developer")
Number = Annotated[float, Field(strict=True)]  # an int or a float, never a bool or a string

# What each field must be, for the error message (pydantic's own text where a field is not listed).
MUST = {"model": "must be a string", "n": "must be 1 (only n = 1 is supported)",
        "user": "must be a string", "max_tokens": "must be a positive integer",
        "max_completion_tokens": "must be a positive integer", "temperature": "must be a number in [0, 2]",
        "top_p": "must be a number in (0, 1]", "seed": "must be a non-negative integer below 2**63",
        "stop": f"must be a non-empty string or a list of at most {MAX_STOPS} of them, of {MAX_STOP_CHARS} "
                f"characters at most",
        "kv_budget": "must be a positive integer", "stream": "must be true or false",
        "ignore_eos": "must be true or false",
        "stream_options": 'must be an object like {"include_usage": true}',
        "prompt": "must be a non-empty string or a list of token ids (one prompt per request)",
        "messages": f"must be a non-empty list of at most {MAX_MESSAGES} messages",
        "role": f"must be one of {', '.join(ROLES)}", "content": "must be a string or a list of text parts"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Request(_Strict):
    """Fields both endpoints take."""

    model: StrictStr
    n: Annotated[StrictInt, Field(ge=1, le=1)] | None = None
    user: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    kv_budget: Annotated[StrictInt, Field(gt=0)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > MAX_STOPS or not all(stops)
                                  or any(len(s) > MAX_STOP_CHARS for s in stops)):
            raise ValueError("out of range")
        return v

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    prompt: Any = Field(None, validate_default=True)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, p):
        """One prompt: a non-empty string or a non-empty list of token ids (either may come in a list of one)."""
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str) and p:
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise ValueError("not a prompt")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = None


def _param(loc: tuple) -> tuple[str, str]:
    """(OpenAI's `param` for an error location, the field it is about): messages[2].content, content."""
    param, field = "", ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in MUST or part in ("type", "text", "include_usage"):
            param, field = (f"{param}.{part}" if param else part), part
        # anything else is a union member's or a validator's tag (str, list[str], function-after[...])
    if field in ("type", "text"):  # inside a text part: the content is what is wrong
        param, field = param.rsplit("[", 1)[0].rsplit(".", 1)[0] + ".content" if "." in param else param, "content"
    if field == "include_usage":
        param, field = "stream_options", "stream_options"
    return param or "body", field


def validate(kind: type[_Request], body: dict, echo, bad) -> Any:
    """`kind` validated from `body`, or `bad(message, param)` for the first field that is wrong."""
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param, field = _param(err["loc"])
        if err["type"] == "missing" and field in ("model", "messages"):
            raise bad(f"{param} is required", param) from None
        value = body.get(err["loc"][0]) if err["loc"] and field == err["loc"][0] else err.get("input")
        must = MUST.get(field, err["msg"])
        if field == "messages" and param != "messages":  # one message is not an object
            must = f"must be an object with a role ({', '.join(ROLES)}) and a content"
        raise bad(f"{param} {must}, got {echo(value)}", param) from None
