"""Pure tensor scoring functions shared by policies.
Shapes: b rows, H kv heads, G query group, w queries, n tokens, D head dim.

Every function here has a naive loop reference in tests/test_scoring.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP_REDUCES = ("max", "mean", "probs")  # how a GQA group's query heads make one kv head's score (window_probs)


def group_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled logits of each query head against its kv head's keys: queries [b, H*G, w, D], keys [b, H, n, D]
    -> [b, H, G, w, n] (fp32)."""
    b, Hq, w, D = queries.shape
    H = keys.shape[1]
    q = queries.view(b, H, Hq // H, w, D).float()
    return torch.einsum("bhgwd,bhnd->bhgwn", q, keys.float()) / D**0.5


def window_logits(queries: torch.Tensor, keys: torch.Tensor, group_reduce: str = "max") -> torch.Tensor:
    """Scaled logits of the observation queries against the keys, reduced over each GQA group.

    queries [b, H*G, w, D], keys [b, H, n, D] -> [b, H, w, n] (fp32). group_reduce: "max" (R-KV) or "mean".
    """
    logits = group_logits(queries, keys)
    return logits.amax(dim=2) if group_reduce == "max" else logits.mean(dim=2)


def window_probs(queries: torch.Tensor, keys: torch.Tensor, group_reduce: str = "max",
                 future: torch.Tensor | None = None) -> torch.Tensor:
    """Each observation query's softmax over the keys, averaged over the queries: [b, H*G, w, D] x [b, H, n, D]
    -> [b, H, n]. GQA: "max" and "mean" reduce the group's logits before one softmax; "probs" takes each query
    head's softmax and averages the G probabilities (kvpress's SnapKVPress and Ada-KV's GQA scores). `future`
    [w, n]: True where a key is masked for a query."""
    if group_reduce == "probs":
        logits = group_logits(queries, keys)  # [b, H, G, w, n]
        if future is not None:
            logits = logits.masked_fill(future, float("-inf"))
        return torch.softmax(logits, dim=-1).mean(dim=3).mean(dim=2)
    logits = window_logits(queries, keys, group_reduce)  # [b, H, w, n]
    if future is not None:
        logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=2)


def window_importance(queries: torch.Tensor, keys: torch.Tensor, kernel: int = 7, pooling: str = "max",
                      group_reduce: str = "max") -> torch.Tensor:
    """R-KV / SnapKV importance: softmax over keys of each observation query, averaged, then 1-D pooled.

    queries [b, H*G, w, D], keys [b, H, n, D] (only the candidate keys: callers drop the window first)
    -> [b, H, n]. No causal mask: candidates precede every observation query.
    """
    return pool1d(window_probs(queries, keys, group_reduce), kernel, pooling)


def causal_window_importance(queries: torch.Tensor, keys: torch.Tensor, group_reduce: str = "max") -> torch.Tensor:
    """SnapKV's own code: the w observation queries (the newest w tokens') softmax over ALL n keys, the window
    keys masked causally, averaged over queries; only the n - w candidates are returned (unpooled).

    queries [b, H*G, w, D], keys [b, H, n, D] (the window's keys are the last w) -> [b, H, n - w].
    """
    w, n = queries.shape[2], keys.shape[2]
    rows = torch.arange(w, device=keys.device)[:, None]
    cols = torch.arange(n, device=keys.device)[None, :]
    future = cols - (n - w) > rows  # window key j is after query i
    return window_probs(queries, keys, group_reduce, future)[..., : n - w]


def pool1d(x: torch.Tensor, kernel: int, pooling: str = "max", count_include_pad: bool = False) -> torch.Tensor:
    """Same-length 1-D pooling over the last axis of [b, H, n] (stride 1, padding kernel // 2).

    Average pooling divides by the in-range width unless `count_include_pad` (SnapKV's code: zeros pad the ends)."""
    if kernel <= 1:
        return x
    b, H, n = x.shape
    flat = x.reshape(b * H, 1, n)
    if pooling == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=count_include_pad)
    else:
        raise ValueError(f"unknown pooling {pooling!r}")
    return out.reshape(b, H, n)


REDUNDANCY_BLOCK_BYTES = 32 << 20  # fp32 similarity rows held at a time by key_redundancy


def key_redundancy(keys: torch.Tensor, threshold: float = 0.5,
                   block_bytes: int = REDUNDANCY_BLOCK_BYTES) -> torch.Tensor:
    """R-KV redundancy, computed per request (the reference code uses batch row 0 for every row).

    keys [b, H, n, D] -> [b, H, n]. Cosine similarity between keys with a zero diagonal; in each row i the
    most recent j with similarity > threshold is spared (set to 0); then softmax over j of the row mean.
    A row with no similar key spares column 0, as the reference does. Rows are taken in blocks of about
    `block_bytes` of similarities, so the [n, n] matrix (512 MiB for two heads at n = 8192) never exists at
    once; 2.2x faster than the whole matrix at n = 8192 on one CPU core (benchmarks/probes/key_redundancy.py).
    """
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    b, H, n, _ = k.shape
    kt = k.transpose(-1, -2)
    # Column indices in the narrowest integer type that holds them: the last similar column of a row is the largest
    # index its mask keeps (0 when none), and a bool mask times int16 indices is ~4x cheaper than torch.where over
    # fp32 (5.6 vs 23 ms at [64, 2, 288, 288], 2 threads; the same indices).
    cols = torch.arange(n, device=k.device, dtype=torch.int16 if n <= torch.iinfo(torch.int16).max else torch.int32)
    colsum = k.new_zeros(b, H, n)
    rows = max(1, block_bytes // (k.element_size() * b * H * n))
    for r0 in range(0, n, rows):
        sim = k[:, :, r0:r0 + rows] @ kt  # [b, H, m, n]
        i = torch.arange(sim.shape[2], device=k.device)
        sim[:, :, i, i + r0] = 0.0
        last_similar = ((sim > threshold) * cols).amax(dim=-1).long()  # [b, H, m]
        sim.scatter_(-1, last_similar[..., None], 0.0)
        colsum += sim.sum(dim=-2)
    return torch.softmax(colsum / n, dim=-1)


def protect_and_select(scores: torch.Tensor, budget: int, window: int, sink: int) -> torch.Tensor:
    """Keep indices [b, H, budget], ascending: the first `sink` and last `window` tokens always, the rest by score.

    scores [b, H, n] with n > budget >= window + sink.
    """
    n = scores.shape[-1]
    s = scores.float().clone()
    s[..., n - window:] = float("inf")
    s[..., :sink] = float("inf")
    # A stable sort, not topk: max-pooling makes exact ties common, and topk's tie order is unspecified,
    # which would let a batch and its single runs keep different tokens. Ties go to the older token.
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :budget]
    return order.sort(dim=-1).values
