"""The schema of each file kind skipkv reads (pydantic), applied by `skipkv.files` to every value it parses.

    python -c "from skipkv.files.schemas import validate; print(validate('records', {'id': 'a', 'sample': 0}, 'x'))"

A schema says what the code that reads the file relies on (types of the fields it indexes, ranges of the
counts it uses); other fields pass through untouched, so a file written by an older skipkv still reads.
`validate` returns the value itself (not a model), or raises one line naming the file, the field and why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from skipkv.files.limits import FileError

Count = Annotated[StrictInt, Field(ge=0)]
Number = StrictInt | StrictFloat


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptRow(_Open):
    """--prompts: a string, or an object whose `prompt` (or `text`) is the prompt."""

    prompt: StrictStr | None = None
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _one(self) -> PromptRow:
        if not (self.prompt or self.text):
            raise ValueError("expected a string or an object with a 'prompt' field")
        return self


class MathRow(_Open):
    """A math --data row (gsm8k, math500, aime24)."""

    id: StrictStr | StrictInt
    problem: StrictStr
    answer: StrictStr | StrictInt | StrictFloat


class CodeRow(_Open):
    """A code --data row (humaneval)."""

    id: StrictStr | StrictInt
    prompt: StrictStr
    entry_point: Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    test: StrictStr


class Record(_Open):
    """One records.jsonl line: the key (id, sample) and the figures report and show read."""

    id: StrictStr
    sample: Count = 0  # eval always writes it; a hand-made file may leave it out
    generated_tokens: Count | None = None
    prompt_tokens: Count | None = None
    compressions: Count | None = None
    correct: StrictBool | None = None
    score: Number | None = None
    output: StrictStr | None = None


class Step(_Open):
    generated: Count
    seen: Count


class Evicted(BaseModel):
    dtype: Literal["uint8", "uint16"]
    shape: Annotated[list[Annotated[StrictInt, Field(ge=0, le=1 << 24)]], Field(min_length=3, max_length=3)]
    codec: Literal["zlib+base64"]
    data: StrictStr


class Trace(_Open):
    num_layers: Annotated[StrictInt, Field(ge=1, le=4096)]
    num_kv_heads: Annotated[StrictInt, Field(ge=1, le=4096)]
    prompt_len: Count
    prompt_tokens: list[StrictStr]
    output_tokens: list[StrictStr]
    compressions: list[Step]
    evicted: Evicted

    @model_validator(mode="after")
    def _shape(self) -> Trace:
        L, H, T = self.evicted.shape
        if (L, H) != (self.num_layers, self.num_kv_heads) or T != len(self.prompt_tokens) + len(self.output_tokens):
            raise ValueError(f"evicted shape {self.evicted.shape} does not match the layers, heads and tokens")
        if self.prompt_len != len(self.prompt_tokens):
            raise ValueError(f"prompt_len {self.prompt_len} but {len(self.prompt_tokens)} prompt tokens")
        if L * H * T > 1 << 30:
            raise ValueError(f"evicted shape {self.evicted.shape} is too large to view")
        return self


class TraceLine(_Open):
    id: StrictStr
    sample: Count
    trace: Trace


class Session(_Open):
    environment: dict[str, Any] = {}


class _Named(_Open):
    name: StrictStr


class Config(_Open):
    """A run's config.json (what report, show, --reference and a resume read)."""

    model: StrictStr | None = None
    dataset: StrictStr | _Named | None = None
    policy: StrictStr | _Named | None = None
    dtype: StrictStr | None = None
    device: StrictStr | None = None
    environment: dict[StrictStr, Any] | None = None
    sampling: dict[StrictStr, Any] | None = None


class Summary(_Open):
    n: Count | None = None
    complete: StrictBool | None = None
    mean_generated_tokens: Number | None = None


class SteeringMeta(_Open):
    """A steering file's metadata (steering/vector.py), each value parsed from its JSON string."""

    format: StrictStr
    model: StrictStr
    dataset: StrictStr
    ids: list[StrictStr | StrictInt]
    layers: Annotated[list[Annotated[StrictInt, Field(ge=0, le=4096)]], Field(min_length=1)]
    hidden_size: Annotated[StrictInt, Field(gt=0)]
    best_layer: Annotated[StrictInt, Field(ge=0, le=4096)]


class SafetensorsIndex(_Open):
    weight_map: dict[StrictStr, StrictStr]


_SCHEMAS: dict[str, type[BaseModel] | None] = {
    "prompts": PromptRow, "data": None, "data_math": MathRow, "data_code": CodeRow, "records": Record,
    "traces": TraceLine, "sessions": Session, "config": Config, "summary": Summary, "sweep": None,
    "safetensors_index": SafetensorsIndex, "steering_meta": SteeringMeta, "haystack": None,
}


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "str", "int", "float")))
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def validate(kind: str, value: Any, where: str) -> Any:
    """`value` if it fits `kind`'s schema; else a FileError `where: field: why`."""
    model = _SCHEMAS[kind]
    if kind == "prompts" and isinstance(value, str):
        return value
    if kind in ("sweep", "data") or model is not None:
        if not isinstance(value, dict):
            shape = "a mapping" if kind == "sweep" else "a JSON object" + (" or a string" if kind == "prompts" else "")
            raise FileError(f"{where}: expected {shape}, got {type(value).__name__}")
    if model is not None:
        try:
            model.model_validate(value)
        except ValidationError as exc:
            raise FileError(f"{where}: {_first_error(exc)}") from None
    return value
