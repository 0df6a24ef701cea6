"""The replayed decode step (engine/graphs.py) on a CPU, where it runs the step over the same buffers, batch buckets,
key buckets and padding rows that a CUDA graph replays: the eager fixed step's tokens and entries across
compression (the query buffer), H2O's accumulators, steering and slot reuse; padding rows leave their slots bit for
bit as they were; graphs are reused within a bucket and dropped when the store is reallocated. The capture itself
awaits a GPU (benchmarks/gpu.sh)."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, assert_same_entries
from skipkv import SamplingParams, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine
from skipkv.engine.graphs import GraphStep, batch_bucket
from skipkv.models import load_model
from skipkv.steering.hook import ResidualAdd
from test_fixed_step import POLICIES, engines, lockstep


@pytest.fixture(scope="module")
def pair64():
    return [load_model("random:qwen2", dtype="fp64") for _ in range(2)]


def test_batch_bucket():
    assert [batch_bucket(b, 64) for b in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert batch_bucket(5, 6) == 6 and batch_bucket(3, 3) == 3


@pytest.mark.parametrize("name", ["full", "rkv", "snapkv", "h2o"])
def test_graph_step_equals_the_eager_step(monkeypatch, pair64, name):
    """6 ragged requests through 4 slots: batches of 4, then 3 (a padding row in bucket 4), 2 and 1, slots refilled."""
    a, b = engines(monkeypatch, pair64, make_policy(name, **POLICIES[name]), EngineConfig(batch_size=4),
                   kinds=("eager", "graph"))
    try:
        assert isinstance(b.runner.fixed, GraphStep)
        lockstep(a, b, PROMPTS + PROMPTS[:2], [14, 6, 11, 4, 8, 16], atol=1e-12)
    finally:
        a.close(), b.close()


def test_graph_step_applies_steering(monkeypatch, pair64):
    a, b = engines(monkeypatch, pair64, make_policy("full"), EngineConfig(batch_size=4), kinds=("eager", "graph"))
    try:
        torch.manual_seed(3)
        vec = torch.randn(pair64[0].model.config.hidden_size, dtype=torch.float64)
        for eng in (a, b):
            eng.runner.steering = ResidualAdd(eng.bundle.model, layer=1, vector=vec, coef=lambda state: 3.0)
        lockstep(a, b, PROMPTS[:3], [10, 6, 12], atol=1e-12)
    finally:
        for eng in (a, b):
            eng.runner.steering.remove()
            eng.close()


@pytest.mark.parametrize("name", ["full", "h2o"])
def test_padding_rows_over_a_prefilling_slot_change_nothing(monkeypatch, pair64, name):
    """Three requests decode while a fourth is prefilled in chunks into slot 3: each of those steps pads 3 rows to
    bucket 4, the padding row over the prefilling slot (at its entry 0). Tokens and entries stay those of the eager
    step, the fourth request's included."""
    cfg = EngineConfig(batch_size=4, prefill_chunk=4)
    a, b = engines(monkeypatch, pair64, make_policy(name, **POLICIES[name]), cfg, kinds=("eager", "graph"))
    calls: list[tuple[int, int]] = []
    real_call = GraphStep.__call__

    def spy(self, store, tokens, *args, **kwargs):
        calls.append((tokens.shape[0], store.num_slots))
        return real_call(self, store, tokens, *args, **kwargs)

    monkeypatch.setattr(GraphStep, "__call__", spy)
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    try:
        for eng in (a, b):
            for p in PROMPTS[:3]:
                eng.add_request(p, sp)
        for _ in range(12):  # prefill in chunks, then decode steps
            assert a.step().new_tokens == b.step().new_tokens
        long_prompt = PROMPTS[3] * 3
        for eng in (a, b):
            eng.add_request(long_prompt, sp)
        store = b.runner.store
        while a.has_unfinished():
            assert a.step().new_tokens == b.step().new_tokens
            rows = len(a.runner.running)
            assert_same_entries(a.runner.store, store, rows, atol=1e-12)
        assert (3, 4) in calls  # padded steps happened
    finally:
        a.close(), b.close()


def test_graphs_are_reused_within_a_bucket_and_dropped_with_the_store(monkeypatch, pair64):
    monkeypatch.setattr(pair64[0], "plan", pair64[0].plan.with_step("graph"))
    eng = Engine(pair64[0], make_policy("full"), EngineConfig(batch_size=2))
    try:
        for p in PROMPTS[:2]:
            eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
        for _ in range(30):
            eng.step()
        step = eng.runner.fixed
        assert isinstance(step, GraphStep)
        # 29 decode steps of 2 rows whose caches stay within one or two 64-key buckets: a graph or two, not 29
        assert 1 <= len(step.graphs) <= 2
        kept = dict(step.graphs)
        store = eng.runner.store
        store.k[0] = store.k[0].clone()  # as a reallocation does: the graphs read the old tensor
        eng.add_request(PROMPTS[2], SamplingParams(max_new_tokens=3, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert not set(map(id, step.graphs.values())) & set(map(id, kept.values()))
    finally:
        eng.close()
