"""R-KV: redundancy-aware KV compression for reasoning models (Cai et al., arXiv 2505.24133).

    skipkv generate --model random:qwen2 --policy rkv --budget 64 --interval 16 "Hello"

Score of each older token = λ·importance − (1−λ)·redundancy, λ = `mix_lambda` (0.1, the paper's value).
Importance: the newest `window` (8) queries' softmax over the older keys (GQA logits max-reduced over the
group), averaged, max-pooled with `kernel` 7. Redundancy: key cosine similarity with a zero diagonal; each
token's most recent near-duplicate (similarity > `threshold` 0.5) is spared; softmax of the column means.
The newest `window` tokens are always kept; the cache is compressed back to `budget` whenever it reaches
`budget + interval`. Departures from the reference code (rkv/compression/r1_kv.py): redundancy is computed
per request (the reference uses batch row 0 for every row), the trigger is per request (the reference uses
row 0's token and a step counter shared by the batch), and kept indices are sorted (entries stay in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.scoring import key_redundancy, window_importance


@POLICIES.register("rkv")
@dataclass(frozen=True)
class RKV(Policy):
    paper = "R-KV (arXiv 2505.24133)"
    keeps = "newest `window` + λ·importance − (1−λ)·redundancy, redundancy per request"

    mix_lambda: float = knob(0.1, "λ: weight of importance against redundancy", ge=0.0, le=1.0)
    threshold: float = knob(0.5, "key cosine above which a token's newest near-duplicate is spared", ge=-1.0, le=1.0)
    kernel: int = knob(7, "max-pool width over importance (odd)", gt=0, odd=True)

    needs: ClassVar[frozenset[str]] = frozenset({"queries"})

    def score(self, obs: Observation) -> torch.Tensor:
        n = obs.keys.shape[2]
        cand = n - self.window
        assert obs.queries is not None
        imp = window_importance(obs.queries, obs.keys[:, :, :cand], self.kernel, "max", "max")
        red = key_redundancy(obs.keys, self.threshold)[:, :, :cand]
        s = self.mix_lambda * imp - (1 - self.mix_lambda) * red
        return torch.cat([s, s.new_zeros(*s.shape[:2], n - cand)], dim=-1)
