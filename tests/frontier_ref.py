"""Naive references (loops over rows, heads, tokens and dims; no tensor tricks) for the 2026-frontier policies:
CriticalKV, CriticalAdaKV, DefensiveKV, Layer-DefensiveKV, Expected Attention, TriAttention. Used by
tests/test_frontier_scoring.py (the scoring functions) and tests/test_frontier_policies.py (what each policy
keeps, recomputed from the observation the engine handed it).
"""

from __future__ import annotations

import cmath
import math

import torch


# ------------------------------------------------------------------------------------------ shared pieces
def softmax(row: list[float]) -> list[float]:
    m = max(x for x in row if x != float("-inf"))
    e = [math.exp(x - m) if x != float("-inf") else 0.0 for x in row]
    return [x / sum(e) for x in e]


def ranked(scores: list[float], idx: list[int]) -> list[int]:
    """idx sorted by score, highest first, ties to the smaller index."""
    return sorted(idx, key=lambda j: (-scores[j], j))


def window_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> list[list[float]]:
    """One query head: q [w, D] (the tokens of the last w keys), k [n, D] -> w rows of the causal softmax."""
    w, n = q.shape[0], k.shape[0]
    rows = []
    for i in range(w):
        row = [float(q[i] @ k[j]) * scale if j <= n - w + i else float("-inf") for j in range(n)]
        rows.append(softmax(row))
    return rows


def snap_paper(queries: torch.Tensor, keys: torch.Tensor, h: int, w: int, kernel: int) -> list[float]:
    """SnapKV's own scores (variant paper, GQA logits averaged per group, avg pooling counting padding) of kv
    head h's n - w candidates. queries [Hq, >=w, D], keys [H, n, D] (one row)."""
    Hq, H, n, D = queries.shape[0], keys.shape[0], keys.shape[1], keys.shape[2]
    G = Hq // H
    q = queries[:, -w:]
    imp = [0.0] * (n - w)
    for i in range(w):
        row = []
        for j in range(n):
            if j > n - w + i:
                row.append(float("-inf"))
                continue
            row.append(sum(float(q[h * G + g, i] @ keys[h, j]) for g in range(G)) / G / math.sqrt(D))
        p = softmax(row)
        for j in range(n - w):
            imp[j] += p[j] / w
    r = kernel // 2
    return [sum(imp[t] for t in range(j - r, j + r + 1) if 0 <= t < n - w) / kernel for j in range(n - w)]


def proj_l1(values: torch.Tensor, o_weight: torch.Tensor, h: int, G: int) -> list[float]:
    """||W_o v||_1 of kv head h's tokens, averaged over its G query heads. values [H, n, D], o_weight [E, Hq*D]."""
    n, D = values.shape[1], values.shape[2]
    V, W = values[h].tolist(), o_weight.tolist()  # plain floats: the loops below index them
    out = []
    for j in range(n):
        tot = 0.0
        for g in range(G):
            c = (h * G + g) * D
            tot += sum(abs(sum(V[j][d] * row[c + d] for d in range(D))) for row in W)
        out.append(tot / G)
    return out


def two_stage(first: list[float], second: list[float], keep: int, k1: int) -> list[int]:
    m = len(first)
    chosen = ranked(first, list(range(m)))[: min(max(k1, 0), keep)]
    rest = [j for j in range(m) if j not in chosen]
    chosen += ranked(second, rest)[: keep - len(chosen)]
    return sorted(chosen)


# ------------------------------------------------------------------------------------------ DefensiveKV
def defensive_head(queries: torch.Tensor, keys: torch.Tensor, h: int, w: int, kernel: int, scale: float):
    """(defensive [n - w], mean attention [n - w], the window's mass on itself summed over queries and the group's
    heads, count of those rows) for kv head h. queries [Hq, w, D], keys [H, n, D]."""
    Hq, H, n = queries.shape[0], keys.shape[0], keys.shape[1]
    G = Hq // H
    peak = [0.0] * (n - w)
    mean = [0.0] * (n - w)
    self_mass = 0.0
    r = kernel // 2
    for g in range(G):
        for row in window_probs(queries[h * G + g], keys[h], scale):
            cand = row[: n - w]
            pooled = [sum(cand[t] for t in range(j - r, j + r + 1) if 0 <= t < n - w) / kernel for j in range(n - w)]
            pooled = [x / sum(pooled) * sum(cand) for x in pooled]
            for j in range(n - w):
                peak[j] = max(peak[j], pooled[j])
                mean[j] += cand[j] / (G * w)
            self_mass += sum(row[n - w:])
    avg = sum(peak) / len(peak)
    return [max(x, avg) for x in peak], mean, self_mass, G * w


def defensive_layer(queries, keys, values, o_weight, w, sink, kernel, threshold, head_keep, scale) -> list[list[float]]:
    """DefensiveKV's scores of every kv head of one layer, full length n (protected entries 0)."""
    Hq, H, n = queries.shape[0], keys.shape[0], keys.shape[1]
    G = Hq // H
    heads = [defensive_head(queries, keys, h, w, kernel, scale) for h in range(H)]
    mass = sum(x[2] for x in heads) / sum(x[3] for x in heads)
    proj = [proj_l1(values, o_weight, h, G)[: n - w] for h in range(H)]
    s = [[heads[h][0][j] * proj[h][j] / sum(proj[x][j] for x in range(H)) for j in range(n - w)] for h in range(H)]
    top = max(max(row) for row in s)
    out = []
    for h in range(H):
        att = heads[h][1][sink:]
        order = ranked(att, list(range(len(att))))
        total, count = sum(att), 0
        cum = 0.0
        for c, j in enumerate(order):
            cum += att[j] / total
            if cum >= threshold - mass:
                count = c
                break
        row = list(s[h])
        for j in order[: max(0, min(count, head_keep - w - sink))]:
            row[j + sink] = top
        out.append([0.0] * sink + row[sink:] + [0.0] * w)
    return out


def global_topk(scores: list[list[float]], total: int, sink: int, w: int, floor: int) -> list[list[int]]:
    """One top-k over units: each keeps sink, window and `floor` best; the rest by score (ties: lower unit, older)."""
    kept, pool = [], []
    for u, s in enumerate(scores):
        n = len(s)
        cand = ranked(s, list(range(sink, n - w)))
        extra = max(floor - sink - w, 0)
        kept.append(set(range(sink)) | set(range(n - w, n)) | set(cand[:extra]))
        pool += [(-s[j], u, j) for j in cand[extra:]]
    for _, u, j in sorted(pool)[: total - sum(len(k) for k in kept)]:
        kept[u].add(j)
    return [sorted(k) for k in kept]


# ------------------------------------------------------------------------------------------ RoPE, Expected Attention
def rope_pair(x: list[float], pos: float, inv_freq: list[float], sign: float = 1.0) -> list[float]:
    """Rotate (sign 1) or rotate back (sign -1) one vector, pair by pair: dims f and f + D/2."""
    F = len(inv_freq)
    out = list(x)
    for f in range(F):
        a = sign * pos * inv_freq[f]
        out[f] = x[f] * math.cos(a) - x[f + F] * math.sin(a)
        out[f + F] = x[f + F] * math.cos(a) + x[f] * math.sin(a)
    return out


def expected_scores(queries_pre: torch.Tensor, keys: torch.Tensor, inv_freq: list[float], start: int, count: int,
                    scale: float, covariance: bool = True) -> list[list[float]]:
    """One row: queries_pre [Hq, w, D] pre-RoPE, keys [H, n, D] post-RoPE -> [H][n] expected attention, the
    Gaussian's moments taken over the rotations R(t) mu and R(t) Sigma R(t)^T averaged as matrices."""
    Hq, w, D = queries_pre.shape
    H, n = keys.shape[0], keys.shape[1]
    G = Hq // H
    # The average rotation, column by column: R_avg e_c = mean_t R(t) e_c.
    R = [[0.0] * D for _ in range(D)]
    for c in range(D):
        e = [1.0 if d == c else 0.0 for d in range(D)]
        for t in range(start, start + count):
            col = rope_pair(e, t, inv_freq)
            for d in range(D):
                R[d][c] += col[d] / count
    out = [[0.0] * n for _ in range(H)]
    for hq in range(Hq):
        q = [[float(x) for x in queries_pre[hq, i]] for i in range(w)]
        mu = [sum(q[i][d] for i in range(w)) / w for d in range(D)]
        S = [[sum((q[i][a] - mu[a]) * (q[i][c] - mu[c]) for i in range(w)) / w for c in range(D)] for a in range(D)]
        mu2 = [sum(R[a][c] * mu[c] for c in range(D)) for a in range(D)]
        S2 = [[sum(R[a][x] * S[x][y] * R[c][y] for x in range(D) for y in range(D)) for c in range(D)]
              for a in range(D)]
        h = hq // G
        logits = []
        for j in range(n):
            k = [float(x) for x in keys[h, j]]
            v = scale * sum(mu2[d] * k[d] for d in range(D))
            if covariance:
                v += scale * scale / 2 * sum(k[a] * S2[a][c] * k[c] for a in range(D) for c in range(D))
            logits.append(v)
        for j, p in enumerate(softmax(logits)):
            out[h][j] += p / G
    return out


# ------------------------------------------------------------------------------------------ TriAttention
def trig_head(k_pre: list[float], p: int, t: int, q_mean: list[complex], q_abs: list[float], inv_freq: list[float],
              offsets: list[float], scaling: float = 1.0) -> float:
    """TriAttention's score of one pre-RoPE key at position p for one query head, the mean over the offsets taken
    term by term (unfolded)."""
    F = len(inv_freq)
    kc = [complex(k_pre[f], k_pre[f + F]) for f in range(F)]
    tot = 0.0
    for d in offsets:
        for f in range(F):
            phi = cmath.phase(q_mean[f] * kc[f].conjugate())
            tot += abs(q_mean[f]) * abs(kc[f]) * math.cos((t - p + d) * inv_freq[f] + phi) / len(offsets)
    extra = sum((q_abs[f] - abs(q_mean[f])) * abs(kc[f]) for f in range(F))
    return (tot + extra) * scaling * scaling


# ------------------------------------------------------------------------------------------ KVzip
def kvzip_scores(q: torch.Tensor, k: torch.Tensor, P: int, scale: float) -> list[list[float]]:
    """One layer of one causal forward over the prompt (P tokens) followed by a reconstruction input: q [Hq, N, D]
    every post-RoPE query, k [H, N, D] every key. For kv head h and prompt entry j: the max, over the
    reconstruction's queries (positions P..N-1) and the G query heads of h, of its causal softmax probability."""
    Hq, N = q.shape[0], q.shape[1]
    H = k.shape[0]
    G = Hq // H
    Q, K = q.tolist(), k.tolist()  # plain floats: the loops below index them
    out = [[0.0] * P for _ in range(H)]
    for h in range(H):
        for g in range(G):
            for t in range(P, N):
                row = [sum(a * b for a, b in zip(Q[h * G + g][t], K[h][j])) * scale for j in range(t + 1)]
                p = softmax(row)
                for j in range(P):
                    out[h][j] = max(out[h][j], p[j])
    return out
