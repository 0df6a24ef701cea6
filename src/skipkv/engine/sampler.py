"""Token sampling: greedy, or temperature / top-k / top-p with a per-request seeded generator.

Each request draws from its own `torch.Generator`, so its tokens do not depend on which other requests
share the batch (a batch equals its requests run alone, sampled or greedy).
"""

from __future__ import annotations

import torch

from skipkv.config import SamplingParams
from skipkv.engine.request import Request


def filter_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of logits [V] (fp32); returns filtered logits."""
    # Shift so the largest logit is 0 first (softmax, top-k and top-p do not change), in fp64 (a temperature
    # like 1e-300 is 0 in fp32): a tiny temperature then sends the others to -inf, a greedy pick, instead of
    # overflowing every logit to inf (a NaN distribution).
    x = (logits.double() - logits.max()) / sp.temperature
    if sp.top_k and sp.top_k < x.numel():
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= sp.top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return x


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [B, V] -> one token per request."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for i, r in enumerate(requests):
        if not r.sampling.greedy:
            probs = torch.softmax(filter_logits(logits[i], r.sampling), dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=r.generator))
    return tokens
