"""Token sampling: greedy, or temperature / top-k / top-p with a per-request seeded generator; a repetition
penalty (transformers' and vLLM's rule, over the prompt and the output) before either.

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


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit: `logits.float().argmax(-1)`, read in the logits' own dtype
    (widening to fp32 is exact, so the largest entries and their order are the same). `max(dim)` rather than
    `argmax`: both return the first maximal index, and on a 16-bit CPU tensor `max` is faster. With the fp32 copy
    skipped, a [64, 151936] bf16 block took 2.7-3.4x less time (~14 ms less; benchmarks/probes/greedy_pick.py); in whole
    batch-64 decode steps the difference was within the machine's noise (`greedy_pick.py --engine`)."""
    return logits.max(dim=-1).indices


def penalize_repetition(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """One row of logits [V] with every token in `seen` penalized: a positive logit divided by `penalty`, a
    negative one multiplied (transformers' RepetitionPenaltyLogitsProcessor, vLLM's repetition_penalty)."""
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    vals = logits[idx]
    return logits.index_put((idx,), torch.where(vals < 0, vals * penalty, vals / penalty))


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [B, V] (any float dtype) -> one token per request. Sampled or penalized rows are converted to fp32
    first."""
    tokens = greedy_tokens(logits).tolist()
    for i, r in enumerate(requests):
        sp = r.sampling
        if sp.greedy and sp.repetition_penalty == 1.0:
            continue
        row = logits[i].float()
        if sp.repetition_penalty != 1.0:
            row = penalize_repetition(row, r.prompt_ids + r.output_ids, sp.repetition_penalty)
        if sp.greedy:
            tokens[i] = int(greedy_tokens(row))
        else:
            probs = torch.softmax(filter_logits(row, sp), dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=r.generator))
    return tokens
