"""SEAL: steering away from reflection/transition thoughts (Chen et al., arXiv 2504.07986), full cache.

    skipkv steer build --model M --dataset math500 --offset 400 --limit 20 --layers 8,12 --out v.safetensors
    skipkv generate --model M --policy seal --steering v.safetensors "..."

Adds alpha0 · v to the residual stream entering the steering layer at every "\\n\\n" token (inside
<think>...</think> for models that think, see `steer_scope`), with v = mean(reflection ∪ transition) −
mean(execution) built by `skipkv steer build`. This is SkipKV's steering with γ = 0 and no eviction
(research/algorithms.md §4); the budget knobs are ignored. Departures from SEAL: the vector is built from the
evaluated model's own greedy generations on held-apart examples (see `skipkv steer build`), not from 500
correct + 500 incorrect MATH-train samples; the "\\n\\n" gate also fires on a newline that completes "\\n\\n"
across two tokens (byte-level tokenizers).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from skipkv.errors import SkipKVError
from skipkv.policies import POLICIES
from skipkv.policies.base import Policy
from skipkv.sentences.tracker import TablesByTokenizer
from skipkv.steering.gate import SteerState
from skipkv.steering.knobs import SteeringKnobs


@dataclass
class SealState:
    steer: SteerState


@POLICIES.register("seal")
@dataclass(frozen=True)
class SEAL(SteeringKnobs, Policy):
    paper = "SEAL (arXiv 2504.07986)"
    keeps = ('everything (full cache), steering the residual stream at `"\\n\\n"` tokens away from '
             "reflection/transition thoughts (`--steering FILE`, required)")

    compresses: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.steering:
            raise SkipKVError("seal needs a steering vector: --steering FILE (build one with skipkv steer build)")
        self._check_steering_file()

    @cached_property
    def _tables(self) -> TablesByTokenizer:
        """The steering gate's lookup tables per tokenizer, built once per instance and shared by its requests."""
        return TablesByTokenizer(gate=True)

    def init_state(self, prompt_ids: list[int], tokenizer) -> SealState:
        steer = self._steer_state(self._tables.get(tokenizer), prompt_ids)
        assert steer is not None  # seal always has a steering file (checked in __post_init__)
        return SealState(steer)

    def stats(self, state: SealState) -> dict:
        return {"steered_tokens": state.steer.steered}
