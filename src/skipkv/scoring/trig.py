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
    k = complex_pairs(keys_pre)  # [b, H, n, F]
    Hq, H = q_mean.shape[0], keys_pre.shape[1]
    k = k.repeat_interleave(Hq // H, dim=1)  # [b, Hq, n, F]
    pos = key_pos.double().repeat_interleave(Hq // H, dim=1)  # [b, Hq, n]
    w = inv_freq.double()
    s2 = scaling * scaling
    ang = offsets.double()[:, None] * w[None, :]  # [O, F]
    W = torch.complex(ang.cos().mean(dim=0), ang.sin().mean(dim=0))  # [F]: mean_d e^{i w d}
    rel = q_mean[None, :, None, :] * k.conj()  # [b, Hq, n, F]: |qbar||k| e^{i phi}
    dist = (start.double()[:, None, None] - pos)[..., None] * w  # [b, Hq, n, F]: (t - p) w_f
    trig = (rel * torch.exp(1j * dist) * W).real.sum(dim=-1)
    extra = ((q_abs.double() - q_mean.abs())[None, :, None, :] * k.abs()).sum(dim=-1)
    return (trig + extra) * s2
