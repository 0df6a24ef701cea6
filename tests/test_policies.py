"""The contract every registered policy must meet (the matrix runs each policy through the same checks)."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, resolve_contract_knobs
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.models.patches import routed
from skipkv.policies import POLICIES
from skipkv.policies.base import Policy

# Everything below is read from the registry and from what each policy declares: no policy is named here.
# Policies listed but not runnable (`unavailable`) are refused when built (policies/base.py).
COMPRESSING = [n for n in POLICIES.names() if POLICIES.get(n).compresses and not POLICIES.get(n).unavailable]
# Policies whose layers end at different lengths (model-wide, or per-layer budgets via layer_capacity): the
# step-by-step budget check below assumes one length for all layers; tests/test_laprox.py checks them per layer.
UNIFORM = [n for n in COMPRESSING
           if not POLICIES.get(n).model_wide and POLICIES.get(n).layer_capacity is Policy.layer_capacity]
# Prefill-only policies never compress the short prompts here; tests/test_laprox.py runs them on long ones.
DECODING = [n for n in COMPRESSING if {k: d for k, _t, d, _h in POLICIES.get(n).knobs()}["phase"] != "prefill"]
KNOBS = dict(budget=24, window=4, interval=8)


def knobs(name: str) -> dict:
    """The shared knobs, with what the policy declares it needs on the tiny model (`contract_knobs`)."""
    return resolve_contract_knobs({**KNOBS, **POLICIES.get(name).contract_knobs})


@pytest.mark.parametrize("name", DECODING)
def test_batch_equals_singles(tiny, name):
    policy = make_policy(name, **knobs(name))
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    batched = generate(tiny, PROMPTS, sp, policy, EngineConfig(batch_size=4))
    for prompt, res in zip(PROMPTS, batched):
        alone = generate(tiny, [prompt], sp, policy)[0]
        assert res.token_ids == alone.token_ids
        assert res.compressions == alone.compressions > 0


@pytest.mark.parametrize("name", UNIFORM)
def test_budget_respected_and_protected_tokens_survive(tiny, name):
    """Drive the runner step by step: never above budget + interval, exactly budget after a compression,
    and the sink and window tokens (by true position) are still there."""
    policy = make_policy(name, **knobs(name))
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reqs = make_requests(tiny, PROMPTS[:2], sp, policy)  # 4 and 51 tokens: one starts over budget
    runner = ModelRunner(tiny, policy, num_slots=2)
    store = runner.store
    with routed(tiny.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
        for _ in range(29):
            before = [r.compressions for r in runner.running]
            for r, t in zip(list(runner.running), runner.decode()):
                r.output_ids.append(t)
            for slot, r in enumerate(runner.running):
                n = int(store.lengths[0, slot])
                assert n <= policy.budget + policy.interval
                assert (store.lengths[:, slot] == n).all()
                if r.compressions > before[slot]:
                    assert n == policy.budget
                    pos = torch.stack([p[slot, :, :n] for p in store.pos])
                    newest = r.next_position  # position of the token just sampled (not yet cached)
                    for p in range(newest - policy.window, newest):
                        assert (pos == p).any(dim=-1).all(), f"window token {p} evicted"
                    for p in range(policy.sink):
                        assert (pos == p).any(dim=-1).all(), f"sink token {p} evicted"
                    assert (pos[..., 1:] > pos[..., :-1]).all(), "entries out of order"
    assert all(r.compressions > 0 for r in reqs)


@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_over_sequence_equals_full(tiny, name):
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    full = generate(tiny, PROMPTS, sp, make_policy("full"), EngineConfig(batch_size=4))
    policy = make_policy(name, **{**knobs(name), "budget": 4096, "interval": 64})
    big = generate(tiny, PROMPTS, sp, policy, EngineConfig(batch_size=4))
    assert [r.token_ids for r in big] == [r.token_ids for r in full]
    assert all(r.compressions == 0 for r in big)


@pytest.mark.parametrize("name", COMPRESSING)
def test_sampling_deterministic_under_seed(tiny, name):
    policy = make_policy(name, **knobs(name))
    sp = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = generate(tiny, PROMPTS, sp, policy, EngineConfig(batch_size=4))
    b = generate(tiny, PROMPTS, sp, policy, EngineConfig(batch_size=2))
    c = generate(tiny, PROMPTS, SamplingParams(max_new_tokens=20, temperature=0.8, seed=8, ignore_eos=True), policy)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_compression_changes_output(tiny):
    # A budget that bites must actually evict: the output differs from the full cache.
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    full = generate(tiny, PROMPTS[1:2], sp, make_policy("full"))[0]
    rkv = generate(tiny, PROMPTS[1:2], sp, make_policy("rkv", budget=12, window=4, interval=4))[0]
    assert rkv.token_ids != full.token_ids
    # The whole prompt (51 tokens) is staged before its first compression...
    assert rkv.peak_kv_tokens == rkv.prompt_tokens < full.peak_kv_tokens
    # ...and once decoding, the request never holds more than budget + interval.
    assert rkv.decode_peak_kv_tokens == 16
    # ...unless it is prefilled in chunks, which bounds the peak by budget + chunk.
    chunked = generate(tiny, PROMPTS[1:2], sp, make_policy("rkv", budget=12, window=4, interval=4),
                       EngineConfig(prefill_chunk=4))[0]
    assert chunked.peak_kv_tokens <= 16
    assert chunked.peak_kv_bytes < rkv.peak_kv_bytes < full.peak_kv_bytes


def test_h2o_accumulates_attention_over_steps(tiny):
    """Every real query hands out one unit of attention per query head, so after P prompt tokens and 3 decode
    steps (no eviction yet) each layer's and kv head's accumulators must sum to G * (P + 3), all positive."""
    policy = make_policy("h2o", budget=64, window=4, interval=8)
    reqs = make_requests(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=5, ignore_eos=True), policy)
    runner = ModelRunner(tiny, policy, num_slots=1)
    with routed(tiny.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
        for _ in range(3):
            for r, t in zip(list(runner.running), runner.decode()):
                r.output_ids.append(t)
    n = int(runner.store.lengths[0, 0])
    acc = torch.stack([a[0, :, :n] for a in runner.store.aux["attn"]])  # [L, H, n]
    G = tiny.config.num_attention_heads // tiny.config.num_key_value_heads
    queries = reqs[0].prompt_len + 3  # every query so far, prompt included
    torch.testing.assert_close(acc.sum(dim=-1), torch.full_like(acc[..., 0], float(G * queries)))
    assert (acc > 0).all()


@pytest.mark.parametrize("block_bytes", [1 << 28, 1], ids=["one-block", "one-query-per-block"])
def test_h2o_prefill_accumulation_equals_the_reference(tiny, monkeypatch, block_bytes):
    """A fresh prefill of a ragged batch (pad rows included) accumulates, per key, the attention it receives
    from every real prompt query and query head of its group: the independent reference decoder's sums."""
    from refdecoder import ref_generate
    from skipkv import attention

    monkeypatch.setattr(attention, "ACCUMULATE_BLOCK_BYTES", block_bytes)
    policy = make_policy("h2o", budget=256, window=4, interval=8)
    reqs = make_requests(tiny, PROMPTS[:2], SamplingParams(max_new_tokens=1, ignore_eos=True), policy)
    assert reqs[0].prompt_len != reqs[1].prompt_len
    runner = ModelRunner(tiny, policy, num_slots=2)
    with routed(tiny.model), torch.inference_mode():
        runner.prefill(reqs)
    for slot, r in enumerate(reqs):
        P = r.prompt_len
        _, _, st = ref_generate(tiny, r.prompt_ids, 1, dict(name="h2o", budget=256, window=4, interval=8))
        got = torch.stack([a[slot, :, :P] for a in runner.store.aux["attn"]]).double()  # [L, H, P]
        torch.testing.assert_close(got, st.attn[:, :, :P], rtol=1e-5, atol=1e-6)  # our sums are fp32


def test_streaming_llm_keeps_sinks_and_newest(tiny):
    policy = make_policy("streaming_llm", budget=12, sink=4, window=0, interval=4)
    reqs = make_requests(tiny, PROMPTS[1:2], SamplingParams(max_new_tokens=10, ignore_eos=True), policy)
    runner = ModelRunner(tiny, policy, num_slots=1)
    with routed(tiny.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
    L = reqs[0].prompt_len
    pos = runner.store.pos[0][0, 0, :12].tolist()
    assert pos == [0, 1, 2, 3] + list(range(L - 8, L))


PROTECTABLE = [n for n in DECODING if not POLICIES.get(n).model_wide]


@pytest.mark.parametrize("name", PROTECTABLE)
def test_protect_prompt_keeps_the_whole_prompt(tiny, name):
    """protect_prompt: at batch 2 (prompts of 4 and 51 tokens, both longer than nothing and one far over
    budget), no prompt position is ever evicted from any layer or head, nothing is compressed at prefill, and a
    compression brings each layer to at most prompt + budget (exactly that where every layer has one budget)."""
    policy = make_policy(name, **{**knobs(name), "protect_prompt": True})
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = make_requests(tiny, PROMPTS[:2], sp, policy)
    runner = ModelRunner(tiny, policy, num_slots=2)
    store = runner.store
    uniform = name in UNIFORM
    with routed(tiny.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
        assert all(r.compressions == 0 for r in reqs)
        for _ in range(39):
            before = [r.compressions for r in runner.running]
            for r, t in zip(list(runner.running), runner.decode()):
                r.output_ids.append(t)
            for slot, r in enumerate(runner.running):
                P = r.prompt_len
                n = store.lengths[:, slot]
                cap = r.policy.layer_capacity(store.num_layers, P, sp.max_new_tokens)
                assert (n <= torch.tensor(cap)).all()
                if uniform:
                    assert int(n.max()) <= P + policy.budget + policy.interval
                if r.compressions > before[slot]:
                    if uniform:
                        assert (n == P + policy.budget).all()
                    for layer, p in enumerate(store.pos):
                        held = p[slot, :, : int(n[layer])]
                        assert (held[:, :P] == torch.arange(P, dtype=torch.int32)).all(), \
                            f"layer {layer}: a prompt entry was evicted"
    assert all(r.compressions > 0 for r in reqs)


@pytest.mark.parametrize("name", [n for n in COMPRESSING if POLICIES.get(n).model_wide])
def test_protect_prompt_refused_where_it_cannot_apply(name):
    from skipkv.errors import SkipKVError

    with pytest.raises(SkipKVError, match="protect_prompt does not apply"):
        make_policy(name, **{**knobs(name), "protect_prompt": True})


def test_protect_prompt_with_a_request_budget_counts_generated_tokens():
    policy = make_policy("rkv", budget=24, window=4, interval=8, protect_prompt=True)
    mine = policy.for_request(100, 16)
    assert (mine.budget, mine.sink, mine.protect_prompt) == (116, 100, False)
    assert mine.for_request(100, None) is mine  # applied once
    with pytest.raises(Exception, match="phase prefill"):
        make_policy("rkv", budget=24, window=4, protect_prompt=True, phase="prefill")
