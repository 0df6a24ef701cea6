"""Expected Attention (Devoto et al., arXiv 2510.00636): keep the keys that future queries are expected to attend
to, in closed form, times the norm of their values. No attention matrix of real queries is needed.

    skipkv generate --model random:qwen2 --policy expected_attention --budget 64 --interval 16 "Hello"

Per layer and request, the newest `stats_window` queries (the engine's query buffer) are rotated back to before
RoPE, and their mean mu and covariance Sigma per query head estimate the distribution of the next queries. The
rotation of the next `future_positions` positions is averaged into one matrix R (scoring.expected); with mu' =
R mu and Sigma' = R Sigma R^T, each cached key k (post-RoPE) scores

    softmax_k( scale mu'.k + scale^2 / 2 k^T Sigma' k ) averaged over the kv head's query group, times ||v||_2

(E[exp(scale q.k)] for q ~ N(mu', Sigma'); `covariance` false drops the second term). The `sink` (4) oldest
and the newest `window` tokens are kept whatever they score. It compresses the prompt and, every `interval`
generated tokens, the cache (`phase` both): queries keep coming, so the statistics follow the generation.

Choices and departures (reference: kvpress expected_attention_press.py):
- the statistics come from the newest `stats_window` (128) queries (at most as many as the cache holds entries),
  rotated back with their own positions; the
  reference projects every prompt token's hidden state (less the sink) through W_q, which the engine does not
  keep. Using the queries themselves also covers models with a query norm (Qwen3), which the reference refuses;
- kvpress adds `epsilon` (0) before the value norm and protects no window; the engine keeps at least one
  newest token (`window` 1 by default);
- the future positions start right after the newest token (the reference: after the prompt);
- ties go to the older token; kept indices are sorted.
Chunked prefill: each chunk's compression uses the queries buffered so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.models.rope import rope_frequencies
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.scoring.expected import average_rotation, expected_attention, query_statistics
from skipkv.scoring.rope import rope_cos_sin, unrotate


def pre_rope_queries(obs: Observation, w: int, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """The observation's newest w buffered queries [b, Hq, w, D] rotated back to before RoPE: the newest is the
    token at each row's newest position, the others precede it one by one."""
    assert obs.queries is not None
    newest = obs.positions.amax(dim=(1, 2)).long()  # [b]
    pos = newest[:, None] - (w - 1) + torch.arange(w, device=newest.device)[None, :]  # [b, w]
    cos, sin = rope_cos_sin(inv_freq, pos.cpu(), scaling)  # [b, w, D]
    dt = torch.float64 if obs.queries.dtype == torch.float64 else torch.float32
    q = obs.queries[:, :, -w:].to(dt)
    return unrotate(q, cos[:, None].to(q.device, dt), sin[:, None].to(q.device, dt), scaling)


@POLICIES.register("expected_attention")
@dataclass(frozen=True)
class ExpectedAttention(Policy):
    paper = "Expected Attention (arXiv 2510.00636)"
    keeps = ("`sink` + newest `window` + the keys future queries are expected to attend to (a Gaussian of the newest "
             "`stats_window` pre-RoPE queries, averaged over the next `future_positions` rotations) × ‖v‖; prefill "
             "and decode")

    window: int = knob(1, "newest tokens always kept", ge=1)
    sink: int = knob(4, "oldest tokens always kept (the reference's n_sink)", ge=0)
    stats_window: int = knob(128, "newest queries whose mean and covariance model the future queries", gt=1)
    future_positions: int = knob(512, "future positions whose RoPE rotation is averaged", gt=0)
    covariance: bool = knob(True, "include the covariance term (false: the mean query only)")
    value_norm: bool = knob(True, "multiply by ||v||_2 (the reference's use_vnorm)")
    epsilon: float = knob(0.0, "added to the expected attention before the value norm", ge=0.0, kind=float)

    needs: ClassVar[frozenset[str]] = frozenset({"queries"})

    @property
    def query_window(self) -> int:
        return max(self.window, self.stats_window)

    def score(self, obs: Observation) -> torch.Tensor:
        inv_freq, scaling = rope_frequencies(obs.module.config)
        assert obs.queries is not None
        # At most as many queries as the rows hold entries: every row compressed in this group has seen that many
        # (the engine hands a group the fewest any of its rows buffered), so a row scores alike alone or batched.
        w = min(self.stats_window, obs.keys.shape[2], obs.queries.shape[2])
        q = pre_rope_queries(obs, w, inv_freq, scaling)
        mean, cov = query_statistics(q)  # [b, Hq, D], [b, Hq, D, D]
        # Each row's own future: the positions right after its newest token.
        R = torch.stack([average_rotation(inv_freq, int(p) + 1, self.future_positions, scaling)
                         for p in obs.positions.amax(dim=(1, 2)).tolist()]).to(q.device, q.dtype)[:, None]  # [b,1,D,D]
        mean = (R @ mean[..., None])[..., 0]
        future_cov = R @ cov @ R.transpose(-1, -2) if self.covariance else None
        D = obs.keys.shape[-1]
        scale = getattr(obs.module, "scaling", None) or D**-0.5
        s = expected_attention(mean, future_cov, obs.keys, scale)  # [b, H, n]
        if self.value_norm:
            s = (s + self.epsilon) * obs.values.to(s.dtype).norm(dim=-1)
        return s
