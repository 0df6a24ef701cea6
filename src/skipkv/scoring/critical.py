"""Output-aware scoring pieces of CriticalKV (arXiv 2502.03805) and DefensiveKV (arXiv 2510.13334).
Shapes: b rows, H kv heads, G query group, w window queries, n tokens, D head dim, E hidden size.

Every function here has a naive loop reference in tests/test_scoring_frontier.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def projected_value_norm(values: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
    """CriticalKV's ||W_o v||_1: per token, the L1 norm of its value through each query head's slice of o_proj,
    averaged over the G query heads that read its kv head. values [b, H, n, D], o_weight [E, H*G*D] (nn.Linear
    layout; for one kv head of a head-split store, the columns of its G query heads) -> [b, H, n] (fp32/fp64)."""
    b, H, n, D = values.shape
    dt = torch.float64 if values.dtype == torch.float64 else torch.float32
    Hq = o_weight.shape[1] // D
    W = o_weight.to(dt).reshape(-1, Hq, D).permute(1, 2, 0)  # [Hq, D, E]: W_O^h
    V = values.to(dt).repeat_interleave(Hq // H, dim=1)  # [b, Hq, n, D]: query head h reads kv head h // G
    norms = torch.stack([(V[:, h] @ W[h]).abs().sum(dim=-1) for h in range(Hq)], dim=1)  # [b, Hq, n], head by head
    return norms.view(b, H, Hq // H, n).mean(dim=2)


def two_stage_keep(first: torch.Tensor, second: torch.Tensor, keep: int, keep_first: int) -> torch.Tensor:
    """CriticalKV's selection among m candidates: the `keep_first` best by `first` (attention), then the best
    `keep - keep_first` others by `second` (attention x projected norm); ties go to the older token.
    first, second [m] -> kept indices [min(keep, m)], ascending."""
    m = first.numel()
    keep = min(keep, m)
    k1 = min(max(keep_first, 0), keep)
    order1 = torch.sort(first, descending=True, stable=True).indices
    chosen = torch.zeros(m, dtype=torch.bool, device=first.device)
    chosen[order1[:k1]] = True
    rest = torch.nonzero(~chosen).flatten()
    order2 = rest[torch.sort(second[rest], descending=True, stable=True).indices]
    chosen[order2[: keep - k1]] = True
    return torch.nonzero(chosen).flatten()


def causal_window_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of the w window queries (the tokens of the last w keys) over every key, the window's own keys
    causally. queries [b, H*G, w, D], keys [b, H, n, D] -> [b, H, G, w, n] (fp32, fp64 for fp64 inputs)."""
    b, Hq, w, D = queries.shape
    H, n = keys.shape[1], keys.shape[2]
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    q = queries.to(dt).view(b, H, Hq // H, w, D)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys.to(dt)) * scale
    visible = torch.arange(n, device=keys.device)[None, :] <= (n - w + torch.arange(w, device=keys.device))[:, None]
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def defensive_scores(attn: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DefensiveKV's aggregation of the window attention attn [b, H, G, w, n] (causal_window_attention) over the
    n - w candidates (the keys before the window):
      - each query's candidate row is average-pooled (`kernel`, zero padding counted) and rescaled to its
        unpooled mass; then the MAX over the group's query heads and the window queries (not the mean), clamped
        from below at its mean over the candidates: the defensive score [b, H, n - w];
      - the mean attention over query heads and window queries [b, H, n - w] (stage one's attention mass);
      - the mass the window puts on its own keys, averaged over heads and queries [b].
    """
    b, H, G, w, n = attn.shape
    cand = attn[..., : n - w]
    mass = cand.sum(dim=-1, keepdim=True)
    pooled = F.avg_pool1d(cand.reshape(-1, 1, n - w), kernel, stride=1, padding=kernel // 2).view(cand.shape)
    pooled = pooled / pooled.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(pooled.dtype).tiny) * mass
    peak = pooled.amax(dim=(2, 3))  # [b, H, n - w]
    defensive = torch.maximum(peak, peak.mean(dim=-1, keepdim=True))
    return defensive, cand.mean(dim=(2, 3)), attn[..., n - w:].sum(dim=-1).mean(dim=(1, 2, 3))


def mass_prefix(attn: torch.Tensor, threshold: float, cap: int) -> torch.Tensor:
    """DefensiveKV's stage one for one head: its candidates by attention attn [m] (descending, ties to the older),
    normalised to sum 1, taken while the cumulative share is below `threshold` (the tokens strictly before the
    first cumulative sum >= threshold, as the reference counts; none when it is never reached), at most `cap`.
    Returns their indices [k] (in that order)."""
    order = torch.sort(attn, descending=True, stable=True).indices
    share = attn[order] / attn.sum().clamp_min(torch.finfo(attn.dtype).tiny)
    hit = torch.nonzero(torch.cumsum(share, dim=0) >= threshold)
    count = int(hit[0]) if hit.numel() else 0
    return order[: max(0, min(count, cap))]
