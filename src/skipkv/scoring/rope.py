"""RoPE as pure tensor functions (the "half" layout of transformers' Qwen2/Llama/Qwen3: dims i and i + D/2 pair).

Keys are cached after RoPE; TriAttention and Expected Attention need them (or queries) before it, or need the
rotation of a future position. inv_freq comes from skipkv.models.rope.rope_frequencies.

    cos, sin = rope_cos_sin(inv_freq, positions, scaling)   # [..., D]
    x = unrotate(rotate(x, cos, sin), cos, sin, scaling)    # == x
"""

from __future__ import annotations

import torch


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, D] as transformers builds them (emb = cat(freqs, freqs), times `scaling`)."""
    freqs = positions.to(dtype)[..., None] * inv_freq.to(dtype)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last axis."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: x cos + rotate_half(x) sin (transformers' apply_rotary_pos_emb)."""
    return x * cos + rotate_half(x) * sin


def unrotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """Undo `rotate`: the transpose of the rotation, divided by scaling^2 (cos and sin each carry one `scaling`)."""
    return (y * cos - rotate_half(y) * sin) / (scaling * scaling)
