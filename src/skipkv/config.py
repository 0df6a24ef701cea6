"""Frozen configuration dataclasses: every default lives here once; CLI flags are built from these fields."""

from __future__ import annotations

from dataclasses import dataclass

from skipkv.errors import SkipKVError


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. temperature == 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise SkipKVError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise SkipKVError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SkipKVError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SkipKVError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs that are not per request."""

    batch_size: int = 8
    prefill_chunk: int = 0  # 0 = whole prompt in one forward; N = prefill N tokens at a time (bounded peak memory)
    group_by_length: bool = True  # SkipKV's batch grouping: batch prompts of similar length together

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise SkipKVError(f"batch_size must be positive, got {self.batch_size}")
        if self.prefill_chunk < 0:
            raise SkipKVError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
