"""H2O: heavy-hitter oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048).

    skipkv generate --model random:qwen2 --policy h2o --budget 64 "Hello"

Faithful by default: a token's score is the attention it has received, summed over every query since it
entered the cache (prompt queries included) and over the query heads of its kv group; as in the paper, half
the budget is the recent set (`recent_ratio` 0.5; the recent set is max(window, recent_ratio x (budget - sink)):
the share is of the budget beyond the always-kept sink, so a protected prompt, which runs as the sink, leaves
the generated budget's split unchanged) and the other half the heavy hitters. `variant="last_query"` reproduces
the R-KV/SkipKV repos' "H2O", which scores by the softmax of the newest query only and keeps only the newest
token as recent: use `--variant last_query --recent-ratio 0 --window 1`. Departures: eviction runs every
`interval` steps (not every token) so that batched gathers stay cheap; GQA scores are summed over the group's
query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.scoring import window_logits


@POLICIES.register("h2o")
@dataclass(frozen=True)
class H2O(Policy):
    paper = "H2O (arXiv 2306.14048)"
    keeps = ("newest half of the budget (`recent_ratio` 0.5, as in the paper; at least `window`) + tokens with "
             "the most attention accumulated over all steps (`variant=last_query --recent-ratio 0 --window 1` "
             "reproduces the R-KV repo's variant)")

    variant: str = knob("accumulated", "accumulated attention (paper) or the repos' last-query variant",
                        choices=("accumulated", "last_query"))
    recent_ratio: float = knob(0.5, "fraction of the budget kept as the newest tokens (paper: 0.5; 0 = window)",
                               ge=0.0, lt=1.0)

    needs: ClassVar[frozenset[str]] = frozenset({"attn", "queries"})

    @property
    def recent(self) -> int:
        """Newest tokens kept whatever they score."""
        return max(self.window, int(self.recent_ratio * (self.budget - self.sink)))

    def kept_window(self, obs: Observation) -> int:
        return self.recent

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
