"""SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469): keep what the observation window attends to.

    skipkv generate --model random:qwen2 --policy snapkv --budget 64 "Hello"

At prefill the observation window is the last `prefill_window` (32) prompt tokens: they are kept, and their
queries score the older tokens. At decode time it repeats every `interval` steps with the newest `window` (8)
tokens, which is how the R-KV repo adapts SnapKV to reasoning. Scores: softmax of the window queries over the
older tokens, averaged over queries, then 1-D pooled (`kernel` 7). Two variants:
- `rkv` (default, as the R-KV repo scores SnapKV): the softmax covers the candidates only (the window keys are
  left out of its denominator), max pooling, and average pooling (`pooling=avg`) divides by the in-range width.
- `paper` (SnapKV's own code, snapkv_utils.py): the window queries' softmax covers every key, the window keys
  causally masked, then the candidates are avg-pooled with zero padding counted (`count_include_pad`).
`pooling=auto` means max for `rkv` and avg for `paper`. GQA (`group_reduce`): `max` (default, as R-KV) or `mean`
reduce each query group's logits before one softmax; `probs` averages the group's per-query-head softmax, as
kvpress's SnapKVPress and Ada-KV's GQA code do (benchmarks/kvpress_overlap: kept sets equal kvpress's with it).
Kept indices are sorted. With `phase` prefill or both, `budget` must exceed `prefill_window + sink`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.scoring import GROUP_REDUCES, causal_window_importance, pool1d, window_importance


@POLICIES.register("snapkv")
@dataclass(frozen=True)
class SnapKV(Policy):
    paper = "SnapKV (arXiv 2404.14469)"
    keeps = ("newest `window` + what the observation window attends to (32 queries at prefill, 8 at decode); "
             "default `variant=rkv` (softmax over the candidates, max pooling, as the R-KV repo); "
             "`variant=paper` follows SnapKV's code (softmax over all keys, avg pooling counting padding)")
    contract_knobs = {"prefill_window": 8}

    prefill_window: int = knob(32, "prompt queries that score the prompt at prefill (kept whole)", gt=0)
    kernel: int = knob(7, "pooling width over importance (odd)", gt=0, odd=True)
    pooling: str = knob("auto", "1-D pooling over importance (auto: max for variant rkv, avg for paper)",
                        choices=("auto", "max", "avg"))
    variant: str = knob("rkv", "rkv: softmax over the candidates (R-KV repo); paper: over all keys, window "
                        "causal, avg pooling counting padding (SnapKV code)", choices=("rkv", "paper"))
    group_reduce: str = knob("max", "GQA: max or mean of each query group's logits, or probs (mean of its "
                             "per-head softmax, kvpress)", choices=GROUP_REDUCES)

    needs: ClassVar[frozenset[str]] = frozenset({"queries"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.phase != "decode" and self.budget <= self.prefill_window + self.sink:
            raise SkipKVError(f"snapkv budget ({self.budget}) must exceed prefill_window + sink "
                              f"({self.prefill_window} + {self.sink}); lower --prefill-window or use --phase decode")

    @property
    def query_window(self) -> int:
        return max(self.window, self.prefill_window)

    def kept_window(self, obs: Observation) -> int:
        return self.prefill_window if obs.is_prefill else self.window

    def score(self, obs: Observation) -> torch.Tensor:
        w = self.kept_window(obs)
        n = obs.keys.shape[2]
        assert obs.queries is not None
        queries = obs.queries[:, :, -w:]
        cand = n - w
        pooling = self.pooling if self.pooling != "auto" else ("avg" if self.variant == "paper" else "max")
        if self.variant == "paper":
            imp = causal_window_importance(queries, obs.keys, self.group_reduce)
            imp = pool1d(imp, self.kernel, pooling, count_include_pad=True)
        else:
            # Candidates precede every observation query, so no causal mask is needed; `select` keeps the window.
            imp = window_importance(queries, obs.keys[:, :, :cand], self.kernel, pooling, self.group_reduce)
        return torch.cat([imp, imp.new_zeros(*imp.shape[:2], n - cand)], dim=-1)
