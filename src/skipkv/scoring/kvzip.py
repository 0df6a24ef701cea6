"""KVzip's score (Kim et al., arXiv 2505.23416): the most attention a cached context entry receives while the model
reconstructs the context. Shapes: b rows, H kv heads, G query group, T reconstruction tokens, P context entries,
D head dim.

Its naive loop reference is tests/frontier_ref.py `kvzip_scores` (tests/test_kvzip.py).
"""

from __future__ import annotations

import torch

# fp32 (fp64) logits of one block of reconstruction queries, at most: a 2K-token chunk over a 32K context would
# otherwise hold Hq x 2K x 34K probabilities per layer at once.
BLOCK_BYTES = 1 << 28


def reconstruction_scores(queries: torch.Tensor, context_keys: torch.Tensor, own_keys: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Per context entry, the MAX over the T reconstruction queries and the G query heads of its kv head of the
    attention probability it gets, each query's softmax taken over every key it sees: the P context keys and the
    reconstruction's own keys up to itself (causal).

    queries [b, H*G, T, D] post-RoPE; context_keys [b, H, P, D]; own_keys [b, H, T, D] (the reconstruction's keys,
    post-RoPE) -> [b, H, P] (fp32, fp64 for fp64 inputs)."""
    b, Hq, T, D = queries.shape
    H, P = context_keys.shape[1], context_keys.shape[2]
    G = Hq // H
    dt = torch.float64 if queries.dtype == torch.float64 else torch.float32
    keys = torch.cat([context_keys, own_keys], dim=2).to(dt)  # [b, H, P + T, D]
    q = queries.to(dt).view(b, H, G, T, D)
    out = torch.zeros(b, H, P, dtype=dt, device=queries.device)
    step = max(1, BLOCK_BYTES // (b * Hq * (P + T) * keys.element_size()))
    key_idx = torch.arange(P + T, device=queries.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        logits = torch.einsum("bhgtd,bhkd->bhgtk", q[:, :, :, t0:t1], keys) * scale  # [b, H, G, t, P + T]
        # query t sees every context key and its own keys 0..t (cache index P + t)
        visible = key_idx[None, :] <= P + torch.arange(t0, t1, device=queries.device)[:, None]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.maximum(out, probs[..., :P].amax(dim=(2, 3)))
    return out
