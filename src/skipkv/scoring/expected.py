"""Expected Attention (arXiv 2510.00636): the attention future queries are expected to pay each cached key, in
closed form under a Gaussian model of the queries, averaged over the rotations of future positions.
Shapes: b rows, H kv heads, G query group, w queries, n tokens, D head dim.

Every function here has a naive loop reference in tests/test_scoring_frontier.py.
"""

from __future__ import annotations

import torch

from skipkv.scoring.rope import rope_cos_sin


def query_statistics(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [b, Hq, D] and covariance [b, Hq, D, D] (divided by w, not w - 1) of pre-RoPE queries [b, Hq, w, D]."""
    q = queries.double() if queries.dtype == torch.float64 else queries.float()
    mean = q.mean(dim=2)
    c = q - mean[:, :, None]
    return mean, c.transpose(-1, -2) @ c / q.shape[2]


def average_rotation(inv_freq: torch.Tensor, start: int, count: int, scaling: float = 1.0) -> torch.Tensor:
    """The mean over positions t in [start, start + count) of RoPE's matrix R(t) [D, D] (x -> R(t) x applies RoPE
    at position t: diag(cos) + diag(sin) P, P the rotate_half matrix), fp64."""
    cos, sin = rope_cos_sin(inv_freq, torch.arange(start, start + count), scaling)  # [count, D]
    D = cos.shape[-1]
    h = D // 2
    P = torch.zeros(D, D, dtype=torch.float64)
    P[:h, h:] = -torch.eye(h, dtype=torch.float64)
    P[h:, :h] = torch.eye(h, dtype=torch.float64)
    return torch.diag(cos.mean(dim=0)) + torch.diag(sin.mean(dim=0)) @ P


def expected_attention(mean: torch.Tensor, cov: torch.Tensor | None, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Expected attention of each key, averaged over each kv head's query group: softmax over the n keys of
    scale * mu.k + scale^2 / 2 * k^T Sigma k (E[exp(scale q.k)] for q ~ N(mu, Sigma); no covariance term when
    `cov` is None). mean [b, Hq, D] and cov [b, Hq, D, D] are already rotated to the future positions; keys
    [b, H, n, D] post-RoPE -> [b, H, n] (fp32, fp64 for fp64 keys)."""
    b, Hq, D = mean.shape
    H = keys.shape[1]
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    k = keys.to(dt).repeat_interleave(Hq // H, dim=1)  # [b, Hq, n, D]
    logits = torch.einsum("bhd,bhnd->bhn", mean.to(dt), k) * scale
    if cov is not None:
        logits = logits + torch.einsum("bhnd,bhde,bhne->bhn", k, cov.to(dt), k) * (scale * scale / 2)
    return torch.softmax(logits, dim=-1).view(b, H, Hq // H, -1).mean(dim=2)
