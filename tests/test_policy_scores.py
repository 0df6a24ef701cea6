"""Each policy's `score`/`select` against naive loops on tiny tensors, and the store's per-entry accumulators
(aux "attn") through appends, compaction and slot moves against a naive per-slot list."""

from __future__ import annotations

import math

import pytest
import torch

from skipkv import make_policy
from skipkv.cache import KVStore
from skipkv.errors import SkipKVError
from skipkv.policies.base import Observation
from skipkv.scoring import causal_window_importance, pool1d

b, Hq, H, D = 2, 4, 2, 5
G = Hq // H


def observation(n: int, w: int, is_prefill: bool = False, seed: int = 0, attn: bool = False) -> Observation:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, H, n, D, generator=g, dtype=torch.float64) * 2
    keys[1, :, 6] = keys[1, :, 3] * 1.5  # a near-duplicate in row 1 only (redundancy must be per row)
    queries = torch.randn(b, Hq, w, D, generator=g, dtype=torch.float64) * 2
    return Observation(layer=0, keys=keys, values=keys.clone(),
                       positions=torch.arange(n, dtype=torch.int32).expand(b, H, n), queries=queries,
                       attn=torch.rand(b, H, n, generator=g, dtype=torch.float64) if attn else None,
                       module=torch.nn.Identity(), is_prefill=is_prefill)


# ------------------------------------------------------------------------------------------ naive pieces
def logits(obs: Observation, bi: int, h: int, qs: range, ks: range, reduce: str = "max") -> list[list[float]]:
    out = []
    for i in qs:
        row = []
        for j in ks:
            vals = [float(obs.queries[bi, h * G + g, i] @ obs.keys[bi, h, j]) / math.sqrt(D) for g in range(G)]
            row.append(max(vals) if reduce == "max" else sum(vals) / G)
        out.append(row)
    return out


def softmax(row: list[float]) -> list[float]:
    e = [math.exp(x) if x != float("-inf") else 0.0 for x in row]
    return [x / sum(e) for x in e]


def pool(x: list[float], kernel: int, how: str, count_pad: bool = False) -> list[float]:
    r = kernel // 2
    out = []
    for j in range(len(x)):
        win = [x[t] for t in range(j - r, j + r + 1) if 0 <= t < len(x)]
        out.append(max(win) if how == "max" else sum(win) / (kernel if count_pad else len(win)))
    return out


def redundancy(obs: Observation, bi: int, h: int, thr: float) -> list[float]:
    n = obs.keys.shape[2]
    k = [obs.keys[bi, h, j] / (obs.keys[bi, h, j].norm() + 1e-8) for j in range(n)]
    S = [[0.0 if i == j else float(k[i] @ k[j]) for j in range(n)] for i in range(n)]
    for i in range(n):
        last = max([j for j in range(n) if S[i][j] > thr], default=0)
        S[i][last] = 0.0
    return softmax([sum(S[i][j] for i in range(n)) / n for j in range(n)])


def naive_select(scores: list[float], budget: int, window: int, sink: int) -> list[int]:
    n = len(scores)
    middle = sorted(range(sink, n - window), key=lambda j: (-scores[j], j))[: budget - window - sink]
    return sorted([*range(sink), *middle, *range(n - window, n)])


# ------------------------------------------------------------------------------------------ policies
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_rkv_score(kernel):
    pol = make_policy("rkv", budget=10, window=3, kernel=kernel, mix_lambda=0.3, threshold=0.4)
    n, w = 14, 3
    obs = observation(n, w)
    got = pol.score(obs)
    for bi in range(b):
        for h in range(H):
            rows = logits(obs, bi, h, range(w), range(n - w))
            imp = [sum(softmax(r)[j] for r in rows) / w for j in range(n - w)]
            imp = pool(imp, kernel, "max")
            red = redundancy(obs, bi, h, 0.4)
            want = [0.3 * imp[j] - 0.7 * red[j] for j in range(n - w)]
            torch.testing.assert_close(got[bi, h, : n - w].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-7)
            keep = pol.select(obs)[bi, h].tolist()
            assert keep == naive_select(got[bi, h].tolist(), 10, w, 0)


@pytest.mark.parametrize("variant,pooling", [("rkv", "auto"), ("rkv", "avg"), ("paper", "auto"), ("paper", "max")])
@pytest.mark.parametrize("is_prefill", [False, True])
def test_snapkv_score(variant, pooling, is_prefill):
    pol = make_policy("snapkv", budget=12, window=2, prefill_window=4, kernel=5, variant=variant, pooling=pooling,
                      group_reduce="mean" if is_prefill else "max")
    n = 15
    w = 4 if is_prefill else 2
    obs = observation(n, 4, is_prefill=is_prefill, seed=1)  # the buffer holds 4 queries; decode uses the newest 2
    got = pol.score(obs)
    how = pooling if pooling != "auto" else ("avg" if variant == "paper" else "max")
    for bi in range(b):
        for h in range(H):
            qs = range(4 - w, 4)
            if variant == "paper":
                # SnapKV's code: the window queries see every key, the window's own keys causally.
                rows = logits(obs, bi, h, qs, range(n), pol.group_reduce)
                rows = [[x if j < n - w or j - (n - w) <= i else float("-inf") for j, x in enumerate(r)]
                        for i, r in enumerate(rows)]
                imp = [sum(softmax(r)[j] for r in rows) / w for j in range(n - w)]
                imp = pool(imp, 5, how, count_pad=True)
            else:
                rows = logits(obs, bi, h, qs, range(n - w), pol.group_reduce)
                imp = pool([sum(softmax(r)[j] for r in rows) / w for j in range(n - w)], 5, how)
            torch.testing.assert_close(got[bi, h, : n - w].double(), torch.tensor(imp, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-8)
            assert pol.select(obs)[bi, h].tolist() == naive_select(got[bi, h].tolist(), 12, w, 0)


def test_snapkv_variants_differ():
    obs = observation(15, 2, seed=2)
    a = make_policy("snapkv", budget=12, window=2, prefill_window=4).score(obs)
    p = make_policy("snapkv", budget=12, window=2, prefill_window=4, variant="paper").score(obs)
    assert not torch.allclose(a, p)


@pytest.mark.parametrize("recent_ratio,window,sink", [(0.0, 3, 0), (0.5, 3, 0), (0.5, 2, 2), (0.25, 4, 1)])
def test_h2o_accumulated_select(recent_ratio, window, sink):
    pol = make_policy("h2o", budget=12, window=window, sink=sink, recent_ratio=recent_ratio)
    n = 20
    obs = observation(n, 1, attn=True)
    recent = max(window, int(recent_ratio * (12 - sink)))  # the share is of the budget beyond the sink
    assert pol.recent == recent
    keep = pol.select(obs)
    for bi in range(b):
        for h in range(H):
            assert keep[bi, h].tolist() == naive_select(obs.attn[bi, h].tolist(), 12, recent, sink)


def test_h2o_last_query_score():
    pol = make_policy("h2o", budget=10, window=1, variant="last_query", recent_ratio=0.0)
    n = 16
    obs = observation(n, 1, seed=3)
    got = pol.score(obs)
    for bi in range(b):
        for h in range(H):
            want = softmax(logits(obs, bi, h, range(1), range(n))[0])
            torch.testing.assert_close(got[bi, h].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-8)
            assert pol.select(obs)[bi, h].tolist() == naive_select(want, 10, 1, 0)


def test_streaming_llm_select():
    pol = make_policy("streaming_llm", budget=9, sink=3, interval=4)
    keep = pol.select(observation(20, 1))
    assert keep.tolist() == [[[0, 1, 2, *range(14, 20)]] * H] * b


def test_new_knobs_are_validated():
    with pytest.raises(SkipKVError, match="variant"):
        make_policy("snapkv", variant="exact")
    with pytest.raises(SkipKVError, match="recent_ratio"):
        make_policy("h2o", recent_ratio=1.0)
    # The recent set max(window, recent_ratio x (budget - sink)) plus the sink is below the budget whenever the
    # shared rule (budget > window + sink) holds, so that rule is the one that refuses.
    with pytest.raises(SkipKVError, match="budget .16. must exceed window . sink"):
        make_policy("h2o", budget=16, window=4, sink=12, recent_ratio=0.5)


# ------------------------------------------------------------------------------------------ scoring pieces
@pytest.mark.parametrize("kernel", [3, 5, 7])
def test_pool1d_counting_padding(kernel):
    x = torch.rand(2, 3, 9, dtype=torch.float64)
    got = pool1d(x, kernel, "avg", count_include_pad=True)
    for bi in range(2):
        for h in range(3):
            want = pool(x[bi, h].tolist(), kernel, "avg", count_pad=True)
            torch.testing.assert_close(got[bi, h], torch.tensor(want, dtype=torch.float64))


def test_causal_window_importance():
    obs = observation(11, 3, seed=4)
    got = causal_window_importance(obs.queries, obs.keys, "max")
    n, w = 11, 3
    assert got.shape == (b, H, n - w)
    for bi in range(b):
        for h in range(H):
            rows = logits(obs, bi, h, range(w), range(n))
            rows = [[x if j < n - w or j - (n - w) <= i else float("-inf") for j, x in enumerate(r)]
                    for i, r in enumerate(rows)]
            want = [sum(softmax(r)[j] for r in rows) / w for j in range(n - w)]
            torch.testing.assert_close(got[bi, h].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------------------------ store accumulators
def test_store_accumulators_follow_entries_through_compaction_and_moves():
    """aux "attn" of every entry against a naive list of (position, key, attn) per (layer, slot, head)."""
    torch.manual_seed(0)
    L, S = 2, 3
    store = KVStore(L, S, H, D, capacity=12, dtype=torch.float64, aux=("attn",))
    ref = {(l, s, h): [] for l in range(L) for s in range(S) for h in range(H)}

    def check():
        for (l, s, h), lst in ref.items():
            n = int(store.lengths[l, s])
            got = [(int(store.pos[l][s, h, j]), store.k[l][s, h, j].tolist(), float(store.aux["attn"][l][s, h, j]))
                   for j in range(n)]
            assert [(p, k) for p, k, _ in got] == [(p, k) for p, k, _ in lst], (l, s, h)
            assert [a for *_, a in got] == pytest.approx([a for *_, a in lst]), (l, s, h)

    def add_attn(slots: list[int]):  # every entry of these slots receives a distinct amount
        for s in slots:
            for l in range(L):
                for h in range(H):
                    for j, (p, k, a) in enumerate(ref[(l, s, h)]):
                        extra = 0.01 * (p + 1) + 0.1 * l + 0.001 * h + s
                        ref[(l, s, h)][j] = (p, k, a + extra)
                        store.aux["attn"][l][s, h, j] += extra

    def append(start: int, real: list[int], T: int, first_pos: list[int]):
        k = torch.randn(len(real), H, T, D, dtype=torch.float64)
        pos = torch.tensor(first_pos)[:, None] + torch.arange(T)
        for l in range(L):
            store.append(l, start, k, k.clone(), pos)
        store.advance(start, torch.tensor(real))
        for i, r in enumerate(real):
            for l in range(L):
                for h in range(H):
                    ref[(l, start + i, h)] += [(int(pos[i, t]), k[i, h, t].tolist(), 0.0) for t in range(r)]

    append(0, [4, 6, 3], 6, [0, 0, 0])
    add_attn([0, 1, 2])
    check()
    # compact slot 1 (layer 0 and 1 keep different entries; heads differ too)
    keeps = [torch.tensor([[[0, 2, 5], [1, 3, 4]]]), torch.tensor([[[3, 4, 5], [0, 1, 5]]])]
    for l, keep in enumerate(keeps):
        store.compact(l, torch.tensor([1]), keep)
        for h in range(H):
            ref[(l, 1, h)] = [ref[(l, 1, h)][j] for j in keep[0, h].tolist()]
    check()
    append(0, [1, 1, 1], 1, [4, 6, 3])
    add_attn([0, 1, 2])
    check()
    # slot 0 finishes: the last slot moves into it, accumulators and positions with it
    store.move(2, 0)
    for l in range(L):
        for h in range(H):
            ref[(l, 0, h)], ref[(l, 2, h)] = ref[(l, 2, h)], []
    check()
    assert all((a[2] == 0).all() for a in store.aux["attn"])
    # a new request in slot 2 must not inherit anything from the previous occupant
    append(2, [5], 5, [0])
    add_attn([0, 1, 2])
    check()
    # compact both remaining slots at once, rows keeping different entries
    keep = torch.tensor([[[0, 2, 3], [1, 2, 3]], [[0, 1, 2], [0, 1, 3]]])
    store.compact(0, torch.tensor([0, 1]), keep)
    for i, s in enumerate([0, 1]):
        for h in range(H):
            ref[(0, s, h)] = [ref[(0, s, h)][j] for j in keep[i, h].tolist()]
    check()
