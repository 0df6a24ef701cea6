"""One request's life: its prompt, sampling, outputs, stop state, timing and statistics.

    from skipkv.engine.request import encode_prompt
    encode_prompt(load_model("random:qwen2").tokenizer, "Hello")

Budget forcing (s1, Muennighoff et al. 2025, arXiv 2501.19393; `SamplingParams.force_wait` = K): the first K
times a request's newest sampled token would end its thinking, it is replaced by FORCE_TEXT and the request
goes on. "Ends its thinking" is an EOS (not ignored), or a token that opens THINK_END: its text contains
"</think>", or ends with a prefix of it at least 2 characters long ("</" — on tokenizers without a
</think> token the marker is several tokens, and only the newest sampled token can still be taken back:
every earlier one has been fed to the model and sits in its cache). FORCE_TEXT is preceded by "\n\n" unless
the text already ends in a newline, so it opens a new step. Its tokens are fed one per decode step (the token
sampled at those steps is discarded), so forcing needs nothing from the model runner and works for any
batch and any policy. A false start: a token ending in "</" that would have opened another tag is also
forced; math chains do not write tags.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from skipkv.config import SamplingParams
from skipkv.policies.base import Policy

THINK_END = "</think>"
FORCE_TEXT = "Wait"


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt. Text that already starts with the BOS text (a chat template's output) gets no
    second BOS."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and prompt.startswith(bos))
    return list(tokenizer(prompt, add_special_tokens=add)["input_ids"])


def eos_ids(bundle) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models often have two)."""
    ids: set[int] = set()
    generation_config = getattr(bundle.model, "generation_config", None)
    for src in (bundle.tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    return frozenset(int(i) for i in ids)


@dataclass(frozen=True)
class Plan:
    """One request's memory bounds, per layer (host int64 tensors; L layers, K prompt chunks of its own).

    capacity [L]: the most entries each layer holds at once once the prompt is in (Policy.layer_capacity);
    held [K + 1, L]: upper bound of the entries each layer holds before prompt chunk k (row K: after the prompt);
    after [L]: the most each layer needs once prefilled (what it kept plus its growth, within `capacity`);
    alone [L]: the most each layer needs at any time when the request is admitted alone."""

    capacity: torch.Tensor
    held: torch.Tensor
    after: torch.Tensor
    alone: torch.Tensor


@dataclass
class RequestResult:
    """What `generate` returns per prompt (and passes to `on_result` as soon as the request finishes)."""

    index: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    generated_tokens: int
    peak_kv_tokens: int  # most entries held per kv head (largest layer), at any moment
    peak_kv_bytes: int  # most K/V bytes held over all layers, at any moment
    decode_peak_kv_tokens: int  # the same two peaks over decode steps only: what the request holds once a
    decode_peak_kv_bytes: int  # long prompt has been staged and compressed (the steady state)
    compressions: int
    compress_seconds: float
    seconds: float  # from admission to finish
    finish_reason: str  # "eos" | "length" | "stop"
    # Memory beyond the K/V peaks above: the most bytes held counting each entry's int32 positions and float32
    # accumulators and the request's query buffer; the entries each layer holds at the end (they differ per
    # layer under model-wide or per-layer budgets); the store's allocated K/V bytes right after the prefill
    # that admitted this request was compressed and the store resized to each layer's need (shared with the
    # requests admitted together; equal to this request's own when it ran alone).
    peak_total_bytes: int = 0
    layer_kv_tokens: list[int] = field(default_factory=list)
    allocated_kv_bytes: int = 0
    # Entries each (layer, kv head) holds at the end, [L][H]: the heads of a layer differ only under head-split
    # policies (LaProx granularity head, Ada-KV), where layer_kv_tokens is each layer's mean over its heads.
    head_kv_tokens: list[list[int]] = field(default_factory=list)
    trace: dict | None = None  # generate(..., trace=True): retention per compression (engine/trace.py)
    request_id: str = ""
    queued_seconds: float = 0.0  # from add_request to admission (waiting for a slot / KV memory)
    ttft_seconds: float = 0.0  # time to first token: from add_request to the first token
    tpot_p50_seconds: float | None = None  # per-token latency (gap between consecutive tokens), median and p99;
    tpot_p99_seconds: float | None = None  # None for a request that produced a single token
    extra: dict = field(default_factory=dict)  # the policy's per-request figures (Policy.stats), e.g. flagged_sentences
    forced_waits: int = 0  # times budget forcing replaced an end of thinking by "Wait" (SamplingParams.force_wait)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated (numpy's default)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


@dataclass(eq=False)  # identity, not field-wise equality: the runner looks requests up in its running list
class Request:
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_ids: frozenset[int]
    # The policy this request runs under, set once when the request is made (engine.new_request, from the
    # engine's policy and the request's own budget, Policy.for_request); nothing else picks a request's policy.
    policy: Policy
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    peak_kv_tokens: int = 0
    peak_kv_bytes: int = 0
    decode_peak_kv_tokens: int = 0
    decode_peak_kv_bytes: int = 0
    compressions: int = 0
    compress_seconds: float = 0.0
    started: float = 0.0  # admission time
    generator: torch.Generator | None = None
    state: Any = None  # the policy's per-request state (its type is the policy's)
    peak_total_bytes: int = 0
    layer_kv_tokens: list[int] = field(default_factory=list)
    allocated_kv_bytes: int = 0
    head_kv_tokens: list[list[int]] = field(default_factory=list)
    trace: Any = None  # RequestTrace, created at the first compression when tracing
    request_id: str = ""
    plan: Plan | None = None  # its memory bounds per layer (engine/memory.py), set when it is queued
    arrived: float = field(default_factory=time.perf_counter)  # add_request time
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    token_gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens
    forced: int = 0  # times budget forcing replaced an end of thinking (at most sampling.force_wait)
    pending: list[int] = field(default_factory=list)  # forced tokens still to emit, in order
    # Tokens fed to the model so far (prompt + generated), set by the runner: one ahead of output_ids between a
    # decode step and the moment its sampled token is added (a chunk prefilled later in the same step).
    fed: int = 0
    stop_scan: Any = None  # engine._stop_hit's incremental decode and stop matchers (a TextStream), made lazily

    def to_feed(self) -> int:
        """Tokens this request may still feed (and cache): prompt + max_new_tokens - 1 in all, the last
        sampled token is never fed."""
        return self.prompt_len + self.sampling.max_new_tokens - 1 - self.fed

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def next_position(self) -> int:
        """True position of the newest generated token (the one the next decode step feeds)."""
        return self.prompt_len + len(self.output_ids) - 1

    def note_memory(self, tokens: int, nbytes: int, decoding: bool, total_bytes: int = 0) -> None:
        self.peak_total_bytes = max(self.peak_total_bytes, total_bytes)
        self.peak_kv_tokens = max(self.peak_kv_tokens, tokens)
        self.peak_kv_bytes = max(self.peak_kv_bytes, nbytes)
        if decoding:
            self.decode_peak_kv_tokens = max(self.decode_peak_kv_tokens, tokens)
            self.decode_peak_kv_bytes = max(self.decode_peak_kv_bytes, nbytes)

    def add_token(self, token: int, now: float) -> int:
        """Append a sampled token (or, while budget forcing is pending, the next forced token instead) and
        record when it arrived. Returns the token appended."""
        if self.pending:
            token = self.pending.pop(0)
        if self.output_ids:
            self.token_gaps.append(now - self.last_token_at)
        else:
            self.first_token_at = now
        self.last_token_at = now
        self.output_ids.append(token)
        return token


def _opens_think_end(text: str) -> int:
    """Where in `text` the thinking's end marker starts (whole, or a prefix of >= 2 chars at the end), else -1."""
    at = text.find(THINK_END)
    if at >= 0:
        return at
    for k in range(len(THINK_END) - 1, 1, -1):
        if text.endswith(THINK_END[:k]):
            return len(text) - k
    return -1


def budget_force(tokenizer, r: Request) -> bool:
    """s1 budget forcing (module docstring): if the newest token ends the thinking and forcing is left, replace
    it by FORCE_TEXT's tokens (the first now, the rest queued in `r.pending`). Returns whether it forced."""
    if r.forced >= r.sampling.force_wait or r.pending:
        return False
    tok = r.output_ids[-1]
    if tok in r.eos_ids and not r.sampling.ignore_eos:
        keep = ""
    else:
        text = tokenizer.decode([tok], skip_special_tokens=False)
        at = _opens_think_end(text)
        if at < 0:
            return False
        keep = text[:at]  # what the token wrote before the marker (e.g. ".\n" of a merged ".\n</")
    before = tokenizer.decode(r.output_ids[-9:-1], skip_special_tokens=True) + keep
    forced = keep + ("" if before.endswith("\n") else "\n\n") + FORCE_TEXT
    ids = tokenizer.encode(forced, add_special_tokens=False)
    r.output_ids[-1] = ids[0]
    r.pending = ids[1:]
    r.forced += 1
    return True
