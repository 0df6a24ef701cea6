"""H2O: heavy-hitter oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048).

    skipkv generate --model random:qwen2 --policy h2o --budget 64 "Hello"

Faithful by default: a token's score is the attention it has received, summed over every query since it
entered the cache (prompt queries included) and over the query heads of its kv group; the newest `window`
tokens are kept as the recent set. `variant="last_query"` reproduces the R-KV/SkipKV repos' "H2O", which
scores by the softmax of the newest query only (window forced to 1 there; here `window` stays a knob).
Departures: eviction runs every `interval` steps (not every token) so that batched gathers stay cheap;
GQA scores are summed over the group's query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.policies import POLICIES
from skipkv.config import knob
from skipkv.policies.base import Observation, Policy
from skipkv.scoring import window_logits


@POLICIES.register("h2o")
@dataclass(frozen=True)
class H2O(Policy):
    variant: str = knob("accumulated", "accumulated attention (paper) or the repos' last-query variant",
                        choices=("accumulated", "last_query"))

    needs: ClassVar[frozenset[str]] = frozenset({"attn", "queries"})

    @property
    def query_window(self) -> int:
        return 1

    def requirements(self) -> frozenset[str]:
        return frozenset({"attn"}) if self.variant == "accumulated" else frozenset({"queries"})

    def score(self, obs: Observation) -> torch.Tensor:
        if self.variant == "accumulated":
            assert obs.attn is not None
            return obs.attn
        assert obs.queries is not None
        return torch.softmax(window_logits(obs.queries, obs.keys, "max"), dim=-1).mean(dim=2)
