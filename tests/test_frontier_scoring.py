"""The 2026-frontier scoring functions (scoring/critical.py, expected.py, trig.py, rope.py; models/rope.py) against
naive loops (tests/frontier_ref.py) on tiny tensors.

    python -m pytest tests/test_frontier_scoring.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

import frontier_ref as ref
from skipkv.models import load_model
from skipkv.models.rope import rope_frequencies
from skipkv.scoring.critical import (
    causal_window_attention,
    defensive_scores,
    mass_prefix,
    projected_value_norm,
    two_stage_keep,
)
from skipkv.scoring.expected import average_rotation, expected_attention, query_statistics
from skipkv.scoring.rope import rope_cos_sin, rotate, unrotate
from skipkv.scoring.trig import geometric_offsets, trig_scores

b, Hq, H, D, E = 2, 4, 2, 6, 5
G = Hq // H


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def test_projected_value_norm():
    values, W = rand(b, H, 7, D, seed=1), rand(E, Hq * D, seed=2)
    got = projected_value_norm(values, W)
    for bi in range(b):
        for h in range(H):
            torch.testing.assert_close(got[bi, h], torch.tensor(ref.proj_l1(values[bi], W, h, G), dtype=torch.float64))
    # one kv head of a head-split store: its values and its query heads' o_proj columns
    one = projected_value_norm(values[:, 1:2], W[:, G * D:])
    torch.testing.assert_close(one[:, 0], got[:, 1])


@pytest.mark.parametrize("keep,k1", [(5, 2), (5, 0), (5, 5), (9, 3)])
def test_two_stage_keep(keep, k1):
    first = torch.tensor([3.0, 1.0, 3.0, 0.5, 2.0, 0.1, 4.0, 1.0, 0.0])
    second = torch.tensor([0.0, 9.0, 1.0, 8.0, 2.0, 7.0, 0.0, 9.0, 3.0])
    want = ref.two_stage(first.tolist(), second.tolist(), keep, k1)
    assert two_stage_keep(first, second, keep, k1).tolist() == want


def test_causal_window_attention_and_defensive_scores():
    n, w, kernel = 11, 3, 3
    q, k = rand(b, Hq, w, D, seed=3, scale=2), rand(b, H, n, D, seed=4, scale=2)
    A = causal_window_attention(q, k, 0.4)
    for bi in range(b):
        for h in range(H):
            for g in range(G):
                want = ref.window_probs(q[bi, h * G + g], k[bi, h], 0.4)
                torch.testing.assert_close(A[bi, h, g], torch.tensor(want, dtype=torch.float64))
    defensive, mean, mass = defensive_scores(A, kernel)
    for bi in range(b):
        tot, rows = 0.0, 0
        for h in range(H):
            d, m, s, c = ref.defensive_head(q[bi], k[bi], h, w, kernel, 0.4)
            torch.testing.assert_close(defensive[bi, h], torch.tensor(d, dtype=torch.float64))
            torch.testing.assert_close(mean[bi, h], torch.tensor(m, dtype=torch.float64))
            tot, rows = tot + s, rows + c
        assert math.isclose(float(mass[bi]), tot / rows, rel_tol=1e-9)


@pytest.mark.parametrize("threshold,cap", [(0.5, 10), (0.9, 10), (0.9, 2), (0.0, 10), (1.5, 10)])
def test_mass_prefix(threshold, cap):
    attn = torch.tensor([0.05, 0.4, 0.05, 0.2, 0.1, 0.2], dtype=torch.float64)
    order = ref.ranked(attn.tolist(), list(range(6)))
    cum, count = 0.0, 0
    for c, j in enumerate(order):
        cum += float(attn[j]) / float(attn.sum())
        if cum >= threshold:
            count = c
            break
    assert mass_prefix(attn, threshold, cap).tolist() == order[: min(count, cap)]


def test_rope_matches_the_models_rotary_embedding():
    """rope_frequencies + rotate reproduce transformers' RoPE on the tiny model; unrotate inverts it."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    bundle = load_model("random:qwen2", dtype="fp64")
    inv_freq, scaling = rope_frequencies(bundle.model.config)
    torch.testing.assert_close(inv_freq.float(), bundle.model.model.rotary_emb.inv_freq.float())
    x = rand(1, 4, 9, 16, seed=5)
    pos = torch.arange(3, 12)[None]
    cos_hf, sin_hf = bundle.model.model.rotary_emb(x, pos)
    want, _ = apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(inv_freq, pos, scaling)
    got = rotate(x, cos[:, None], sin[:, None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # transformers' inv_freq is fp32, ours fp64
    torch.testing.assert_close(unrotate(got, cos[:, None], sin[:, None], scaling), x)
    # pair by pair, as the naive reference rotates
    torch.testing.assert_close(got[0, 1, 2], torch.tensor(ref.rope_pair(x[0, 1, 2].tolist(), 5, inv_freq.tolist()),
                                                        dtype=torch.float64))


def test_query_statistics_average_rotation_and_expected_attention():
    n, w = 8, 5
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    q_pre, keys = rand(b, Hq, w, D, seed=6), rand(b, H, n, D, seed=7)
    mean, cov = query_statistics(q_pre)
    R = average_rotation(inv_freq, 20, 7)
    for covariance in (True, False):
        got = expected_attention(mean @ R.T, R @ cov @ R.T if covariance else None, keys, 0.5)
        for bi in range(b):
            want = ref.expected_scores(q_pre[bi], keys[bi], inv_freq.tolist(), 20, 7, 0.5, covariance)
            torch.testing.assert_close(got[bi], torch.tensor(want, dtype=torch.float64))


def test_trig_scores():
    n, F = 7, D // 2
    inv_freq = 1.0 / (50.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    keys_pre = rand(b, H, n, D, seed=8)
    pos = torch.randint(0, 40, (b, H, n), generator=torch.Generator().manual_seed(9))
    q_mean = torch.complex(rand(Hq, F, seed=10), rand(Hq, F, seed=11))
    q_abs = q_mean.abs() + rand(Hq, F, seed=12).abs()
    start = torch.tensor([45, 50])
    offsets = geometric_offsets(100)
    assert offsets.tolist() == [1, 2, 4, 8, 16, 32, 64]
    got = trig_scores(keys_pre, pos, start, q_mean, q_abs, inv_freq, offsets, scaling=1.3)
    for bi in range(b):
        for hq in range(Hq):
            for j in range(n):
                want = ref.trig_head(keys_pre[bi, hq // G, j].tolist(), int(pos[bi, hq // G, j]), int(start[bi]),
                                     q_mean[hq].tolist(), q_abs[hq].tolist(), inv_freq.tolist(), offsets.tolist(), 1.3)
                assert math.isclose(float(got[bi, hq, j]), want, rel_tol=1e-9, abs_tol=1e-9)
