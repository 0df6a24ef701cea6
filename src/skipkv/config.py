"""Frozen configuration dataclasses: every default lives here once; CLI flags are built from these fields."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from skipkv.errors import SkipKVError

# Upper bounds of the counts a user gives (flags, sweep options, request fields), each with its reason: no count
# may size an allocation or a loop past what any run needs, so none can exhaust memory before it is refused.
MAX_SEED = 2**64 - 1
SEED_WHY = "a seed is an unsigned 64-bit integer (torch.Generator)"
MAX_TOKENS = 1 << 22
TOKENS_WHY = "no model's context holds more tokens"
MAX_SAMPLES = 1024
SAMPLES_WHY = "every sample is a generation planned in memory; pass@k uses at most a few hundred"
MAX_BATCH = 4096
BATCH_WHY = "the slot store holds a row per running request"
MAX_BYTES = 1 << 50
BYTES_WHY = "a pebibyte, more memory than any machine has"
MAX_COUNT = 1 << 31
COUNT_WHY = "a 32-bit count"


def short(value: Any, width: int = 60) -> str:
    """repr(value) cut to `width` characters; safe for an int too long for repr (Python refuses > 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an integer of about {value.bit_length() * 3 // 10} digits>"
    return text if len(text) <= width else text[:width - 3] + "..."


def bounded(value: Any, name: str, lo: int, hi: int, why: str) -> int:
    """`value` if it is an integer in [lo, hi]; else a one-line SkipKVError giving the range and its reason."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SkipKVError(f"{name} must be an integer, got {short(value)}")
    if not lo <= value <= hi:
        raise SkipKVError(f"{name} must be between {lo} and {hi} ({why}), got {short(value)}")
    return value


def knob(default, help: str = "", *, ge=None, gt=None, le=None, lt=None, choices=None, odd: bool = False,
         kind: type | None = None, why: str = ""):
    """A config field whose constraints live beside its default; `check_fields` enforces them when the
    config is built, so a bad value fails before any model loads or any file is written.

    kind: for an optional field (default None), the type a value other than None must have (int, float, str).
    why: the reason for an upper bound (le, lt), said in its error.
    """
    meta: dict[str, Any] = {"help": help, "why": why}
    if kind is not None:
        meta["kind"] = kind
    for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt), ("choices", choices)):
        if v is not None:
            meta[k] = tuple(v) if k == "choices" else v
    if odd:
        meta["odd"] = True
    return field(default=default, metadata=meta)


def check_fields(obj, what: str) -> None:
    """Validate every field of dataclass `obj` against its default's type and its `knob` constraints.

    Types follow the default: bool stays bool, int takes no float or bool, float takes int or float and must
    be finite; str fields with `choices` must be one of them. Raises SkipKVError naming `what` and the field.
    """
    for f in fields(obj):
        if f.default is MISSING:
            continue
        v, d, m, name = getattr(obj, f.name), f.default, f.metadata, f.name
        if d is None and "kind" in m:
            if v is None:
                continue  # optional and unset
            d = m["kind"]()  # check a given value as if the default were of its kind
        if isinstance(d, bool):
            if not isinstance(v, bool):
                raise SkipKVError(f"{what} {name} must be true or false, got {short(v)}")
            continue
        if isinstance(d, int):
            if isinstance(v, bool) or not isinstance(v, int):
                raise SkipKVError(f"{what} {name} must be an integer, got {short(v)}")
        elif isinstance(d, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SkipKVError(f"{what} {name} must be a number, got {short(v)}")
            if isinstance(v, int) and v.bit_length() > 1024:  # float(v) would overflow
                raise SkipKVError(f"{what} {name} must be finite, got {short(v)}")
            if not math.isfinite(v):
                raise SkipKVError(f"{what} {name} must be finite, got {v!r}")
        elif isinstance(d, str):
            if not isinstance(v, str):
                raise SkipKVError(f"{what} {name} must be a string, got {short(v)}")
        if "choices" in m and v not in m["choices"]:
            raise SkipKVError(f"{what} {name} must be one of {', '.join(map(str, m['choices']))}; got {short(v)}")
        for key, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                              ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
            if key in m and not ok(v, m[key]):
                why = f" ({m['why']})" if m.get("why") and key in ("le", "lt") else ""
                raise SkipKVError(f"{what} {name} must be {word} {m[key]}{why}, got {short(v)}")
        if m.get("odd") and v % 2 == 0:
            raise SkipKVError(f"{what} {name} must be odd, got {v!r}")


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648; also KiB, MiB, TiB, kB/MB/GB (powers of ten) and plain bytes; '0' = no cap."""
    import re

    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise SkipKVError(f"expected a size like 2GiB, 512MiB or 1048576 (bytes), got {short(text)}")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size > MAX_BYTES:
        raise SkipKVError(f"a size must be at most {MAX_BYTES} bytes ({BYTES_WHY}), got {short(text)}")
    return size


# vLLM's SamplingParams names that skipkv does not implement: refused in one line, never ignored.
UNSUPPORTED_SAMPLING = ("best_of", "presence_penalty", "frequency_penalty", "min_p", "logprobs", "prompt_logprobs",
                        "min_tokens", "stop_token_ids", "bad_words", "logits_processors", "truncate_prompt_tokens",
                        "guided_decoding", "include_stop_str_in_output", "skip_special_tokens",
                        "spaces_between_special_tokens", "detokenize", "output_kind", "allowed_token_ids",
                        "logit_bias", "structured_outputs")


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How one request is decoded, with vLLM's names. temperature == 0 means greedy.

    `max_tokens` (vLLM's name) and `max_new_tokens` are the same field; `n` completions per prompt (sampled
    ones draw from seeds `seed`, `seed + 1`, ...; greedy ones are identical); `repetition_penalty` as in
    transformers and vLLM (a logit of a token already in the prompt or the output is divided by it when
    positive, multiplied when negative). A vLLM parameter not implemented here is a SkipKVError."""

    max_new_tokens: int = knob(256, "tokens to generate at most", gt=0, le=MAX_TOKENS, why=TOKENS_WHY)
    temperature: float = knob(0.0, "0 = greedy", ge=0.0)
    top_p: float = knob(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    top_k: int = knob(0, "0 = off", ge=0, le=MAX_COUNT, why=COUNT_WHY)
    seed: int = knob(0, "sampling seed", ge=0, le=MAX_SEED, why=SEED_WHY)
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    # s1-style budget forcing (engine/request.py `budget_force`): up to this many times, an end of thinking
    # (EOS, or the start of "</think>") is replaced by "Wait" and the request goes on.
    force_wait: int = knob(0, "budget forcing: times an end of thinking is replaced by 'Wait'", ge=0,
                           le=MAX_COUNT, why=COUNT_WHY)
    n: int = knob(1, "completions per prompt", gt=0, le=MAX_COUNT, why=COUNT_WHY)
    repetition_penalty: float = knob(1.0, "divide the logits of tokens already seen (1 = off)", gt=0.0)

    def __init__(self, **kwargs) -> None:
        # Keywords only, each a field (or `max_tokens`); the defaults are the fields' own.
        if "max_tokens" in kwargs:
            given = kwargs.pop("max_tokens")
            if "max_new_tokens" in kwargs and kwargs["max_new_tokens"] != given:
                raise SkipKVError(f"sampling max_tokens ({given!r}) and max_new_tokens "
                                  f"({kwargs['max_new_tokens']!r}) are the same parameter; give one")
            kwargs["max_new_tokens"] = given
        names = [f.name for f in fields(self)]
        for key in kwargs:
            if key in UNSUPPORTED_SAMPLING:
                raise SkipKVError(f"sampling {key} is not implemented in skipkv (supported: max_tokens, "
                                  f"{', '.join(n for n in names if n != 'max_new_tokens')})")
            if key not in names:
                raise SkipKVError(f"sampling has no parameter {key!r} (supported: max_tokens, {', '.join(names)})")
        for f in fields(self):
            object.__setattr__(self, f.name, kwargs.get(f.name, f.default))
        if isinstance(self.stop, str):  # vLLM takes one stop string or a list of them
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.__post_init__()

    def __post_init__(self) -> None:
        from skipkv.files.text import check_text

        check_fields(self, "sampling")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise SkipKVError(f"stop strings must be non-empty strings, got {short(self.stop)}")
        for i, s in enumerate(self.stop):
            check_text(s, f"stop string {i}")

    @property
    def max_tokens(self) -> int:
        """vLLM's name for `max_new_tokens`."""
        return self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs that are not per request."""

    batch_size: int = knob(8, "requests running together at most (a cap; with kv_memory, memory decides)", gt=0,
                           le=MAX_BATCH, why=BATCH_WHY)
    # 0 = whole prompt in one forward; N = prefill N tokens of each new request per engine step (bounded peak
    # memory, and running requests decode one token between two chunks)
    prefill_chunk: int = knob(0, "prefill prompts this many tokens per step (0 = whole)", ge=0, le=MAX_TOKENS,
                              why=TOKENS_WHY)
    group_by_length: bool = True  # SkipKV's batch grouping: batch prompts of similar length together
    # Admission under a KV memory cap: a group enters only when the slot store, sized for the running requests
    # and for what the group may hold (see skipkv/engine/memory.py), stays within this many bytes. 0 = no cap.
    kv_memory: int = knob(0, "KV cache bytes at most (0 = no cap)", ge=0, le=MAX_BYTES, why=BYTES_WHY)
    # Padded prompt tokens prefilled per engine step at most, summed over the requests admitted together
    # (one request is always admitted): a bound on how long one step stalls the running requests. 0 = no limit.
    prefill_budget: int = knob(0, "prompt tokens prefilled per step at most (0 = no limit)", ge=0, le=MAX_COUNT,
                               why=COUNT_WHY)
    # A prompt prefix that every request admitted together starts with (a system prompt, few-shot exemplars)
    # is prefilled once, in one row, and copied into the others, when it is at least this many tokens. The
    # other rows then hold the same entries they would compute themselves; their tokens can still differ from
    # a run without sharing in the last bits (the rest of each prompt is a separate, shorter forward, as in
    # chunked prefill), so it is off by default and part of a run's identity when on. 0 = off.
    share_prefix: int = knob(0, "prefill a prompt prefix the admitted group shares once, if >= N tokens (0 = off)",
                             ge=0, le=MAX_COUNT, why=COUNT_WHY)
    # A prefill forward over right-padded rows runs each decoder MLP on the real positions only (models/unpad.py):
    # the same tokens in fp64, a third less MLP work for 16 prompts of 78-163 tokens. In 16-bit dtypes a row can
    # round differently (as with another batch), so a 16-bit eval run records it.
    unpad_prefill: bool = True
    # Never compile the decode step (kernels.decode_step compiles it where measured faster: fp32 on packed linears,
    # ~22 s of compiling per process), as vLLM's `enforce_eager`: for short runs, or to rule the compiler out.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "engine")
