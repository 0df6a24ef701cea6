"""TriAttention's key score (arXiv 2604.04921): a trigonometric series in the distance between a key and the
future queries, from pre-RoPE query statistics calibrated offline (`skipkv calibrate`), no attention matrix.
Shapes: b rows, H kv heads, Hq query heads, n tokens, D head dim, F = D/2 RoPE frequencies.

With RoPE each frequency band f pairs dims (f, f + F) into a complex number; a query q at position t and a key k
at position p contribute Re(q_f conj(k_f) e^{i (t - p) w_f}) to q.k. With the calibrated mean query qbar_f and
mean modulus E|q_f| of a head, the expected logit of a query d positions ahead of the round start t is

    S(k, d) = sum_f |qbar_f| |k_f| s_f^2 cos((t - p + d) w_f + phi_f)  +  sum_f (E|q_f| - |qbar_f|) |k_f| s_f^2

(phi_f = arg(qbar_f conj(k_f)); s_f RoPE's attention scaling; the second sum bounds what the spread of the
queries around their mean adds). The score is S averaged over the geometric offsets d = 1, 2, 4, ... <=
`max_offset`; the average folds into a per-band weight W_f = mean_d e^{i w_f d}.

Every function here has a naive loop reference in tests/test_scoring_frontier.py.
"""

from __future__ import annotations

import torch


def geometric_offsets(max_offset: int) -> torch.Tensor:
    """1, 2, 4, ... up to `max_offset` (fp64)."""
    out, d = [], 1
    while d <= max_offset:
        out.append(float(d))
        d *= 2
    return torch.tensor(out, dtype=torch.float64)


def complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., D] real -> [..., D/2] complex: band f is x[f] + i x[f + D/2] (RoPE's half layout)."""
    h = x.shape[-1] // 2
    return torch.complex(x[..., :h].double(), x[..., h:].double())


def trig_scores(keys_pre: torch.Tensor, key_pos: torch.Tensor, start: torch.Tensor, q_mean: torch.Tensor,
                q_abs: torch.Tensor, inv_freq: torch.Tensor, offsets: torch.Tensor,
                scaling: float = 1.0) -> torch.Tensor:
    """TriAttention's score of every key for every query head (module docstring).

    keys_pre [b, H, n, D] pre-RoPE keys, key_pos [b, H, n] their positions, start [b] each row's round start t,
    q_mean [Hq, F] complex, q_abs [Hq, F] (the heads of this layer, query-head order h = kv_head * G + g),
    inv_freq [F], offsets [O] -> [b, Hq, n] fp64.
    """
    # Re(qbar conj(k) e^{i (t - p) w} W) splits into a key part conj(k) e^{-i p w} [b, H, n, F] and a query part
    # qbar e^{i t w} W [b, Hq, F], so one product per kv group gives every query head's series without a
    # [b, Hq, n, F] tensor (250 MB per layer at b = 16, Hq = 14, n = 2176, F = 32).
    b, H, n, _ = keys_pre.shape
    Hq = q_mean.shape[0]
    G = Hq // H
    w = inv_freq.double()
    k = complex_pairs(keys_pre)  # [b, H, n, F]
    key_part = k.conj() * torch.exp(-1j * key_pos.double()[..., None] * w)  # [b, H, n, F]
    ang = offsets.double()[:, None] * w[None, :]  # [O, F]
    W = torch.complex(ang.cos().mean(dim=0), ang.sin().mean(dim=0))  # [F]: mean_d e^{i w d}
    query_part = q_mean[None] * torch.exp(1j * start.double()[:, None, None] * w) * W  # [b, Hq, F]
    query_part = query_part.view(b, H, G, -1)
    trig = torch.einsum("bhnf,bhgf->bhgn", key_part, query_part).real  # [b, H, G, n]
    spread = (q_abs.double() - q_mean.abs()).view(H, G, -1)  # [H, G, F]
    extra = torch.einsum("bhnf,hgf->bhgn", k.abs(), spread)
    return ((trig + extra) * (scaling * scaling)).reshape(b, Hq, n)
