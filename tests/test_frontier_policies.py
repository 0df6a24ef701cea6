"""The 2026-frontier policies on the sharp-attention model: what each kept, at every compression the engine ran,
equals a naive recomputation (tests/frontier_ref.py, loops) from the very observation the policy was handed, and
the compression changes what the model generates (so a wrong score would show in the kept set, and matter).

    python -m pytest tests/test_frontier_policies.py -q
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import frontier_ref as ref
from conftest import calibrated_stats
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.models.rope import rope_frequencies
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation

SHARP = "random:qwen2:sharp"


@pytest.fixture(scope="module")
def sharp():
    return load_model(SHARP, dtype="fp64")


def prompts(*lengths: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def snapshot(o: Observation) -> Observation:
    """A copy of an observation that the store's compaction cannot change (its tensors are views of the store)."""
    return dataclasses.replace(o, keys=o.keys.clone(), values=o.values.clone(), positions=o.positions.clone(),
                               queries=None if o.queries is None else o.queries.clone())


def run_captured(monkeypatch, bundle, policy, ids, max_new: int, batch: int = 1):
    """Generate with `policy`, recording (policy instance, observation(s), keep) at every selection it made."""
    cls = type(policy)
    calls: list = []
    if cls.model_wide:
        original = cls.select_model_wide

        def spy(self, obs):
            snap = [snapshot(o) for o in obs]
            out = original(self, obs)
            calls.append((self, snap, out))
            return out

        monkeypatch.setattr(cls, "select_model_wide", spy)
    else:
        original_select = cls.select

        def spy_select(self, obs):
            snap = snapshot(obs)
            out = original_select(self, obs)
            calls.append((self, snap, out))
            return out

        monkeypatch.setattr(cls, "select", spy_select)
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    results = generate(bundle, ids, sp, policy, EngineConfig(batch_size=batch))
    full = generate(bundle, ids, sp, make_policy("full"))
    assert calls, "the policy never compressed"
    assert any(r.token_ids != f.token_ids for r, f in zip(results, full)), "compression changed nothing"
    return calls


def naive_select(scores: list[float], budget: int, window: int, sink: int) -> list[int]:
    n = len(scores)
    middle = ref.ranked(scores, list(range(sink, n - window)))[: budget - window - sink]
    return sorted([*range(sink), *middle, *range(n - window, n)])


# ------------------------------------------------------------------------------------------ CriticalKV
def critical_keep(pol, o: Observation, bi: int, h: int) -> list[int]:
    Hq, n = o.queries.shape[1], o.keys.shape[2]
    w, sink = pol.prefill_window, pol.sink
    attn = ref.snap_paper(o.queries[bi], o.keys[bi], h, w, pol.kernel)
    proj = ref.proj_l1(o.values[bi], o.module.o_proj.weight.detach(), h, Hq // o.keys.shape[1])
    crit = [(attn[j] + pol.epsilon) * proj[j] for j in range(n - w)]
    k1 = max(0, int(pol.first_stage_ratio * pol.budget) - w - sink)
    chosen = ref.two_stage(attn[sink:], crit[sink:], pol.budget - w - sink, k1)
    return [*range(sink), *(j + sink for j in chosen), *range(n - w, n)]


def test_criticalkv_keeps_the_naive_two_stages(monkeypatch, sharp):
    pol = make_policy("criticalkv", budget=20, prefill_window=6, sink=1, first_stage_ratio=0.6)
    calls = run_captured(monkeypatch, sharp, pol, prompts(60, 47), 6, batch=2)
    for p, o, keep in calls:
        for bi in range(o.keys.shape[0]):
            for h in range(o.keys.shape[1]):
                assert keep[bi, h].tolist() == critical_keep(p, o, bi, h)


def test_criticalkv_ada_allocates_per_head_then_two_stages(monkeypatch, sharp):
    pol = make_policy("criticalkv_ada", budget=20, prefill_window=6, floor_ratio=0.1)
    calls = run_captured(monkeypatch, sharp, pol, prompts(70), 6)
    ragged = 0
    for p, obs, keeps in calls:
        for i in range(0, len(obs), 2):  # two kv heads per layer
            units = obs[i:i + 2]
            n, w = units[0].keys.shape[2], p.prefill_window
            queries, keys = torch.cat([u.queries for u in units], 1)[0], torch.cat([u.keys for u in units], 1)[0]
            attn = [ref.snap_paper(queries, keys, h, w, p.kernel) + [0.0] * w for h in range(2)]
            alloc = ref.global_topk(attn, p.budget * 2, 0, w, p.head_floor())
            for h, u in enumerate(units):
                K = len(alloc[h])
                proj = ref.proj_l1(u.values[0], u.module.o_proj.weight.detach()[:, h * 32:(h + 1) * 32], 0, 2)
                crit = [(attn[h][j] + p.epsilon) * proj[j] for j in range(n - w)]
                chosen = ref.two_stage(attn[h][: n - w], crit, K - w, max(0, int(p.first_stage_ratio * K) - w))
                assert keeps[i + h][0, 0].tolist() == [*chosen, *range(n - w, n)]
            ragged += len(alloc[0]) != len(alloc[1])
    assert ragged, "the heads of a layer should keep different counts"


# ------------------------------------------------------------------------------------------ DefensiveKV
@pytest.mark.parametrize("name", ["defensivekv", "layer_defensivekv"])
def test_defensivekv_keeps_the_naive_selection(monkeypatch, sharp, name):
    pol = make_policy(name, budget=20, prefill_window=6, kernel=3)
    calls = run_captured(monkeypatch, sharp, pol, prompts(64), 6)
    for p, obs, keeps in calls:
        scores = []
        for i in range(0, len(obs), 2):
            units = obs[i:i + 2]
            cat = [torch.cat([getattr(u, a) for u in units], 1)[0] for a in ("queries", "keys", "values")]
            scores += ref.defensive_layer(*cat, units[0].module.o_proj.weight.detach(), p.prefill_window, p.sink,
                                          p.kernel, p.threshold, p.budget, units[0].module.scaling)
        per = 2 if name == "defensivekv" else len(obs)
        want = []
        for i in range(0, len(obs), per):
            want += ref.global_topk(scores[i:i + per], p.budget * per, p.sink, p.prefill_window, p.head_floor())
        assert [k[0, 0].tolist() for k in keeps] == want
    counts = [k.shape[-1] for k in calls[0][2]]
    assert len(set(counts)) > 1 and sum(counts) == pol.budget * len(counts)


def test_defensivekv_refuses_chunked_prefill(sharp):
    with pytest.raises(SkipKVError, match="chunked prefill"):
        generate(sharp, prompts(40), SamplingParams(max_new_tokens=2), make_policy("defensivekv", budget=20,
                 prefill_window=6), EngineConfig(prefill_chunk=16))


# ------------------------------------------------------------------------------------------ decode-time policies
def pre_rope(vec: torch.Tensor, pos: int, inv_freq: list[float]) -> list[float]:
    return ref.rope_pair(vec.tolist(), pos, inv_freq, sign=-1.0)


def test_expected_attention_keeps_the_naive_expectation(monkeypatch, sharp):
    pol = make_policy("expected_attention", budget=24, window=2, sink=2, interval=8, stats_window=10,
                      future_positions=16, phase="both")
    calls = run_captured(monkeypatch, sharp, pol, prompts(40, 31), 12, batch=2)
    inv_freq = rope_frequencies(sharp.model.config)[0].tolist()
    assert any(not o.is_prefill for _, o, _ in calls) and any(o.is_prefill for _, o, _ in calls)
    for p, o, keep in calls:
        for bi in range(o.keys.shape[0]):
            newest = int(o.positions[bi].max())
            w = min(p.stats_window, o.keys.shape[2], o.queries.shape[2])
            q = o.queries[bi, :, -w:]
            q_pre = torch.tensor([[pre_rope(q[hq, i], newest - w + 1 + i, inv_freq) for i in range(w)]
                                  for hq in range(q.shape[0])], dtype=torch.float64)
            s = ref.expected_scores(q_pre, o.keys[bi], inv_freq, newest + 1, p.future_positions, o.module.scaling)
            for h in range(o.keys.shape[1]):
                scores = [s[h][j] * float(o.values[bi, h, j].norm()) for j in range(o.keys.shape[2])]
                assert keep[bi, h].tolist() == naive_select(scores, p.budget, p.window, p.sink)


def test_triattention_keeps_the_naive_trigonometric_scores(monkeypatch, sharp):
    from skipkv.policies.triattention import TriStats

    stats_file = calibrated_stats(SHARP)
    pol = make_policy("triattention", budget=24, window=3, sink=1, interval=8, max_offset=64, stats_file=stats_file)
    calls = run_captured(monkeypatch, sharp, pol, prompts(40, 29), 20, batch=2)
    stats = TriStats.load(stats_file)
    inv_freq = rope_frequencies(sharp.model.config)[0].tolist()
    offsets = [float(2**i) for i in range(7)]
    for p, o, keep in calls:
        Hq, H, n = stats.q_mean.shape[1], o.keys.shape[1], o.keys.shape[2]
        for bi in range(o.keys.shape[0]):
            t = int(o.positions[bi].max())
            for h in range(H):
                best = [-math.inf] * n
                for hq in range(h * (Hq // H), (h + 1) * (Hq // H)):
                    raw = [ref.trig_head(pre_rope(o.keys[bi, h, j], int(o.positions[bi, h, j]), inv_freq),
                                         int(o.positions[bi, h, j]), t, stats.q_mean[o.layer, hq].tolist(),
                                         stats.q_abs[o.layer, hq].tolist(), inv_freq, offsets) for j in range(n)]
                    cand = raw[p.sink:n - p.window]
                    mu = sum(cand) / len(cand)
                    sd = max(math.sqrt(sum((x - mu) ** 2 for x in cand) / len(cand)), 1e-6)
                    best = [max(a, (x - mu) / sd) for a, x in zip(best, raw)]
                assert keep[bi, h].tolist() == naive_select(best, p.budget, p.window, p.sink)


def test_skipkv_tri_penalises_flagged_sentences_on_triattention_scores(monkeypatch, sharp):
    """skipkv_tri's score is TriAttention's minus sentence_weight x the similarity of the flagged sentence holding
    each entry (where the head holds at least min_span_entries of it), recomputed naively from the flags."""
    pol = make_policy("skipkv_tri", budget=24, window=3, interval=8, max_offset=64, tau=0.5,
                      stats_file=calibrated_stats(SHARP))
    cls = type(pol)
    base = cls.score
    seen = []

    def spy(self, obs):
        out = base(self, obs)
        # the flags as they stood (a later compression replaces them), the positions before compaction
        seen.append((self.tri_scores(obs), out, obs.positions.clone(), [st.flagged for st in obs.states]))
        return out

    monkeypatch.setattr(cls, "score", spy)
    text = "a b a b.\nthe same line.\nthe same line.\nthe same line.\n" * 2
    generate(sharp, [text], SamplingParams(max_new_tokens=30, ignore_eos=True), pol)
    penalised = 0
    for tri, got, positions, flagged in seen:
        for bi, flags in enumerate(flagged):
            spans = list(zip(*(x.tolist() for x in flags)))  # (start, end, sim), ends inclusive
            for h in range(positions.shape[1]):
                pos = positions[bi, h].tolist()
                for j, p in enumerate(pos):
                    want = 0.0
                    for s0, e0, sim in spans:
                        if s0 <= p <= e0 and sum(s0 <= x <= e0 for x in pos) >= pol.min_span_entries:
                            want = pol.sentence_weight * sim
                    assert math.isclose(float(tri[bi, h, j] - got[bi, h, j]), want, rel_tol=1e-6, abs_tol=1e-9)
                    penalised += want > 0
    assert penalised, "no flagged sentence was penalised"


def test_kvzip_is_listed_and_runs(capsys):
    """kvzip is runnable (its scores and selection: tests/test_kvzip.py): built by name, and from the CLI."""
    from skipkv.cli import main

    assert not POLICIES.get("kvzip").unavailable
    assert make_policy("kvzip", budget=16).budget == 16
    code = main(["generate", "--model", "random:qwen2", "--policy", "kvzip", "--budget", "8", "--max-new-tokens", "3",
                 "a prompt long enough to be compressed by the reconstruction"])
    assert code == 0, capsys.readouterr().err


def test_every_frontier_policy_is_registered():
    for name in ("criticalkv", "criticalkv_ada", "defensivekv", "layer_defensivekv", "expected_attention",
                 "triattention", "skipkv_tri", "kvzip"):
        assert POLICIES.get(name).paper.endswith(")")
    defaults = {n: {k: d for k, _t, d, _h in POLICIES.get(n).knobs()} for n in ("triattention", "skipkv_tri")}
    for knob in ("budget", "window", "interval", "max_offset", "zscore", "aggregate"):  # TriAttention's, in both
        assert defaults["skipkv_tri"][knob] == defaults["triattention"][knob], knob
