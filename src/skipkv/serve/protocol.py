"""The OpenAI wire format: request validation (into token ids + SamplingParams) and response/chunk shapes.

    parse_completion(body, tokenizer, limits)   # -> Parsed, or raises APIError (HTTP 400, OpenAI error body)

Fields are validated by the pydantic models of schema.py (each rejection names its `param` the way OpenAI's
API does); what depends on this server is checked here: the model name (404), the prompt against the model's
context, max_tokens against the server's cap. Accepted: model, prompt (completions: a string, a list of one
string, token ids, or a list of one list of token ids) or messages (chat: role + string content or text
parts), max_tokens (max_completion_tokens for chat), temperature, top_p, seed, stop (a string or up to 4),
n = 1, stream, stream_options.include_usage, user, and two extras: `kv_budget` (a lower KV budget for this
request) and `ignore_eos` (generate exactly max_tokens, for benchmarks). Known OpenAI parameters the engine
does not implement are refused unless they carry their neutral value (presence_penalty 0, logprobs null, ...),
so nothing is silently ignored; fields OpenAI does not define are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import reprlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from skipkv.config import SamplingParams, check_fields, knob
from skipkv.engine.detokenize import StopMatcher, TextStream  # noqa: F401 - re-exported: app.py and tests import them from here
from skipkv.engine.request import encode_prompt
from skipkv.errors import SkipKVError
from skipkv.serve.schema import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOPS, ROLES, ChatRequest, CompletionRequest, validate

__all__ = ["MAX_MESSAGES", "MAX_STOP_CHARS", "MAX_STOPS", "ROLES"]  # re-exported: tests and app.py read them here

COMPLETION_DEFAULT_TOKENS = 16  # max_tokens of a /v1/completions request that gives none (OpenAI's default)
ECHO_CHARS = 120  # what an error message quotes of a client's value at most
MAX_MESSAGE_CHARS = 1000  # an error message at most
NORMALIZER_SLACK = 3  # a Unicode normaliser (NFC) may fold up to 3 code points into 1 (Hangul L+V+T)
# OpenAI parameters without an implementation here: accepted only with the value that means "off".
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": 0, "echo": False,
           "best_of": 1, "logit_bias": {}, "suffix": "", "tools": [], "functions": [], "tool_choice": "none",
           "response_format": {"type": "text"}}


class APIError(Exception):
    """An error returned to the client as {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    # Messages quote clients' values through echo(); the cut is for messages built elsewhere (the engine's).
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


class _Echo(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()  # sets the defaults as instance attributes (Python 3.11 takes no keywords)
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, ECHO_CHARS, ECHO_CHARS, 40
        self.maxlist = self.maxdict = self.maxtuple = self.maxset = 6


def echo(v: Any) -> str:
    """A client's value quoted in an error message: bounded, so that a 1 MB field gives a short error."""
    return _Echo().repr(v)[: 2 * ECHO_CHARS]


@dataclass(frozen=True)
class ServerSettings:
    """Server knobs that are not the engine's."""

    model_name: str = ""  # the id clients pass as `model` ("" = the --model string)
    api_key: str = ""  # "" = no authentication
    max_tokens_cap: int = knob(4096, "max_tokens allowed per request at most", gt=0)
    max_queue: int = knob(256, "requests waiting for a slot at most; more get HTTP 429", gt=0)
    # 4 MiB holds a 128K-token prompt as text or as token ids; a larger body gets 413 before it is read.
    max_body_bytes: int = knob(4 << 20, "request body bytes at most; more get HTTP 413", gt=0)
    read_timeout: float = knob(30.0, "seconds a client may take to send a request's headers, and its body", gt=0)
    max_connections: int = knob(512, "open connections at most; more are closed at once", gt=0)
    shutdown_timeout: float = knob(10.0, "seconds in-flight requests may run on after SIGTERM; then they end with "
                                         "an error (streams: an error event and data: [DONE])", ge=0)
    request_timeout: float = knob(300.0, "seconds a request may take from its arrival to its last token; then it "
                                         "is aborted and ends with an error (0 = no limit)", ge=0)

    def __post_init__(self) -> None:
        check_fields(self, "server")


@dataclass(frozen=True)
class Limits:
    """What the server allows: its model name, the model's context, the cap on max_tokens, and the most
    characters a token of its tokenizer spells (`max_token_chars`), which bounds a text's token count from
    below before it is encoded."""

    model: str
    max_context: int
    max_tokens_cap: int
    max_token_chars: int


def max_token_chars(tokenizer) -> int:
    """The most characters one token can cover: its vocabulary entry's length (a byte-level entry has one
    character per byte, so this bounds UTF-8 bytes; a SentencePiece entry has one per character)."""
    return max(len(t) for t in tokenizer.get_vocab())


@dataclass(frozen=True)
class Parsed:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    sampling: SamplingParams
    kv_budget: int | None
    stream: bool
    include_usage: bool


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def load_body(raw: bytes) -> dict:
    """The body as a JSON object, or APIError 400 for anything else: invalid UTF-8 or JSON, NaN/Infinity,
    nesting past the interpreter's recursion limit, an integer past Python's digit limit, a lone surrogate."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit integer, NaN
        raise bad(f"the request body is not valid JSON: {str(exc)[:ECHO_CHARS]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    _check_strings(body)
    return body


def _check_strings(body: dict) -> None:
    """Refuse lone surrogates (JSON's "\\ud800" escapes): no tokenizer or UTF-8 encoder takes them."""
    todo: list = [body]
    while todo:  # iterative: json.loads already bounded the depth, this walk needs no stack of its own
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise bad("the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)",
                          code="invalid_json") from None


PREFIX_CHARS_PER_TOKEN = 8  # the prefix check encodes this many characters per context position


def encode_bounded(tokenizer, text: str, limits: Limits, param: str) -> list[int]:
    """Token ids of a text prompt (as `encode_prompt`), refusing a text that surely exceeds the model's context
    before paying for its whole encode (a 4 MB prompt costs seconds of tokenizer time).

    Two lower bounds on the text's token count, cheapest first: its characters over the longest token
    (allowing a normaliser's folding), then the tokens of a prefix cut at a pre-token boundary (the tokenizer
    splits the text there too, so the prefix's tokens are the text's first tokens; a special token's text cut in
    two can add up to `max_token_chars` tokens, which the bound subtracts).
    """
    ctx = limits.max_context
    least = len(text) // (limits.max_token_chars * NORMALIZER_SLACK)
    if least < ctx and len(text) > PREFIX_CHARS_PER_TOKEN * ctx:
        pre = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
        if pre is not None:
            pieces = pre.pre_tokenize_str(text[: PREFIX_CHARS_PER_TOKEN * ctx])
            cut = pieces[-1][1][0] if pieces else 0
            least = len(tokenizer(text[:cut], add_special_tokens=False)["input_ids"]) - limits.max_token_chars
    if least >= ctx:
        raise bad(f"the prompt has more than {least} tokens; the model's context is {ctx}", param,
                  "context_length_exceeded")
    return encode_prompt(tokenizer, text)


def _check(kind, body: dict, limits: Limits):
    """The body validated as `kind` (schema.py), after the checks OpenAI makes first: the model (404) and the
    parameters this server does not implement."""
    model = body.get("model")
    if isinstance(model, str) and model != limits.model:
        raise APIError(404, f"the model {echo(model)} does not exist; this server serves {limits.model!r}", "model",
                       "model_not_found")
    for key, off in NEUTRAL.items():
        v = body.get(key)
        if v is not None and not (v == off and isinstance(v, bool) == isinstance(off, bool)):
            raise bad(f"{key} is not supported by this server (got {echo(v)})", key, "unsupported_parameter")
    return validate(kind, body, echo, bad)


def _sampling(req, prompt_len: int, limits: Limits, chat: bool) -> SamplingParams:
    room = limits.max_context - prompt_len  # positions left for new tokens
    if room <= 0:
        raise bad(f"the prompt has {prompt_len} tokens; the model's context is {limits.max_context}",
                  "messages" if chat else "prompt", "context_length_exceeded")
    given = [(k, v) for k, v in (("max_completion_tokens", getattr(req, "max_completion_tokens", None)),
                                 ("max_tokens", req.max_tokens)) if v is not None]
    if given or not chat:
        # /v1/completions without max_tokens: OpenAI's default of 16 (so a prompt that fills the context is
        # refused here, not prefilled for one token); chat: as many as the cap and the context allow.
        key, m = given[0] if given else ("max_tokens", min(COMPLETION_DEFAULT_TOKENS, limits.max_tokens_cap))
        if m > limits.max_tokens_cap:
            raise bad(f"{key} is {m}; this server allows at most {limits.max_tokens_cap}", key)
        if m > room:
            what = f"{key} is {m}" if given else f"{key} defaults to {m}"
            raise bad(f"the prompt has {prompt_len} tokens and {what}; the model's context is "
                      f"{limits.max_context}", key if given else "prompt", "context_length_exceeded")
    else:
        m = min(limits.max_tokens_cap, room)  # as many as the cap and the context allow
    # OpenAI's semantics: without a seed, sampling is not reproducible.
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    try:
        return SamplingParams(max_new_tokens=m, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=seed,
                              ignore_eos=bool(req.ignore_eos), stop=req.stops())
    except SkipKVError as exc:
        raise bad(str(exc)) from None


def _tail(req, ids: list[int], limits: Limits, chat: bool) -> Parsed:
    opts = req.stream_options
    return Parsed(ids, _sampling(req, len(ids), limits, chat), req.kv_budget, bool(req.stream),
                  bool(opts and opts.include_usage))


def parse_completion(body: dict, tokenizer, limits: Limits) -> Parsed:
    """Validate a /v1/completions body; the prompt is tokenized as `skipkv generate --raw` would."""
    req = _check(CompletionRequest, body, limits)
    p = req.prompt
    if isinstance(p, str):
        ids = encode_bounded(tokenizer, p, limits, "prompt")
    else:
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in p):
            raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
        ids = list(p)
    return _tail(req, ids, limits, chat=False)


def parse_request(raw: bytes, tokenizer, limits: Limits, chat: bool) -> Parsed:
    """A raw /v1/chat/completions (chat) or /v1/completions body, validated and tokenized."""
    return (parse_chat if chat else parse_completion)(load_body(raw), tokenizer, limits)


def parse_chat(body: dict, tokenizer, limits: Limits) -> Parsed:
    """Validate a /v1/chat/completions body; the chat template is applied here, on the server."""
    req = _check(ChatRequest, body, limits)
    if not getattr(tokenizer, "chat_template", None):
        raise bad("this model has no chat template; use /v1/completions", "messages")
    conv = [{"role": m.role, "content": m.text()} for m in req.messages]
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return _tail(req, encode_bounded(tokenizer, text, limits, "messages"), limits, chat=True)


# ---------------------------------------------------------------------------------------- responses
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(result) -> dict:
    """OpenAI usage plus this engine's per-request KV figures."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens,
            "peak_kv_bytes": result.peak_kv_bytes, "compressions": result.compressions}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None = None, role: bool = False,
          usage_: dict | None = None, created: int | None = None) -> dict:
    """One streamed chunk (text None and no finish: a usage-only chunk with no choices)."""
    created = created or int(time.time())
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {"content": text} if text
                 else {} if finish else {"content": ""})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if text is None and finish is None and not role:
        out["choices"] = []
    if usage_ is not None:
        out["usage"] = usage_
    return out


def final(rid: str, model: str, chat: bool, result, created: int) -> dict:
    """The whole (non-streamed) response."""
    finish = OPENAI_FINISH[result.finish_reason]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage(result)}
