"""KV memory accounting (engine/memory.py) holds for every policy: a property test drives random request mixes
(prompt lengths, per-request budgets, max_new_tokens, arrival steps, chunked prefill, batch >= 2) through every
registered policy and checks, after every engine step, that the slot store never allocated more than
`kv_memory` and that every request finishes. Then one test per accounting bug the earlier scheduler had:
B1 (budget_ratio + chunked prefill reserved the default budget), B2 (admission assumed every layer holds
the same, the store sizes each layer by its longest slot), B3 (a per-request budget was ignored under
budget_ratio).

    python -m pytest tests/test_memory.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import resolve_contract_knobs
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine, eos_ids
from skipkv.errors import SkipKVError
from skipkv.policies import POLICIES
from skipkv.policies.laprox import LaProx
from test_steering import write_vector

# One or more small settings per registered policy (phases, ratio and protected-prompt variants included).
SPECS = {
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", dict(budget=12, sink=2, interval=4)),
    "h2o": ("h2o", dict(budget=16, window=2, interval=4)),
    "h2o-last_query": ("h2o", dict(budget=16, window=2, interval=4, variant="last_query")),
    "snapkv": ("snapkv", dict(budget=16, window=2, prefill_window=4, interval=4)),
    "rkv": ("rkv", dict(budget=16, window=2, interval=4)),
    "rkv-decode": ("rkv", dict(budget=16, window=2, interval=4, phase="decode")),
    "skipkv": ("skipkv", dict(budget=16, window=2, interval=4)),
    "skipkv-protect": ("skipkv", dict(budget=8, window=2, interval=4, protect_prompt=True)),
    "h2o-protect": ("h2o", dict(budget=8, window=2, interval=4, protect_prompt=True)),
    "pyramidkv-protect": ("pyramidkv", dict(budget=16, window=2, prefill_window=4, interval=4, protect_prompt=True)),
    "seal": ("seal", dict(alpha0=-1.0, steer_scope="always")),
    "laprox": ("laprox", dict(budget=10, prefill_window=4)),
    # `budget` is unused under a ratio; set small so that planning from it (the B1 mutant) shows at these sizes.
    "laprox-ratio": ("laprox", dict(budget_ratio=0.5, budget=9, prefill_window=4)),
    "laprox-layer": ("laprox", dict(budget_ratio=0.5, budget=9, prefill_window=4, allocation="layer")),
    "laprox-head": ("laprox", dict(budget_ratio=0.5, budget=9, prefill_window=4, granularity="head")),
    "adakv": ("adakv", dict(budget=10, prefill_window=4)),
    "pyramidkv": ("pyramidkv", dict(budget=16, window=2, prefill_window=4, interval=4, phase="both")),
    "pyramidkv-prefill": ("pyramidkv", dict(budget=16, window=2, prefill_window=4, phase="prefill")),
    "pyramidkv-decode": ("pyramidkv", dict(budget=16, window=2, interval=4, phase="decode")),
    "criticalkv": ("criticalkv", dict(budget=10, prefill_window=4)),
    "criticalkv-both": ("criticalkv", dict(budget=16, window=2, prefill_window=4, interval=4, phase="both")),
    "criticalkv_ada": ("criticalkv_ada", dict(budget=10, prefill_window=4)),
    "defensivekv": ("defensivekv", dict(budget=10, prefill_window=4)),
    "layer_defensivekv": ("layer_defensivekv", dict(budget=10, prefill_window=4)),
    "expected_attention": ("expected_attention", dict(budget=16, window=2, interval=4, stats_window=8)),
    "triattention": ("triattention", dict(budget=16, window=2, interval=4, stats_file="@calibrated")),
    "skipkv_tri": ("skipkv_tri", dict(budget=16, window=2, interval=4, stats_file="@calibrated")),
    "kvzip": ("kvzip", dict(budget=10, chunk_size=12)),
    "kvzip-layer": ("kvzip", dict(budget=10, allocation="layer")),
}


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    vec = write_vector(tmp_path_factory.mktemp("steer") / "v.safetensors")
    out = {}
    for key, (name, knobs) in SPECS.items():
        knobs = resolve_contract_knobs(knobs)
        out[key] = make_policy(name, **dict(knobs, steering=vec) if name == "seal" else knobs)
    return out


def test_specs_cover_every_registered_policy():
    assert {name for name, _ in SPECS.values()} == {n for n in POLICIES.names() if not POLICIES.get(n).unavailable}


def drive(bundle, policy, mix, chunk: int, batch: int, cap: int, max_steps: int = 3000):
    """Run `mix` [(prompt ids, max_new_tokens, budget or None, arrival step)] under `cap` bytes, asserting after
    every step that the store never allocated more and, at the end, that every request finished with all its
    tokens. Returns (the store's peak allocated bytes, results by request id). Public API only."""
    results: dict = {}
    want: dict[str, int] = {}  # request id -> max_new_tokens
    with Engine(bundle, policy, EngineConfig(batch_size=batch, prefill_chunk=chunk, kv_memory=cap)) as eng:
        store = eng.runner.store
        step = 0
        while step <= max(a for *_, a in mix) or eng.has_unfinished():
            for ids_, n, budget, at in mix:
                if at == step:
                    want[eng.add_request(ids_, SamplingParams(max_new_tokens=n, ignore_eos=True), budget=budget)] = n
            out = eng.step()
            # peak_allocated also sees reshapes inside the step (admission, each prefill chunk).
            assert store.peak_allocated <= cap, f"step {step}: allocated {store.peak_allocated} > cap {cap}"
            assert out.stats.kv_allocated_bytes <= cap and out.stats.kv_reserved_bytes <= cap
            assert out.stats.kv_held_bytes <= out.stats.kv_allocated_bytes
            for res in out.finished:
                results[res.request_id] = res
            step += 1
            assert step < max_steps, "requests did not finish"
        peak = store.peak_allocated
    assert {i: r.generated_tokens for i, r in results.items()} == want
    return peak, results


def alone_bytes(bundle, policy, mix, chunk: int) -> int:
    """The most K/V bytes any request of `mix` may need when admitted alone (its Plan)."""
    from skipkv.engine.engine import new_request
    from skipkv.engine.memory import KVMemory, plan

    with Engine(bundle, policy) as eng:
        store = eng.runner.store
        memory = KVMemory(store.num_layers, store.bytes_per_entry, chunk, heads=store.split)
    out = 0
    for i, (ids, n, budget, _) in enumerate(mix):
        r = new_request(bundle, ids, SamplingParams(max_new_tokens=n, ignore_eos=True), policy, i, eos_ids(bundle),
                        "x", budget)
        out = max(out, memory.store_bytes(1, plan(r, memory.num_layers, chunk, memory.heads).alone))
    return out


@st.composite
def mixes(draw):
    mix = []
    for _ in range(draw(st.integers(2, 4))):
        P = draw(st.integers(10, 32))
        ids = draw(st.lists(st.integers(3, 250), min_size=P, max_size=P))
        budget = draw(st.one_of(st.none(), st.integers(6, 14)))
        mix.append((ids, draw(st.integers(1, 8)), budget, draw(st.integers(0, 4))))
    chunk = draw(st.sampled_from([0, 4, 7]))
    batch = draw(st.integers(2, 4))
    slack = draw(st.sampled_from([1.0, 1.4, 2.5]))
    return mix, chunk, batch, slack


@pytest.mark.parametrize("key", sorted(SPECS))
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=mixes())
def test_allocated_bytes_never_exceed_the_cap(tiny, policies, key, case):
    """Random request mixes under a cap of 1-2.5x the largest request's own bound: never above the cap, all finish."""
    mix, chunk, batch, slack = case
    policy = policies[key]
    chunk = chunk if policy.chunked_prefill else 0  # a policy that scores the whole prompt refuses chunks
    # A per-request budget the policy cannot run (above its budget for that prompt, or too small for its
    # protected tokens) is refused with a one-line error; those requests run without one.
    fixed = []
    for ids, n, budget, at in mix:
        try:
            policy.for_request(len(ids), budget)
        except SkipKVError:
            budget = None
        fixed.append((ids, n, budget, at))
    drive(tiny, policy, fixed, chunk, batch, int(alone_bytes(tiny, policy, fixed, chunk) * slack))


def _prompt(P: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (P,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_b1_ratio_with_chunked_prefill_stays_within_the_cap(tiny):
    """B1: with budget_ratio and chunked prefill the old scheduler staged the default budget (128), not the
    ratio's: a 300-token prompt at ratio 0.5 (150 entries per layer on average) in 32-token chunks was admitted
    under a cap of its reservation (150 + 10 entries per layer) and the store went past it. Now a request is
    admitted only under a cap that covers what its layers may stage (each may keep up to the whole prompt):
    it is refused under that cap, and runs within any cap it is admitted under."""
    policy = make_policy("laprox", budget_ratio=0.5, prefill_window=8)
    ids, sp = _prompt(300, 0), SamplingParams(max_new_tokens=10, ignore_eos=True)
    with Engine(tiny, policy) as eng:
        entry = eng.runner.entry_bytes  # bytes of one entry in every layer
    cap = (150 + 10) * entry
    with Engine(tiny, policy, EngineConfig(prefill_chunk=32, kv_memory=cap)) as eng:
        try:
            eng.add_request(ids, sp)
        except SkipKVError as e:
            assert "kv_memory" in str(e)
        while eng.has_unfinished():
            eng.step()
            assert eng.runner.store.peak_allocated <= cap
    mix = [(ids, 10, None, 0)]
    peak, _ = drive(tiny, policy, mix, chunk=32, batch=2, cap=alone_bytes(tiny, policy, mix, 32))
    assert peak > cap  # what it really stages: more than the old reservation


def test_a_reservation_from_policy_budget_is_caught(tiny, monkeypatch):
    """The mutant that B1 was: LaProx's staging planned from `policy.budget` (the unused default, 128) instead
    of what its layers keep under the ratio (150 per layer on average). The cap check sees the store pass the cap."""
    monkeypatch.setattr(LaProx, "prefill_keep", lambda self, L, P, prefix: [self.budget] * L)
    policy = make_policy("laprox", budget_ratio=0.5, prefill_window=8)
    mix = [(_prompt(300, 0), 10, None, 0)]
    with pytest.raises(AssertionError, match="> cap"):
        drive(tiny, policy, mix, chunk=32, batch=2, cap=alone_bytes(tiny, policy, mix, 32))


def test_b2_layers_split_differently_by_two_requests(tiny):
    """B2: two LaProx requests whose model-wide selections keep different layers long ([54, 46] and [47, 53]
    of 100 prompt tokens at ratio 0.5). The store sizes each layer by its longest slot, so the two cost more
    than twice one request's average; the old admission (every layer at one reservation, 50 + 52 entries)
    let both in under a cap of two reservations and the store passed it."""
    policy = make_policy("laprox", budget_ratio=0.5, prefill_window=4)
    prompts = [_prompt(100, 11), _prompt(100, 15)]
    kept = [r.layer_kv_tokens for r in generate(tiny, prompts, SamplingParams(max_new_tokens=1), policy)]
    assert (kept[0][0] - kept[0][1]) * (kept[1][0] - kept[1][1]) < 0  # the splits differ (else the test is void)
    with Engine(tiny, policy) as eng:
        entry = eng.runner.entry_bytes
    drive(tiny, policy, [(p, 52, None, 0) for p in prompts], chunk=0, batch=2, cap=2 * (50 + 52) * entry)


def test_b3_per_request_budget_under_a_ratio(tiny):
    """B3: a per-request budget under budget_ratio was silently ignored (the ratio ran). It now replaces the
    ratio for that request (tokens per layer on average), at most the ratio's budget for that prompt."""
    policy = make_policy("laprox", budget_ratio=0.5, prefill_window=4)
    ids = _prompt(80, 5)
    L = tiny.model.config.num_hidden_layers
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = generate(tiny, [ids], sp, make_policy("laprox", budget=12, prefill_window=4))[0]
    with Engine(tiny, policy) as eng:
        low = eng.add_request(ids, sp, budget=12)
        same = eng.add_request(ids, sp)
        res = {}
        while eng.has_unfinished():
            res.update({r.request_id: r for r in eng.step().finished})
        assert sum(res[low].layer_kv_tokens) == 12 * L + 2 * L  # kept + the 2 decoded tokens, every layer
        assert res[low].token_ids == want.token_ids and res[low].layer_kv_tokens == want.layer_kv_tokens
        assert sum(res[same].layer_kv_tokens) == 40 * L + 2 * L
        for bad in (41, 3, 0):  # above 0.5 x 80 = 40; below prefill_window + sink; not positive
            with pytest.raises(SkipKVError, match="budget"):
                eng.add_request(ids, sp, budget=bad)


def test_a_prefill_after_a_decode_in_one_step_counts_what_was_fed(tiny):
    """Found by the property test: in one engine step the running requests decode (feeding a token whose
    sampled successor is added only at the end of the step), then a newly admitted prompt is staged. Sizing
    from outputs alone counted one entry too many per running request there (40 entries allocated under a
    38-entry cap); the need is counted from what each request has fed."""
    mix = [(_prompt(10, 1), 1, None, 1), (_prompt(10, 2), 1, None, 0), (_prompt(32, 3), 7, None, 0),
           (_prompt(17, 4), 3, None, 0)]
    policy = make_policy("full")
    cap = alone_bytes(tiny, policy, mix, 0)
    drive(tiny, policy, mix, 0, 2, cap)
