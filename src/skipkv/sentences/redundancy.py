"""Sentence redundancy (SkipKV `cal_sentence_similarity_from_reprs`) and the span penalty on cached entries.

    flags = flag_earlier(reps, first_new=5, tau=0.95)        # [S] similarity of each flagged sentence, else 0
    pen = span_penalty(positions, starts, ends, sims)       # per cached entry: sim of its flagged sentence, else 0

Shapes: S closed sentences, E hidden size, F flagged sentences; positions any shape (e.g. [H, n]).
"""

from __future__ import annotations

import torch


def flag_earlier(reps: torch.Tensor, first_new: int, tau: float) -> torch.Tensor:
    """Compare the new sentences (indices >= first_new) with every earlier sentence (cosine of normalised
    means, reps [S, E]); a pair (j < i) with similarity > tau flags the EARLIER sentence j. Returns [S]: for each
    sentence the largest similarity it was flagged with in this call, 0 where it was not."""
    S = reps.shape[0]
    out = torch.zeros(S, dtype=reps.dtype)
    if S - first_new <= 0 or S < 2:
        return out
    sims = reps[first_new:] @ reps.T  # [S_new, S]: row r is sentence first_new + r
    i = torch.arange(first_new, S)[:, None]
    j = torch.arange(S)[None, :]
    hit = (j < i) & (sims > tau)
    return torch.where(hit, sims, torch.zeros_like(sims)).amax(dim=0).clamp(min=0)


def span_penalty(positions: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, sims: torch.Tensor,
                 min_entries: int = 1) -> torch.Tensor:
    """For each true position, the value `sims[f]` of the span f = [starts[f], ends[f]] holding it, else 0.

    Spans are sorted by start and disjoint (starts, ends, sims [F]); membership is a searchsorted over the
    starts plus a check against the end, so no index into the cache is ever stored. `min_entries`: a span
    counts in a row (the last dim of `positions`, e.g. one head's cache) only if at least this many of the
    row's positions lie in it (SkipKV skips a local span with start >= end, i.e. fewer than 2 entries)."""
    out = torch.zeros(positions.shape, dtype=sims.dtype, device=positions.device)
    if starts.numel() == 0:
        return out
    pos = positions.to(torch.long)
    dev = pos.device
    starts, ends, sims = starts.to(dev), ends.to(dev), sims.to(dev)
    idx = torch.searchsorted(starts, pos, right=True) - 1  # the last span starting at or before pos
    safe = idx.clamp(min=0)
    inside = (idx >= 0) & (pos <= ends[safe])
    if min_entries > 1:  # entries of each span per row: [..., F] counts, looked up for each entry
        counts = torch.zeros(*pos.shape[:-1], starts.numel(), dtype=torch.long, device=dev)
        counts.scatter_add_(-1, safe, inside.long())
        inside &= counts.gather(-1, safe) >= min_entries
    return torch.where(inside, sims[safe], out)
