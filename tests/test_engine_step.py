"""The step-driven Engine: same tokens as `generate`, requests joining mid-flight, abort, the KV memory cap
(checked against the store's allocated bytes after every step), per-request budgets, chunked prefill
interleaved with decoding."""

from __future__ import annotations

import random

import pytest

from conftest import PROMPTS
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine
from skipkv.errors import SkipKVError

RKV = dict(budget=16, window=4, interval=8)


def drain(eng: Engine, results: dict | None = None, stats: list | None = None) -> dict:
    results = {} if results is None else results
    while eng.has_unfinished():
        out = eng.step()
        if stats is not None:
            stats.append(out.stats)
        for res in out.finished:
            results[res.request_id] = res
    return results


def test_step_engine_equals_generate_with_late_arrivals(tiny):
    policy = make_policy("rkv", **RKV)
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 20, 6, 14)]
    ref = generate(tiny, PROMPTS, sps, policy, EngineConfig(batch_size=4, prefill_chunk=5))
    eng = Engine(tiny, policy, EngineConfig(batch_size=3, prefill_chunk=5))
    try:
        results: dict = {}
        ids = [eng.add_request(PROMPTS[0], sps[0]), eng.add_request(PROMPTS[1], sps[1], request_id="b")]
        for _ in range(3):  # the first two decode a while before the others arrive
            for res in eng.step().finished:
                results[res.request_id] = res
        ids.append(eng.add_request(PROMPTS[2], sps[2]))
        eng.step()
        ids.append(eng.add_request(PROMPTS[3], sps[3]))
        drain(eng, results)
    finally:
        eng.close()
    assert ids[1] == "b" and len(set(ids)) == 4
    for rid, want in zip(ids, ref):
        assert results[rid].token_ids == want.token_ids
        assert results[rid].compressions == want.compressions
        assert results[rid].request_id == rid
        assert results[rid].ttft_seconds > 0 and results[rid].tpot_p50_seconds > 0


def test_abort_frees_slot_and_memory_at_once(tiny):
    eng = Engine(tiny, make_policy("full"), EngineConfig(batch_size=4))
    try:
        sp = SamplingParams(max_new_tokens=50, ignore_eos=True)
        a, b, c = (eng.add_request(p, sp) for p in PROMPTS[:3])
        for _ in range(3):
            before = eng.step().stats
        assert before.running == 3
        held_b = int(eng.runner.store.lengths[:, [r.request_id for r in eng.runner.running].index(b)].sum())
        assert eng.abort(b) and not eng.abort(b) and not eng.abort("nope")
        after = eng.stats()
        assert after.running == 2
        assert after.kv_held_bytes == before.kv_held_bytes - held_b * eng.runner.store.bytes_per_entry
        assert after.kv_allocated_bytes < before.kv_allocated_bytes
        assert eng.runner.store.num_slots == 2
        # waiting requests can be aborted too, and the rest finish normally
        d = eng.add_request(PROMPTS[3], sp)
        assert eng.abort(d) and eng.stats().waiting == 0
        results = drain(eng)
        assert set(results) == {a, c}
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["full", "rkv", "snapkv"])
def test_kv_memory_cap_never_exceeded(tiny, name):
    """A random request mix under a cap: the store's allocated bytes stay within it after every step, the cap
    is what limits the batch, and the tokens are those of an uncapped run."""
    rng = random.Random(1)
    extra = {"prefill_window": 8} if name == "snapkv" else {}
    policy = make_policy(name) if name == "full" else make_policy(name, **RKV, **extra)
    prompts = ["".join(rng.choice("abcdefgh .") for _ in range(rng.randint(20, 60))) for _ in range(10)]
    sps = [SamplingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=True) for _ in prompts]
    chunk = 6 if name == "full" else 0  # whole prompts stage past budget + interval: the reservation covers it
    ref = generate(tiny, prompts, sps, policy, EngineConfig(batch_size=10, prefill_chunk=chunk))
    eng = Engine(tiny, policy, EngineConfig(batch_size=10, prefill_chunk=chunk))
    entry = eng.runner.entry_bytes
    eng.close()
    cap = (80 if name == "full" else 100) * entry * 2  # room for about two to four requests at a time
    eng = Engine(tiny, policy, EngineConfig(batch_size=10, prefill_chunk=chunk, kv_memory=cap))
    stats: list = []
    try:
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts[:6], sps[:6])]
        results: dict = {}
        for _ in range(4):
            for res in eng.step().finished:
                results[res.request_id] = res
            assert eng.runner.store.allocated_bytes() <= cap
        ids += [eng.add_request(p, sp) for p, sp in zip(prompts[6:], sps[6:])]
        while eng.has_unfinished():
            out = eng.step()
            stats.append(out.stats)
            assert eng.runner.store.allocated_bytes() <= cap
            assert out.stats.kv_allocated_bytes <= cap and out.stats.kv_held_bytes <= out.stats.kv_allocated_bytes
            assert out.stats.kv_reserved_bytes <= cap
            for res in out.finished:
                results[res.request_id] = res
    finally:
        eng.close()
    assert [results[i].token_ids for i in ids] == [r.token_ids for r in ref]
    assert 1 < max(s.running for s in stats) < 10  # the cap, not batch_size, bounded the batch
    assert eng.runner.store.num_slots == 0  # everything handed back at the end


def test_never_fits_and_context_are_refused(tiny):
    eng = Engine(tiny, make_policy("full"), EngineConfig(kv_memory=1000))
    try:
        with pytest.raises(SkipKVError, match="kv_memory"):
            eng.add_request(PROMPTS[1], SamplingParams(max_new_tokens=10))
        assert not eng.has_unfinished()
    finally:
        eng.close()
    with pytest.raises(SkipKVError, match="kv_memory"):
        generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=10), engine=EngineConfig(kv_memory=1000))
    with pytest.raises(SkipKVError, match="context"):
        generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=tiny.max_context))


def test_per_request_budget(tiny):
    policy = make_policy("rkv", budget=24, window=4, interval=8)
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = generate(tiny, PROMPTS[1:2], sp, make_policy("rkv", budget=12, window=4, interval=8))[0]
    high = generate(tiny, PROMPTS[1:2], sp, policy)[0]
    eng = Engine(tiny, policy, EngineConfig())
    try:
        for bad in (25, 4, 0, "12"):
            with pytest.raises(SkipKVError, match="budget"):
                eng.add_request(PROMPTS[1], sp, budget=bad)
        low = eng.add_request(PROMPTS[1], sp, budget=12)
        same = eng.add_request(PROMPTS[1], sp)
        res = drain(eng)
    finally:
        eng.close()
    assert res[low].token_ids == want.token_ids and res[low].decode_peak_kv_tokens == 12 + 8
    assert res[same].token_ids == high.token_ids
    with pytest.raises(SkipKVError, match="keeps every token"):
        with Engine(tiny, make_policy("full")) as e:
            e.add_request("x", sp, budget=8)


def test_chunked_prefill_interleaves_with_decoding(tiny):
    """While a long prompt is prefilled chunk by chunk, the running request gets a token every step."""
    eng = Engine(tiny, make_policy("full"), EngineConfig(prefill_chunk=8))
    try:
        a = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
        for _ in range(2):
            eng.step()
        b = eng.add_request(PROMPTS[3] * 2, SamplingParams(max_new_tokens=4, ignore_eos=True))
        steps = []
        while not any(rid == b for rid, _ in (steps[-1].new_tokens if steps else [])):
            steps.append(eng.step())
        assert len(steps) > 5  # the long prompt took several steps...
        assert all(any(rid == a for rid, _ in s.new_tokens) for s in steps)  # ...and `a` decoded in each
        assert all(0 < s.stats.prefill_tokens <= 8 for s in steps)
        drain(eng)
    finally:
        eng.close()


def test_one_open_engine_per_model(tiny):
    with Engine(tiny, make_policy("full")):
        with pytest.raises(SkipKVError, match="another Engine"):
            Engine(tiny, make_policy("full"))
    Engine(tiny, make_policy("full")).close()  # closed: the model is free again


@pytest.mark.parametrize("name, knobs", [("rkv", RKV), ("pyramidkv", dict(budget=24, window=4, interval=8,
                                                                          prefill_window=4, phase="both"))])
def test_store_follows_what_is_kept_after_every_step(tiny, name, knobs):
    """With nobody waiting, after every step the store is shaped exactly as the live requests need (the runner
    skips re-fitting between events: a compression late in a request, when what it keeps plus its remaining
    growth falls below its reservation, must still shrink the store)."""
    eng = Engine(tiny, make_policy(name, **knobs), EngineConfig(batch_size=4))
    try:
        for p, n in zip(PROMPTS, (40, 23, 31, 17)):
            eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        shrunk = False
        while eng.has_unfinished():
            before = list(eng.runner.store.capacities)
            eng.step()
            if not eng.scheduler:
                slots, caps = eng.runner.needed_shape()
                assert (eng.runner.store.num_slots, eng.runner.store.capacities) == (slots, caps)
                shrunk |= bool(eng.runner.running) and any(c < b for c, b in zip(caps, before))
    finally:
        eng.close()
    assert shrunk  # the case above happened
