"""CriticalKV and CriticalAdaKV (Feng et al., ICML 2026, arXiv 2502.03805): what a token adds to the attention
output, not only the attention it gets, in two stages.

    skipkv generate --model random:qwen2 --policy criticalkv --budget 64 --prefill-window 8 "a long prompt ..."
    skipkv generate --model random:qwen2 --policy criticalkv_ada --budget 64 --prefill-window 8 "a long prompt ..."

Scores of a kv head's candidates (the tokens before its observation window and after its sink):
- stage one: SnapKV's window attention (snapkv.py; `variant`, `kernel`, `pooling`, `group_reduce` are
  SnapKV's knobs). The best `first_stage_ratio` share of the head's budget is kept by attention alone;
- stage two: the rest of the budget goes to the best (attention + `epsilon`) x ||W_o v||_1, the L1 norm of
  the token's value through each query head's slice of o_proj, averaged over the kv head's query group
  (scoring.critical.projected_value_norm).
`criticalkv` gives every kv head the same budget (SnapKV's layout, a uniform store); `criticalkv_ada` first
splits each layer's `budget` x kv heads among its heads by Ada-KV's allocation on the stage-one scores (one
top-k over the layer's heads, every head keeping at least `floor_ratio` of its share; adakv.py), then runs the
two stages inside each head's share, as kvpress's CriticalAdaKVPress does. Its heads keep different counts, so
it runs on the head-split store: the saving is real bytes at any batch size (kvpress only masks such keys).

Choices and departures (reference: kvpress criticalkv_press.py, which this follows; the paper's own code
builds on the Ada-KV repo):
- the first stage's share counts the protected tokens, as kvpress's top-k does when the window carries the
  maximum score: a head keeping K tokens keeps int(first_stage_ratio x K) - window - sink candidates by
  attention (none if that is negative), then K - window - sink in all;
- SnapKV's scores default to its own code (`variant=paper`, as kvpress's SnapKVPress and Ada-KV) with GQA logits
  averaged over each group before one softmax (`group_reduce=mean`); kvpress averages the group's per-query-head
  softmax instead (`group_reduce=probs` matches it, benchmarks/kvpress_overlap); the window is 32 queries
  (`prefill_window`), the kernel 7;
- ties go to the older token (and, in the Ada-KV allocation, the lower head); kept indices are sorted;
- `criticalkv` may also run during decode (`--phase both`), re-scoring with the newest `window` queries as
  SnapKV does; the paper compresses the prompt only, which is the default. `criticalkv_ada` is prefill only.
Chunked prefill: the selection runs after every chunk over what the heads hold, with the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.adakv import AdaKV
from skipkv.policies.base import PHASES, Observation
from skipkv.policies.laprox import model_wide_select
from skipkv.policies.snapkv import SnapKV
from skipkv.scoring import GROUP_REDUCES
from skipkv.scoring.critical import projected_value_norm, two_stage_keep


def unit_o_weight(obs: Observation) -> torch.Tensor:
    """o_proj's weight [E, Hq*D], or for one kv head of a head-split store the columns of its G query heads."""
    w = obs.module.o_proj.weight
    if obs.kv_head is None:
        return w
    assert obs.queries is not None
    G, D = obs.queries.shape[1], obs.keys.shape[-1]
    return w[:, obs.kv_head * G * D:(obs.kv_head + 1) * G * D]


def first_stage_count(ratio: float, keep: int, protected: int) -> int:
    """Candidates kept by attention alone when a head keeps `keep` tokens, `protected` of them sink and window."""
    return max(0, int(ratio * keep) - protected)


@POLICIES.register("criticalkv")
@dataclass(frozen=True)
class CriticalKV(SnapKV):
    paper = "CriticalKV (arXiv 2502.03805)"
    keeps = ("per kv head, `first_stage_ratio` of the budget by SnapKV's attention, the rest by attention × "
             "‖W_o·v‖₁ (the value through o_proj); prefill by default")
    contract_knobs = {"prefill_window": 8, "phase": "both"}

    variant: str = knob("paper", "SnapKV scores: rkv (softmax over the candidates) or paper (over all keys, window "
                        "causal, avg pooling counting padding; kvpress and Ada-KV)", choices=("rkv", "paper"))
    group_reduce: str = knob("mean", "GQA: max or mean of each query group's logits, or probs (mean of its "
                             "per-head softmax, as kvpress and Ada-KV)", choices=GROUP_REDUCES)
    first_stage_ratio: float = knob(0.5, "share of a head's budget kept by attention alone (stage one)",
                                    ge=0.0, le=1.0, kind=float)
    epsilon: float = knob(1e-4, "added to the attention before it is weighted by the projected value norm",
                          ge=0.0, kind=float)
    phase: str = knob("prefill", "when compression runs (CriticalKV compresses the prompt)", choices=PHASES)

    def score(self, obs: Observation) -> torch.Tensor:
        attn = super().score(obs)  # [b, H, n]: SnapKV's, 0 on the window
        n = attn.shape[-1]
        w = self.kept_window(obs)
        lo, hi = min(self.sink, n), max(n - w, min(self.sink, n))
        crit = (attn + self.epsilon) * projected_value_norm(obs.values, unit_o_weight(obs)).to(attn.dtype)
        k1 = first_stage_count(self.first_stage_ratio, self.budget, self.sink + w)
        if k1 and hi > lo:
            # Stage one: the best candidates by attention are kept whatever stage two says (like the protected).
            first = torch.sort(attn[..., lo:hi], dim=-1, descending=True, stable=True).indices[..., :k1] + lo
            crit.scatter_(-1, first, float("inf"))
        return crit


@POLICIES.register("criticalkv_ada")
@dataclass(frozen=True)
class CriticalAdaKV(AdaKV):
    paper = "CriticalAdaKV (arXiv 2502.03805)"
    keeps = ("Ada-KV's head-wise budgets (`budget` × kv heads per layer, heads keep different counts) on SnapKV's "
             "scores, then in each head CriticalKV's two stages (`first_stage_ratio` by attention, the rest by "
             "attention × ‖W_o·v‖₁); prefill only")
    contract_knobs = {"prefill_window": 8}

    first_stage_ratio: float = knob(0.5, "share of a head's budget kept by attention alone (stage one)",
                                    ge=0.0, le=1.0, kind=float)
    epsilon: float = knob(1e-4, "added to the attention before it is weighted by the projected value norm",
                          ge=0.0, kind=float)

    def select_model_wide(self, obs: list[Observation]) -> list[torch.Tensor] | None:
        """obs: every (layer, kv head) unit of one request, layer-major. Per layer: Ada-KV's allocation, then each
        head's two stages within its share."""
        H = sum(1 for o in obs if o.layer == obs[0].layer)
        keeps: list[torch.Tensor] = []
        evicted = False
        for i in range(0, len(obs), H):
            units = obs[i:i + H]
            attn = [self.score(o)[0, 0] for o in units]  # [n_u] per head: SnapKV's (0 on the window)
            share = model_wide_select(attn, self.budget * H, self.sink, self.prefill_window, self.head_floor())
            if share is None:  # the whole layer fits its budget
                keeps += [torch.arange(o.keys.shape[2], device=o.keys.device)[None, None] for o in units]
                continue
            evicted = True
            for o, a, kept in zip(units, attn, share):
                n = a.numel()
                lo, hi = min(self.sink, n), max(n - self.prefill_window, min(self.sink, n))
                protected = n - (hi - lo)
                K = kept.numel()
                proj = projected_value_norm(o.values, unit_o_weight(o))[0, 0].to(a.dtype)
                chosen = two_stage_keep(a[lo:hi], ((a + self.epsilon) * proj)[lo:hi], K - protected,
                                        first_stage_count(self.first_stage_ratio, K, protected)) + lo
                keep = torch.cat([torch.arange(lo, device=a.device), chosen, torch.arange(hi, n, device=a.device)])
                keeps.append(keep[None, None])
        return keeps if evicted else None
