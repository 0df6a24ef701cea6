"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV scores under layer budgets that shrink linearly with depth.

    skipkv generate --model random:qwen2 --policy pyramidkv --budget 64 --prefill-window 8 "Hello"

`budget` is the mean per layer. As in the reference code (pyramidkv_utils.py), the protected window w is
taken off, the smallest layer gets (budget - w) / `beta` and the largest 2 (budget - w) - that, and layer l
gets w + a linear interpolation from the largest (layer 0) down to the smallest (last layer). Departure:
the step is spread over L - 1 layers (the reference divides by L, which leaves the mean above the budget),
so the layer budgets sum to budget x layers up to rounding. Scores and selection per kv head are SnapKV's
(this repo's defaults: max pooling, kernel 7, GQA max over the group); all heads of one layer keep the same
count, so every layer's bytes are real. w is prefill_window + sink, the tokens protected at prefill.
Decode (phase decode/both) compresses every layer back to its own budget when the largest layer reaches its
budget + interval; since all layers grow together, each then holds its budget + interval.

Ada-KV (arXiv 2407.11550, head-wise adaptive budgets within a layer) is adakv.py, on a head-split store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation
from skipkv.policies.snapkv import SnapKV
from skipkv.scoring import protect_and_select


@POLICIES.register("pyramidkv")
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    paper = "PyramidKV (arXiv 2406.02069)"
    keeps = "SnapKV's choice under per-layer budgets shrinking linearly with depth (mean = `budget`)"
    contract_knobs = {"prefill_window": 8, "budget": 16}  # layer budgets 24 and 8 over the tiny model's 2 layers

    beta: float = knob(20.0, "the last layer gets (budget - window) / beta, the first 2x(budget - window) minus that",
                       gt=1.0)

    def layer_budgets(self, num_layers: int) -> list[int]:
        """Per-layer budgets [L], largest first, summing to about budget x L."""
        w = self.prefill_window + self.sink if self.phase != "decode" else self.window + self.sink
        span = self.budget - w
        low = span / self.beta
        high = 2 * span - low
        if num_layers == 1:
            return [self.budget]
        return [w + round(high - l * (high - low) / (num_layers - 1)) for l in range(num_layers)]

    def layer_capacity(self, num_layers: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        out = []
        for b in self.layer_budgets(num_layers):
            if self.phase == "prefill":
                out.append(min(prompt_len, b) + max_new_tokens)
            elif self.phase == "decode":
                out.append(max(prompt_len + 1, self.layer_budgets(num_layers)[0] + self.interval))
            else:  # after prefill layer l holds min(P, b_l); all layers grow until layer 0 reaches b_0 + interval
                b0 = self.layer_budgets(num_layers)[0]
                out.append(min(prompt_len, b) + b0 + self.interval - min(prompt_len, b0))
        return out

    def prefill_keep(self, num_layers: int, prompt_len: int, prefix_len: int) -> list[int]:
        # Compression brings layer l to its own budget; below the smallest budget nothing is compressed.
        return self.layer_budgets(num_layers)

    def should_compress(self, length: int, is_prefill: bool, state: object | None = None) -> bool:
        # `length` is the largest layer's. At prefill every layer holds the same count: compress when the
        # smallest budget is exceeded. At decode, when layer 0 (the largest budget) reaches budget + interval.
        if is_prefill:
            return self.phase in ("prefill", "both") and length > self._budgets_hint[-1]
        return self.phase in ("decode", "both") and length >= self._budgets_hint[0] + self.interval

    @property
    def _budgets_hint(self) -> list[int]:
        # should_compress gets no layer count; the extremes of the pyramid do not depend on it.
        w = self.prefill_window + self.sink if self.phase != "decode" else self.window + self.sink
        span = self.budget - w
        return [w + round(2 * span - span / self.beta), w + round(span / self.beta)]

    def select(self, obs: Observation) -> torch.Tensor:
        L = obs.module.config.num_hidden_layers
        budget = self.layer_budgets(L)[obs.layer]
        b, H, n = obs.keys.shape[:3]
        if n <= budget:
            return torch.arange(n, device=obs.keys.device).expand(b, H, n)
        return protect_and_select(self.score(obs), budget, self.kept_window(obs), self.sink)
