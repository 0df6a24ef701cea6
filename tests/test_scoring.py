"""Every scoring function against a naive loop reference on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from skipkv.scoring import key_redundancy, pool1d, protect_and_select, window_importance, window_logits

torch.manual_seed(0)


def ref_window_logits(q, k, reduce):
    b, Hq, w, D = q.shape
    H, n = k.shape[1], k.shape[2]
    G = Hq // H
    out = torch.zeros(b, H, w, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(H):
            for i in range(w):
                for j in range(n):
                    vals = [float(q[bi, h * G + g, i] @ k[bi, h, j]) / math.sqrt(D) for g in range(G)]
                    out[bi, h, i, j] = max(vals) if reduce == "max" else sum(vals) / G
    return out


def ref_pool(x, kernel, pooling):
    b, H, n = x.shape
    out = torch.zeros_like(x)
    r = kernel // 2
    for bi in range(b):
        for h in range(H):
            for j in range(n):
                win = [float(x[bi, h, t]) for t in range(max(0, j - r), min(n, j + r + 1))]
                out[bi, h, j] = max(win) if pooling == "max" else sum(win) / len(win)
    return out


def ref_importance(q, k, kernel, pooling, reduce):
    logits = ref_window_logits(q, k, reduce)
    b, H, w, n = logits.shape
    probs = torch.zeros(b, H, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(H):
            for i in range(w):
                row = [math.exp(float(x)) for x in logits[bi, h, i]]
                s = sum(row)
                for j in range(n):
                    probs[bi, h, j] += row[j] / s / w
    return ref_pool(probs, kernel, pooling)


def ref_redundancy(k, thr):
    b, H, n, D = k.shape
    out = torch.zeros(b, H, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(H):
            keys = [k[bi, h, j].double() / (k[bi, h, j].double().norm() + 1e-8) for j in range(n)]
            S = [[0.0 if i == j else float(keys[i] @ keys[j]) for j in range(n)] for i in range(n)]
            for i in range(n):
                last = 0
                for j in range(n):
                    if S[i][j] > thr:
                        last = j
                S[i][last] = 0.0
            means = [sum(S[i][j] for i in range(n)) / n for j in range(n)]
            z = sum(math.exp(m) for m in means)
            for j in range(n):
                out[bi, h, j] = math.exp(means[j]) / z
    return out


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_window_logits(reduce):
    q, k = torch.randn(2, 4, 3, 5), torch.randn(2, 2, 7, 5)
    torch.testing.assert_close(window_logits(q, k, reduce).double(), ref_window_logits(q, k, reduce),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_pool1d(kernel, pooling):
    x = torch.randn(2, 3, 9, dtype=torch.float64)
    torch.testing.assert_close(pool1d(x, kernel, pooling), ref_pool(x, kernel, pooling) if kernel > 1 else x)


def test_window_importance():
    q, k = torch.randn(2, 4, 3, 5), torch.randn(2, 2, 11, 5)
    torch.testing.assert_close(window_importance(q, k, 7, "max", "max").double(), ref_importance(q, k, 7, "max", "max"),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_bytes", [1, 3 * 2 * 8 * 4 * 3, 1 << 20])  # one row, 3 rows (a ragged last block), all
def test_key_redundancy_per_request(block_bytes):
    k = torch.randn(3, 2, 8, 4)
    k[1, :, 5] = k[1, :, 2] * 2  # a near-duplicate pair in row 1 only
    k[2, :, 7] = k[2, :, 1]  # and one whose rows fall in different blocks
    got = key_redundancy(k, 0.5, block_bytes).double()
    torch.testing.assert_close(got, ref_redundancy(k, 0.5), atol=1e-6, rtol=1e-5)
    # Rows differ: redundancy is not broadcast from row 0 (the reference code's bug).
    assert not torch.allclose(got[0], got[1])


def test_protect_and_select_keeps_sink_and_window():
    scores = torch.randn(2, 3, 20)
    keep = protect_and_select(scores, budget=8, window=3, sink=2)
    assert keep.shape == (2, 3, 8)
    for row in keep.reshape(-1, 8).tolist():
        assert row == sorted(row)
        assert {0, 1, 17, 18, 19} <= set(row)
    # The remaining 3 are the best-scoring middle tokens (naive reference).
    for bi in range(2):
        for h in range(3):
            mid = sorted(range(2, 17), key=lambda j: -float(scores[bi, h, j]))[:3]
            assert set(keep[bi, h].tolist()) == {0, 1, 17, 18, 19, *mid}


def test_select_ties_are_deterministic():
    scores = torch.zeros(1, 1, 10)
    assert protect_and_select(scores, 4, 1, 0).tolist() == [[[0, 1, 2, 9]]]


def ref_group_probs(q, k, causal):
    """kvpress's SnapKVPress / Ada-KV GQA scores, naively: every query head's softmax over the keys (the last w
    keys causal to the w queries when `causal`), averaged over the w queries and then over the G heads of a group."""
    b, Hq, w, D = q.shape
    H, n = k.shape[1], k.shape[2]
    G = Hq // H
    out = torch.zeros(b, H, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(H):
            for g in range(G):
                for i in range(w):
                    row = [float(q[bi, h * G + g, i] @ k[bi, h, j]) / math.sqrt(D) for j in range(n)]
                    e = [0.0 if causal and j - (n - w) > i else math.exp(x) for j, x in enumerate(row)]
                    for j in range(n):
                        out[bi, h, j] += e[j] / sum(e) / w / G
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_group_probs_average_each_query_heads_softmax(causal):
    from skipkv.scoring import causal_window_importance

    q, k = torch.randn(2, 6, 4, 8) * 3, torch.randn(2, 2, 11, 8) * 3  # G = 3, peaked enough to tell them apart
    want = ref_group_probs(q, k, causal)
    if causal:
        got = causal_window_importance(q, k, "probs")
        want = want[..., : 11 - 4]
        mean = causal_window_importance(q, k, "mean")
    else:
        got = window_importance(q, k, 1, "max", "probs")
        mean = window_importance(q, k, 1, "max", "mean")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(mean.double(), want, rtol=1e-3, atol=1e-4)  # the logits' mean is another score
