"""One request's life: its prompt, sampling, outputs, stop state and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from skipkv.config import SamplingParams


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
    extra: dict = field(default_factory=dict)  # the policy's per-request figures (Policy.stats), e.g. flagged_sentences


@dataclass(eq=False)  # identity, not field-wise equality: the runner looks requests up in its running list
class Request:
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    peak_kv_tokens: int = 0
    peak_kv_bytes: int = 0
    decode_peak_kv_tokens: int = 0
    decode_peak_kv_bytes: int = 0
    compressions: int = 0
    compress_seconds: float = 0.0
    started: float = 0.0
    generator: torch.Generator | None = None
    state: object | None = None  # the policy's per-request state

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def next_position(self) -> int:
        """True position of the newest generated token (the one the next decode step feeds)."""
        return self.prompt_len + len(self.output_ids) - 1

    def note_memory(self, tokens: int, nbytes: int, decoding: bool) -> None:
        self.peak_kv_tokens = max(self.peak_kv_tokens, tokens)
        self.peak_kv_bytes = max(self.peak_kv_bytes, nbytes)
        if decoding:
            self.decode_peak_kv_tokens = max(self.decode_peak_kv_tokens, tokens)
            self.decode_peak_kv_bytes = max(self.decode_peak_kv_bytes, nbytes)
