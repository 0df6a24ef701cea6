"""DefensiveKV and Layer-DefensiveKV (Feng et al., ICLR 2026, arXiv 2510.13334): aggregate the window's
attention defensively (the worst case over queries, not their mean), weight it by what the token adds to the
output, and split the budget over heads (DefensiveKV) or over every layer and head at once (Layer-DefensiveKV).

    skipkv generate --model random:qwen2 --policy defensivekv --budget 64 --prefill-window 8 "a long prompt ..."
    skipkv generate --model random:qwen2 --policy layer_defensivekv --budget 64 --prefill-window 8 "..."

Per layer, from the last `prefill_window` prompt queries (scoring.critical):
1. A = each window query's softmax over the keys (the window's own causally); over the candidates (the keys
   before the window) each query's row is average-pooled (`kernel` 5, zero padding counted) and rescaled to its
   unpooled mass; the defensive score of a candidate is the MAX over the query heads of its kv group and over the
   window queries, clamped from below at that head's mean over the candidates;
2. times CriticalKV's ||W_o v||_1 (averaged over the group), normalised per token over the layer's kv heads;
3. stage one (as in CriticalKV): per head, the candidates that hold the first `threshold` - (the window's mass on
   its own keys) of the head's mean attention, at most the head's share of the budget less its protected tokens,
   are given the layer's highest score;
4. `defensivekv`: per layer one top-k over its heads (`budget` x kv heads); `layer_defensivekv`: ONE top-k over
   every (layer, kv head) of the model (`budget` x layers x kv heads) - the closest published relative of LaProx
   at granularity head. Every head keeps its `sink` oldest and `prefill_window` newest tokens.
Heads keep different counts: both run on the head-split store, so the saving is real bytes at any batch size
(the reference code runs at batch 1 and masks nothing it cannot drop).

Choices and departures (reference: FFY0/DefensiveKV, efficient_defensivekv_press.py and
efficient_layer_defensivekv_press.py):
- the window's mass on itself is the attention the window queries give the window keys, averaged over query
  heads and queries, per request; the reference slices the window off first and so measures the last
  `window` candidates (batch-averaged) instead;
- the window and sink are protected (never evicted); the reference gives the window its layer's highest score,
  which a model-wide top-k could still evict in a weak layer;
- stage one uses the unpooled mean attention, as the reference; ties go to the older token, then the lower
  head (the lower layer); kept indices are sorted; the budget is per kv head (as every policy here);
- `floor_ratio` (0, none in the reference) can add Ada-KV's per-head floor;
- prefill only, and the whole prompt at once: the per-token normalisation over heads needs every head to hold
  the same tokens, so chunked prefill (`--prefill-chunk`) is refused (the reference compresses once too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.policies import POLICIES
from skipkv.policies.adakv import head_floor
from skipkv.policies.base import Observation, Policy
from skipkv.policies.laprox import model_wide_select
from skipkv.scoring.critical import causal_window_attention, defensive_scores, mass_prefix, projected_value_norm


def defensive_layer_scores(units: list[Observation], window: int, sink: int, kernel: int, threshold: float,
                           head_keep: int) -> list[torch.Tensor]:
    """DefensiveKV's scores [n] for each kv head of one layer (`units`, every head holding the same n entries):
    steps 1-3 of the module docstring; protected entries score 0 (selection never compares them)."""
    keys = torch.cat([o.keys for o in units], dim=1)  # [1, H, n, D]
    values = torch.cat([o.values for o in units], dim=1)
    queries = torch.cat([o.queries for o in units if o.queries is not None], dim=1)  # [1, Hq, w, D]
    o_weight = units[0].module.o_proj.weight
    n, D = keys.shape[2], keys.shape[3]
    scale = getattr(units[0].module, "scaling", None) or D**-0.5
    A = causal_window_attention(queries[:, :, -window:], keys, scale)  # [1, H, G, w, n]
    defensive, mean_attn, self_mass = defensive_scores(A, kernel)  # [1, H, n - w] x2, [1]
    proj = projected_value_norm(values[:, :, : n - window], o_weight).to(defensive.dtype)  # [1, H, n - w]
    s = defensive * proj / proj.sum(dim=1, keepdim=True).clamp_min(torch.finfo(proj.dtype).tiny)
    top = float(s.max())
    out = []
    for h in range(keys.shape[1]):
        sh = s[0, h].clone()
        cand = mean_attn[0, h, sink:]
        first = mass_prefix(cand, threshold - float(self_mass[0]), head_keep - window - sink) + sink
        sh[first] = top
        sh[:sink] = 0
        out.append(torch.cat([sh, sh.new_zeros(window)]))
    return out


@POLICIES.register("defensivekv")
@dataclass(frozen=True)
class DefensiveKV(Policy):
    paper = "DefensiveKV (arXiv 2510.13334)"
    keeps = ("the window's attention aggregated defensively (max over queries, clamped at its mean) × ‖W_o·v‖₁ "
             "normalised over heads, CriticalKV's stage one by attention mass; per layer one top-k over its heads "
             "(`budget` × kv heads, heads keep different counts); prefill only, whole prompt")
    contract_knobs = {"prefill_window": 8}

    prefill_window: int = knob(32, "prompt queries that score the prompt (the newest, kept in every head)", gt=0)
    kernel: int = knob(5, "average-pool width over each query's attention row (odd)", gt=0, odd=True)
    threshold: float = knob(0.9, "stage one: the attention mass (less the window's own) kept by attention alone",
                            ge=0.0, le=1.0, kind=float)
    floor_ratio: float = knob(0.0, "share of the per-head candidate budget every kv head keeps at least (Ada-KV's "
                              "floor; none in the reference)", ge=0.0, le=1.0, kind=float)
    phase: str = knob("prefill", "when compression runs (DefensiveKV compresses the prompt)", choices=("prefill",))

    needs: ClassVar[frozenset[str]] = frozenset({"queries"})
    model_wide: ClassVar[bool] = True
    chunked_prefill: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget <= self.prefill_window + self.sink:
            raise SkipKVError(f"{type(self).__name__} budget ({self.budget}) must exceed prefill_window + sink "
                              f"({self.prefill_window} + {self.sink})")

    @property
    def query_window(self) -> int:
        return self.prefill_window

    @property
    def head_split(self) -> bool:
        return True

    def head_floor(self) -> int:
        return head_floor(self)

    def units_per_selection(self, num_layers: int, num_kv_heads: int) -> int:
        """(layer, kv head) units that share one top-k: a layer's heads."""
        return num_kv_heads

    def head_prefill_keep(self, num_layers: int, num_kv_heads: int, prompt_len: int, prefix_len: int) -> list[int]:
        # A head keeps at most its selection's total less what the other units keep at least.
        u = self.units_per_selection(num_layers, num_kv_heads)
        most = self.budget * u - (u - 1) * min(prefix_len, self.head_floor())
        return [most] * (num_layers * num_kv_heads)

    def head_capacity(self, num_layers: int, num_kv_heads: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        keep = self.head_prefill_keep(num_layers, num_kv_heads, prompt_len, prompt_len)
        return [min(prompt_len, k) + max_new_tokens for k in keep]

    def should_compress(self, length: int, is_prefill: bool, state: object | None = None) -> bool:
        return is_prefill and length > self.budget

    def unit_scores(self, obs: list[Observation], H: int) -> list[torch.Tensor]:
        """Every unit's scores [n_u], layer by layer."""
        out: list[torch.Tensor] = []
        for i in range(0, len(obs), H):
            units = obs[i:i + H]
            if len({o.keys.shape[2] for o in units}) > 1:
                raise SkipKVError(f"{type(self).__name__} scores the whole prompt once; its heads already hold "
                                  "different counts (was the prompt prefilled in chunks?)")
            out += defensive_layer_scores(units, self.prefill_window, self.sink, self.kernel, self.threshold,
                                          self.budget)
        return out

    def select_model_wide(self, obs: list[Observation]) -> list[torch.Tensor] | None:
        H = sum(1 for o in obs if o.layer == obs[0].layer)
        u = self.units_per_selection(len(obs) // H, H)
        if sum(o.keys.shape[2] for o in obs) <= self.budget * len(obs):
            return None
        scores = self.unit_scores(obs, H)
        keeps: list[torch.Tensor] = []
        for i in range(0, len(obs), u):
            keep = model_wide_select(scores[i:i + u], self.budget * u, self.sink, self.prefill_window,
                                     self.head_floor())
            keeps += keep if keep is not None else [torch.arange(s.numel(), device=s.device) for s in scores[i:i + u]]
        return [k[None, None, :] for k in keeps]


@POLICIES.register("layer_defensivekv")
@dataclass(frozen=True)
class LayerDefensiveKV(DefensiveKV):
    paper = "Layer-DefensiveKV (arXiv 2510.13334)"
    keeps = ("DefensiveKV's scores, then ONE top-k over every (layer, kv head) of the model (`budget` × layers × "
             "kv heads; layers and heads keep different counts); prefill only, whole prompt")

    def units_per_selection(self, num_layers: int, num_kv_heads: int) -> int:
        return num_layers * num_kv_heads
