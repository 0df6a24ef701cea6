"""Ada-KV (Feng et al., arXiv 2407.11550): adaptive budgets across the kv heads of a layer, SnapKV's scores.

    skipkv generate --model random:qwen2 --policy adakv --budget 64 --prefill-window 8 "a long prompt ..."

At prefill, every kv head h of layer l scores its candidates as SnapKV does (the last `prefill_window` prompt
queries, scoring.causal_window_importance + 1-D pooling, see snapkv.py; `variant`, `kernel`, `pooling` and
`group_reduce` are SnapKV's knobs). Then, per layer, ONE top-k runs over the concatenated scores of all its
kv heads: the layer keeps `budget` x H entries, so a head whose attention is concentrated keeps few and a
head whose attention is spread keeps many. Every head keeps its `sink` oldest and `prefill_window` newest
tokens and, Ada-KV's safeguard against starving a head, at least `floor_ratio` of the per-head candidate
budget (budget - prefill_window - sink) of its best candidates. Ties: lower head, then older token.

Heads of one layer end at different counts, so the engine gives this policy a head-split store
(cache/store.py): each (layer, kv head) is allocated for what it keeps. Decode steps then append one entry
per head and never evict (prefill compression only, as the paper evaluates it on long prompts). Under chunked
prefill the selection runs after every chunk with the same per-layer total.

Departures from the reference code (AdaKV repo, adaptive_snapkv), as we read it: scores default to SnapKV's
own code (`variant=paper`: softmax over every key, the window causal, average pooling counting padding, as
Ada-KV builds on it) with GQA logits averaged over each query group (`group_reduce=mean`) before one softmax;
Ada-KV's GQA code and kvpress instead average the group's per-query-head softmax (`group_reduce=probs`, which
gives kvpress's kept sets, benchmarks/kvpress_overlap; on a GQA model the default keeps other tokens); the
floor is counted over candidates (protected tokens come on top of it); kept indices are sorted; the budget is
per kv head (as every policy here), so a layer keeps `budget` x H in all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation
from skipkv.policies.laprox import model_wide_select
from skipkv.policies.snapkv import SnapKV
from skipkv.scoring import GROUP_REDUCES


def head_floor(policy) -> int:
    """Entries every kv head keeps at least when its layer is compressed (Ada-KV's safeguard): the protected window
    and sink + `floor_ratio` of the per-head candidate budget. Policies with those knobs share it."""
    protected = policy.prefill_window + policy.sink
    return protected + int(policy.floor_ratio * (policy.budget - protected))


@POLICIES.register("adakv")
@dataclass(frozen=True)
class AdaKV(SnapKV):
    paper = "Ada-KV (arXiv 2407.11550)"
    keeps = ("SnapKV's scores per kv head, then per layer one top-k over all its heads (`budget` × kv heads; "
             "heads keep different counts, each at least `floor_ratio` of its share); prefill only")
    contract_knobs = {"prefill_window": 8}

    variant: str = knob("paper", "rkv: softmax over the candidates (R-KV repo); paper: over all keys, window "
                        "causal, avg pooling counting padding (SnapKV code, as Ada-KV)", choices=("rkv", "paper"))
    group_reduce: str = knob("mean", "GQA: max or mean of each query group's logits, or probs (mean of its "
                             "per-head softmax, as kvpress and Ada-KV)", choices=GROUP_REDUCES)
    floor_ratio: float = knob(0.2, "share of the per-head candidate budget every kv head keeps at least "
                              "(Ada-KV's safeguard)", ge=0.0, le=1.0, kind=float)
    phase: str = knob("prefill", "when compression runs (Ada-KV compresses the prompt)", choices=("prefill",))

    model_wide: ClassVar[bool] = True  # sees every (layer, kv head) of one request at once

    @property
    def head_split(self) -> bool:
        return True

    def head_floor(self) -> int:
        return head_floor(self)

    def head_prefill_keep(self, num_layers: int, num_kv_heads: int, prompt_len: int, prefix_len: int) -> list[int]:
        # A head keeps at most its layer's total less what the other heads keep at least (min(prefix, floor)
        # each); a layer left whole holds prefix_len <= budget per head, which the bound covers too.
        most = self.budget * num_kv_heads - (num_kv_heads - 1) * min(prefix_len, self.head_floor())
        return [most] * (num_layers * num_kv_heads)

    def head_capacity(self, num_layers: int, num_kv_heads: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        keep = self.head_prefill_keep(num_layers, num_kv_heads, prompt_len, prompt_len)
        return [min(prompt_len, k) + max_new_tokens for k in keep]

    def select_model_wide(self, obs: list[Observation]) -> list[torch.Tensor] | None:
        """obs: every (layer, kv head) unit of one request, layer-major. Per layer one top-k over its heads."""
        H = sum(1 for o in obs if o.layer == obs[0].layer)
        keeps: list[torch.Tensor] = []
        evicted = False
        for i in range(0, len(obs), H):
            units = obs[i:i + H]
            scores = [self.score(o)[0, 0] for o in units]  # [n_u] per head, protected entries included
            keep = model_wide_select(scores, self.budget * H, self.sink, self.prefill_window, self.head_floor())
            if keep is None:  # the whole layer fits its budget
                keep = [torch.arange(o.keys.shape[2], device=o.keys.device) for o in units]
            else:
                evicted = True
            keeps += [k[None, None, :] for k in keep]
        return keeps if evicted else None
