"""A prompt prefix shared by the requests admitted together is prefilled once (EngineConfig.share_prefix): every
row then holds what it would have computed itself, and the tokens equal a run without sharing (fp64)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_entries
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine, encode_prompt, make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.models import load_model
from skipkv.models.patches import routed

PREFIX = ("You are a careful assistant. Think step by step, check every step, and give the answer at the end. "
          "Example: 3 apples and 4 apples make 7 apples. ")
QUESTIONS = ["How many legs do two cats have?", "What is 12 times 3?", "Name a prime above 10.",
             "If a train leaves at noon and travels for three hours, when does it arrive?"]
PROMPTS = [PREFIX + q for q in QUESTIONS]
POLICIES = {  # one per thing a row must inherit: accumulated attention, buffered queries, hidden states
    "full": {},
    "h2o": dict(budget=24, window=4, interval=6),
    "snapkv": dict(budget=24, window=4, interval=6, prefill_window=8),
    "rkv": dict(budget=24, window=4, interval=6),
    "skipkv": dict(budget=24, window=4, interval=6),
}


@pytest.fixture(scope="module")
def sharp():
    return load_model("random:qwen2:sharp", dtype="fp64")


def common_prefix(bundle) -> int:
    ids = [encode_prompt(bundle.tokenizer, p) for p in PROMPTS]
    n = 0
    while all(len(x) > n + 1 and x[n] == ids[0][n] for x in ids):
        n += 1
    return n


@pytest.mark.parametrize("name", list(POLICIES))
def test_shared_prefix_gives_the_tokens_of_unshared_prefill(sharp, name):
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    policy = make_policy(name, **POLICIES[name])
    plain = generate(sharp, PROMPTS, sp, policy, EngineConfig(batch_size=4))
    eng = Engine(sharp, policy, EngineConfig(batch_size=4, share_prefix=8))
    try:
        ids = [eng.add_request(p, sp) for p in PROMPTS]
        results, prefilled = {}, 0
        while eng.has_unfinished():
            out = eng.step()
            prefilled += out.stats.prefill_tokens
            results.update({r.request_id: r for r in out.finished})
        saved = eng.runner.shared_prefix_tokens
    finally:
        eng.close()
    n = common_prefix(sharp)
    assert n >= 8 and saved == 3 * n  # the prefix ran once instead of four times
    assert prefilled == sum(len(encode_prompt(sharp.tokenizer, p)) for p in PROMPTS) - saved
    for rid, want in zip(ids, plain):
        assert results[rid].token_ids == want.token_ids
        assert results[rid].compressions == want.compressions


@pytest.mark.parametrize("name", ["h2o", "snapkv", "skipkv"])
def test_every_row_holds_what_chunked_prefill_at_the_prefix_writes(sharp, name):
    """Entries, positions, accumulated attention (h2o) and buffered queries (snapkv: a 32-query window, longer
    than the rest of the shortest prompt) after prefill, row by row, against the same prompts prefilled in
    chunks split at the shared prefix without sharing (a policy that never compresses at prefill)."""
    n = common_prefix(sharp)

    def prefilled(share: int, chunk: int) -> ModelRunner:
        policy = make_policy(name, budget=4096, window=4, interval=6,
                             **({"prefill_window": 32} if name == "snapkv" else {}))
        runner = ModelRunner(sharp, policy, share_prefix=share, prefill_chunk=chunk)
        reqs = make_requests(sharp, [encode_prompt(sharp.tokenizer, p) for p in PROMPTS],
                             SamplingParams(max_new_tokens=4), policy)
        with routed(sharp.model), torch.inference_mode():
            runner.prefill(reqs)
        return runner

    a, b = prefilled(0, n), prefilled(8, n)
    assert b.shared_prefix_tokens == 3 * n and a.shared_prefix_tokens == 0
    assert max(len(encode_prompt(sharp.tokenizer, p)) for p in PROMPTS) <= 2 * n  # two chunks in `a`
    assert_same_entries(a.store, b.store, len(PROMPTS))
    exact = dict(rtol=0, atol=1e-12)  # fp64: only the order of sums may differ
    assert (name == "h2o") == bool(a.store.aux_names)
    if name == "skipkv":  # the sentence tracker saw every prompt token's hidden state, in order
        for ra, rb in zip(a.running, b.running):
            ta, tb = ra.state.tracker, rb.state.tracker
            assert (ta.next_pos, ta.starts, ta.ends, ta.open_start, ta.open_ids, ta.open_count) == \
                (tb.next_pos, tb.starts, tb.ends, tb.open_start, tb.open_ids, tb.open_count)
            assert ta.next_pos == ra.prompt_len
            torch.testing.assert_close(tb.open_sum, ta.open_sum, **exact)
            if ta.starts:
                torch.testing.assert_close(tb.representations(), ta.representations(), **exact)
    if name == "snapkv":
        assert a.queries is not None and b.queries is not None
        qpos = a.queries.qpos[:len(PROMPTS)]
        assert torch.equal(qpos, b.queries.qpos[:len(PROMPTS)])
        assert ((qpos[1:] >= 0) & (qpos[1:] < n)).any()  # rows that copied the prefix hold some of its queries
        torch.testing.assert_close(b.queries.q, a.queries.q, **exact)


def test_no_sharing_below_the_threshold_or_alone(sharp):
    policy = make_policy("full")
    runner = ModelRunner(sharp, policy, share_prefix=10_000)
    reqs = make_requests(sharp, [encode_prompt(sharp.tokenizer, p) for p in PROMPTS],
                         SamplingParams(max_new_tokens=2), policy)
    assert runner.shared_prefix(reqs) == 0
    runner.share_prefix = 1
    assert runner.shared_prefix(reqs[:1]) == 0
    assert runner.shared_prefix(reqs) == common_prefix(sharp)
    runner.prefill_chunk = 5  # the prefix stays within the first chunk
    assert runner.shared_prefix(reqs) == 5


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
def test_grouped_attention_in_row_blocks_is_bit_identical(monkeypatch, dtype):
    """The rest of each prompt after a shared prefix is a multi-token forward over the prefix's keys (grouped
    attention, with a mask). Run it in blocks of one row, in blocks of three (the last one partial) and all
    rows at once: the store's entries, H2O's accumulated attention and the tokens are the same to the bit, in
    fp64 and in bf16."""
    import skipkv.attention as attn

    bundle = load_model("random:qwen2:sharp", dtype=dtype)
    n = common_prefix(bundle)
    real = attn._grouped_attention

    def run(block: int):
        monkeypatch.setattr(attn, "GROUPED_BLOCK_BYTES", block)
        calls = []  # (rows, fp32 logits bytes of one row) of each multi-token call; query [B, Hq, T, D]
        monkeypatch.setattr(attn, "_grouped_attention", lambda *a: (
            a[2].shape[2] > 1 and calls.append((a[2].shape[0], a[2][0].numel() // a[2].shape[3] * a[3].shape[2] * 4))
        ) or real(*a))
        policy = make_policy("h2o", budget=4096, window=4, interval=6)
        runner = ModelRunner(bundle, policy, share_prefix=8)
        reqs = make_requests(bundle, [encode_prompt(bundle.tokenizer, p) for p in PROMPTS],
                             SamplingParams(max_new_tokens=4), policy)
        with routed(bundle.model), torch.inference_mode():
            runner.prefill(reqs)
        store = runner.store
        rows = len(PROMPTS)
        return ([x[:rows].clone() for x in store.k + store.v + store.aux["attn"]], store.lengths[:, :rows].clone(),
                calls)

    whole, lengths, calls = run(1 << 40)
    assert n >= 8 and {rows for rows, _ in calls} == {len(PROMPTS)}  # the rests of the prompts, all rows at once
    per_row = calls[0][1]
    assert any(a.abs().sum() > 0 for a in whole[-len(bundle.model.model.layers):])  # H2O accumulated something
    for block, sizes in ((1, [1, 1, 1, 1]), (3 * per_row, [3, 1])):
        blocked, blocked_lengths, calls = run(block)
        assert {tuple(r for r, _ in calls[i:i + len(sizes)]) for i in range(0, len(calls), len(sizes))} == {
            tuple(sizes)}  # every layer ran these blocks
        assert torch.equal(blocked_lengths, lengths)
        for x, y in zip(blocked, whole):
            assert torch.equal(x, y)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    policy = make_policy("h2o", budget=24, window=4, interval=6)
    monkeypatch.setattr(attn, "GROUPED_BLOCK_BYTES", 1)
    blocked = generate(bundle, PROMPTS, sp, policy, EngineConfig(batch_size=4, share_prefix=8))
    monkeypatch.setattr(attn, "GROUPED_BLOCK_BYTES", 1 << 40)
    whole = generate(bundle, PROMPTS, sp, policy, EngineConfig(batch_size=4, share_prefix=8))
    assert [r.token_ids for r in blocked] == [r.token_ids for r in whole]
