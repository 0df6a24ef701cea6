"""The engine against an independent reference decoder (tests/refdecoder.py): generated tokens AND the true
positions kept in every layer and kv head after every compression, for every compressing policy.

The model is `random:qwen2:sharp` in fp64: its attention is peaked, so the scores decide what is kept and
what is kept decides what is generated (on the plain tiny model almost any eviction passes). Cases: a ragged
batch of 4 at batch size 2 with different max_new_tokens (finished slots are refilled, so slots move),
chunked prefill, and interval < window.
"""

from __future__ import annotations

import pytest
import torch

from refdecoder import ref_generate
from skipkv import SamplingParams, generate, make_policy
from skipkv.cache import KVStore
from skipkv.config import EngineConfig
from skipkv.engine import encode_prompt
from skipkv.engine.runner import ModelRunner
from skipkv.models import load_model

PROMPTS = [
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "2 + 2 =",
    "The quick brown fox jumps over the lazy dog; the dog sleeps on.",
    "In the beginning the Universe was created.",
]
MAX_NEW = [37, 22, 30, 26]

SPECS = {
    "streaming_llm": dict(name="streaming_llm", budget=20, window=0, sink=4, interval=6),
    "h2o": dict(name="h2o", budget=20, window=4, interval=6, variant="accumulated", recent_ratio=0.0),
    "h2o_half": dict(name="h2o", budget=20, window=4, interval=6, variant="accumulated", recent_ratio=0.5),
    "h2o_last_query": dict(name="h2o", budget=20, window=4, interval=6, variant="last_query", recent_ratio=0.0),
    "snapkv": dict(name="snapkv", budget=20, window=4, interval=6, prefill_window=8, kernel=5, pooling="auto"),
    "snapkv_paper": dict(name="snapkv", budget=20, window=4, interval=6, prefill_window=8, kernel=7,
                         variant="paper"),
    "rkv": dict(name="rkv", budget=20, window=4, interval=6, kernel=5, mix_lambda=0.1, threshold=0.5),
}


@pytest.fixture(scope="module")
def sharp():
    return load_model("random:qwen2:sharp", dtype="fp64")


def policy_of(spec: dict):
    return make_policy(spec["name"], **{k: v for k, v in spec.items() if k != "name"})


def engine_run(monkeypatch, bundle, spec, prompts, max_new, engine: EngineConfig):
    """Run the engine; record per request (by prompt index) every compression's kept positions [L, H, budget]."""
    events: dict[int, list] = {i: [] for i in range(len(prompts))}
    aux: dict[int, list] = {i: [] for i in range(len(prompts))}
    original = ModelRunner.compress

    def spy(self, rows, is_prefill):
        original(self, rows, is_prefill)
        store = self.store
        for s, r in rows:
            n = int(store.lengths[0, s])
            assert (store.lengths[:, s] == n).all()
            processed = max(int(p[s, :, :n].max()) for p in store.pos) + 1
            events[r.index].append((processed, is_prefill, torch.stack([p[s, :, :n] for p in store.pos]).long()))
            if "attn" in store.aux:
                aux[r.index].append(torch.stack([a[s, :, :n] for a in store.aux["attn"]]).double())

    moves = []
    original_move = KVStore.move

    def move_spy(self, src, dst):
        if src != dst:
            moves.append((src, dst))
        original_move(self, src, dst)

    monkeypatch.setattr(ModelRunner, "compress", spy)
    monkeypatch.setattr(KVStore, "move", move_spy)
    sps = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in max_new]
    results = generate(bundle, prompts, sps, policy_of(spec), engine)
    monkeypatch.setattr(ModelRunner, "compress", original)
    monkeypatch.setattr(KVStore, "move", original_move)
    return results, events, aux, moves


def check_against_reference(monkeypatch, bundle, spec, prompts, max_new, engine: EngineConfig):
    results, events, aux, moves = engine_run(monkeypatch, bundle, spec, prompts, max_new, engine)
    total = 0
    for i, (prompt, m) in enumerate(zip(prompts, max_new)):
        ids = encode_prompt(bundle.tokenizer, prompt)
        tokens, ref_events, st = ref_generate(bundle, ids, m, spec, prefill_chunk=engine.prefill_chunk)
        got = events[i]
        assert [e[:2] for e in got] == [e[:2] for e in ref_events], f"prompt {i}: compression steps"
        for j, ((p, _, kept), (_, _, ref_kept, ref_attn)) in enumerate(zip(got, ref_events)):
            assert torch.equal(kept, ref_kept), f"prompt {i}, compression {j} at {p} tokens: kept positions differ"
            if aux[i]:  # H2O: every kept entry still carries the attention it has received (engine sums in fp32)
                torch.testing.assert_close(aux[i][j], ref_attn, rtol=1e-5, atol=1e-6,
                                           msg=f"prompt {i}, compression {j}: accumulated attention")
        assert results[i].token_ids == tokens, f"prompt {i}: generated tokens differ"
        total += len(got)
    assert total >= len(prompts) * 2, "the case must compress several times"
    if engine.batch_size < len(prompts):
        assert moves, "the case must move a running request into a finished one's slot"


# The default suite runs the combined case for the policies whose scores take distinct engine paths (H2O's
# accumulators, R-KV's queries + redundancy, SnapKV's prefill window) and StreamingLLM; the other H2O settings
# and SnapKV's paper variant (same engine path as snapkv; its score has a naive reference) are slow.
FAST = ("streaming_llm", "h2o_half", "rkv", "snapkv")


@pytest.mark.parametrize("key", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow) for k in SPECS])
def test_engine_matches_reference(monkeypatch, sharp, key):
    """All three cases at once: batch size 2 over 3 prompts with different max_new_tokens, so rows finish at
    different steps and a finished slot is refilled by moving the last running request into it; prompts
    prefilled in chunks of 9 (long ones compress after several chunks); interval 4 < window 6."""
    spec = dict(SPECS[key], budget=18, interval=4, window=6 if key != "streaming_llm" else 0)
    # Prompt 1 (7 tokens) is right-padded in the first prefill and compressed later, once it has 22 entries.
    check_against_reference(monkeypatch, sharp, spec, PROMPTS[:3], [20, 16, 16],
                            EngineConfig(batch_size=2, prefill_chunk=9, group_by_length=False))


@pytest.mark.slow
@pytest.mark.parametrize("key", list(SPECS))
def test_ragged_batch_with_slot_moves(monkeypatch, sharp, key):
    """Batch size 2 over 4 prompts of different lengths and max_new_tokens: rows finish at different steps,
    their slots are refilled by moving the last running request, and every compression must still match."""
    check_against_reference(monkeypatch, sharp, SPECS[key], PROMPTS, MAX_NEW,
                            EngineConfig(batch_size=2, group_by_length=False))


@pytest.mark.slow
@pytest.mark.parametrize("key", list(SPECS))
def test_chunked_prefill(monkeypatch, sharp, key):
    check_against_reference(monkeypatch, sharp, SPECS[key], PROMPTS[:3], [12, 12, 12],
                            EngineConfig(batch_size=3, prefill_chunk=7))


@pytest.mark.slow
@pytest.mark.parametrize("key", list(SPECS))
def test_interval_shorter_than_window(monkeypatch, sharp, key):
    spec = dict(SPECS[key], window=6 if key != "streaming_llm" else 0, interval=2, budget=16)
    check_against_reference(monkeypatch, sharp, spec, PROMPTS[:2], [20, 14], EngineConfig(batch_size=2))
