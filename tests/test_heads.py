"""Head-level KV selection: the head-split store (every (layer, kv head) its own length and capacity), the
engine's head-ragged attention against the reference decoder (tests/refdecoder.py, per-head eviction masks,
eager fp64 attention), Ada-KV's selection against a naive one, LaProx at granularity head through the CLI.

    python -m pytest tests/test_heads.py -q
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from refdecoder import ref_generate
from skipkv import SamplingParams, generate, make_policy
from skipkv.cache import KVStore
from skipkv.cli import main
from skipkv.config import EngineConfig
from skipkv.engine import encode_prompt
from skipkv.engine.runner import ModelRunner
from skipkv.errors import SkipKVError
from skipkv.models import load_model

PROMPTS = [
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "The quick brown fox jumps over the lazy dog; the dog sleeps on.",
    "In the beginning the Universe was created.",
]
MAX_NEW = [24, 18, 20]


@pytest.fixture(scope="module")
def sharp():
    return load_model("random:qwen2:sharp", dtype="fp64")


def unit_positions(store: KVStore, slot: int) -> list[list[list[int]]]:
    """True positions each (layer, kv head) of `slot` holds, [L][H] lists, for either store layout."""
    out = []
    for l in range(store.model_layers):
        row = []
        for h in range(store.model_kv_heads):
            u, hh = (l * store.split + h, 0) if store.head_split else (l, h)
            row.append(store.pos[u][slot, hh, : int(store.lengths[u, slot])].tolist())
        out.append(row)
    return out


def engine_kept(monkeypatch, bundle, policy, prompts, max_new, engine: EngineConfig):
    """Run the engine; per request the positions kept by each (layer, kv head) after each compression."""
    kept: dict[int, list] = {i: [] for i in range(len(prompts))}
    original = ModelRunner.compress

    def spy(self, rows, is_prefill):
        original(self, rows, is_prefill)
        for s, r in rows:
            kept[r.index].append(unit_positions(self.store, s))

    monkeypatch.setattr(ModelRunner, "compress", spy)
    sps = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in max_new]
    results = generate(bundle, prompts, sps, policy, engine)
    monkeypatch.setattr(ModelRunner, "compress", original)
    return results, kept


# ------------------------------------------------------------------------------------------- the store
def test_head_split_store_allocates_what_each_head_keeps():
    torch.manual_seed(0)
    L, S, H, D = 2, 2, 3, 4
    store = KVStore(L, S, H, D, 10, torch.float32, head_split=True)
    assert (store.num_layers, store.num_kv_heads, store.split) == (L * H, 1, H)
    assert store.lengths.shape == (L * H, S)
    k, v = torch.randn(S, 1, 10, D), torch.randn(S, 1, 10, D)
    pos = torch.arange(10)[None].expand(S, -1)
    for u in range(L * H):
        store.append(u, 0, k, v, pos)
    store.advance(0, torch.tensor([10, 10]))
    # unit 1 (layer 0, head 1) keeps 3 entries in both slots, unit 4 (layer 1, head 1) keeps 7
    store.compact(1, torch.tensor([0, 1]), torch.tensor([[[1, 4, 8]]] * 2))
    store.compact(4, torch.tensor([0, 1]), torch.tensor([[[0, 1, 2, 3, 5, 6, 9]]] * 2))
    assert store.head_lengths(0) == [[10, 3, 10], [10, 7, 10]]
    assert store.k[1][0, 0, :3].tolist() == k[0, 0, [1, 4, 8]].tolist()
    caps = store.lengths.amax(dim=1).tolist()
    store.resize(caps)
    per_head_entry = 2 * D * 4
    assert store.bytes_per_entry == per_head_entry
    assert store.allocated_bytes() == S * (4 * 10 + 3 + 7) * per_head_entry  # no head padded to its layer's 10
    assert store.held_bytes(0) == (4 * 10 + 3 + 7) * per_head_entry
    with pytest.raises(ValueError):
        store.resize([c - 1 if u == 4 else c for u, c in enumerate(caps)])


def test_split_heads_copies_a_uniform_store():
    torch.manual_seed(1)
    L, S, H, D = 2, 2, 2, 4
    uni = KVStore(L, S, H, D, 6, torch.float64, aux=("x",))
    for l in range(L):
        uni.append(l, 0, torch.randn(S, H, 5, D), torch.randn(S, H, 5, D), torch.arange(5)[None].expand(S, -1))
        uni.aux["x"][l].normal_()
    uni.advance(0, torch.tensor([5, 3]))
    split = uni.split_heads()
    assert split.head_split and split.lengths.shape == (L * H, S)
    for l in range(L):
        for h in range(H):
            u = l * H + h
            assert torch.equal(split.k[u][:, 0], uni.k[l][:, h]) and torch.equal(split.v[u][:, 0], uni.v[l][:, h])
            assert torch.equal(split.pos[u][:, 0], uni.pos[l][:, h])
            assert torch.equal(split.aux["x"][u][:, 0], uni.aux["x"][l][:, h])
            assert split.lengths[u].tolist() == uni.lengths[l].tolist()
    assert split.allocated_bytes() == uni.allocated_bytes()
    assert split.head_lengths(1) == uni.head_lengths(1) == [[3, 3], [3, 3]]


# ------------------------------------------------------------------------------------------- Ada-KV
ADAKV = dict(name="adakv", budget=12, prefill_window=6, kernel=5, variant="paper", group_reduce="mean",
             floor_ratio=0.2, window=4, interval=128, phase="prefill")


def policy_of(spec: dict):
    return make_policy(spec["name"], **{k: v for k, v in spec.items() if k != "name"})


@pytest.mark.parametrize("batch", [1, 2])
def test_adakv_matches_the_reference_and_heads_keep_different_counts(monkeypatch, sharp, batch):
    """What each head keeps equals the naive Ada-KV selection (refdecoder.ref_adakv), and the tokens generated
    over the head-ragged cache equal the reference decoder's eager attention with per-head masks, token for
    token (batch 2: rows of different lengths, masked attention, slots refilled)."""
    results, kept = engine_kept(monkeypatch, sharp, policy_of(ADAKV), PROMPTS, MAX_NEW, EngineConfig(batch_size=batch))
    ragged = 0
    for i, (prompt, m) in enumerate(zip(PROMPTS, MAX_NEW)):
        ids = encode_prompt(sharp.tokenizer, prompt)
        tokens, events, _ = ref_generate(sharp, ids, m, ADAKV)
        assert len(kept[i]) == len(events) == 1, f"prompt {i}: one prefill compression"
        assert kept[i][0] == events[0][2], f"prompt {i}: kept positions differ"
        assert results[i].token_ids == tokens, f"prompt {i}: generated tokens differ"
        for layer in kept[i][0]:
            assert sum(len(h) for h in layer) == ADAKV["budget"] * len(layer)
            ragged += len({len(h) for h in layer}) > 1
        assert [[len(h) + m - 1 for h in layer] for layer in kept[i][0]] == results[i].head_kv_tokens
    assert ragged >= 3, "the heads of a layer should keep different counts"


def test_adakv_floor_keeps_a_starved_head(monkeypatch, sharp):
    # With the floor at its full share every head keeps exactly the budget: the floor is enforced.
    spec = dict(ADAKV, floor_ratio=1.0)
    _, kept = engine_kept(monkeypatch, sharp, policy_of(spec), PROMPTS[:1], [2], EngineConfig())
    assert {len(h) for layer in kept[0][0] for h in layer} == {spec["budget"]}
    ids = encode_prompt(sharp.tokenizer, PROMPTS[0])
    assert kept[0][0] == ref_generate(sharp, ids, 2, spec)[1][0][2]


def test_adakv_chunked_prefill_and_memory_cap(sharp):
    """Chunked prefill recompresses per chunk; under a KV cap the store never allocates more than the cap, and
    batched rows equal single runs."""
    policy = make_policy("adakv", budget=12, prefill_window=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (60, 41, 75)]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = [generate(sharp, [p], sp, policy, EngineConfig(prefill_chunk=16))[0] for p in prompts]
    cap = 3 * max(r.allocated_kv_bytes for r in alone)
    batched = generate(sharp, prompts, sp, policy, EngineConfig(batch_size=3, prefill_chunk=16, kv_memory=cap))
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids and a.head_kv_tokens == b.head_kv_tokens
        assert a.compressions >= 2, "every chunk past the budget recompresses"


@pytest.mark.parametrize("knobs", [dict(floor_ratio=1.5), dict(phase="both"), dict(budget=6, prefill_window=6),
                                   dict(protect_prompt=True)])
def test_adakv_bad_knobs_are_refused(knobs):
    with pytest.raises(SkipKVError):
        make_policy("adakv", **knobs)


# ------------------------------------------------------------------------------------------- LaProx, head level
def test_laprox_head_attention_matches_the_reference(monkeypatch, sharp):
    """LaProx at granularity head keeps different counts per head; given what it kept, generation over the
    head-ragged cache equals the reference decoder's (per-head masks, eager fp64) token for token."""
    policy = make_policy("laprox", budget_ratio=0.4, prefill_window=4, granularity="head")
    results, kept = engine_kept(monkeypatch, sharp, policy, PROMPTS, MAX_NEW, EngineConfig(batch_size=2))
    for i, (prompt, m) in enumerate(zip(PROMPTS, MAX_NEW)):
        ids = encode_prompt(sharp.tokenizer, prompt)
        [units] = kept[i]
        assert len({len(h) for layer in units for h in layer}) > 1
        assert sum(len(h) for layer in units for h in layer) == round(0.4 * len(ids)) * 4
        spec = dict(name="given", kept=units, budget=0, interval=10**6, phase="prefill")
        assert results[i].token_ids == ref_generate(sharp, ids, m, spec)[0], f"prompt {i}: generated tokens differ"


def test_generate_cli_reports_head_counts_and_real_bytes(capsys):
    words = " ".join(f"w{i}" for i in range(60))
    code = main(["generate", "--model", "random:qwen2", "--dtype", "fp32", "--policy", "laprox", "--granularity",
                 "head", "--budget-ratio", "0.3", "--prefill-window", "4", "--max-new-tokens", "3", "--ignore-eos",
                 "--raw", "--json", words])
    out, err = capsys.readouterr()
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    heads = row["head_kv_tokens"]  # [L][H], after 2 decode steps fed 2 tokens
    assert len(heads) == 2 and all(len(h) == 2 for h in heads)
    assert len({n for layer in heads for n in layer}) > 1, "heads keep different counts"
    kept = sum(n - 2 for layer in heads for n in layer)
    assert kept == round(0.3 * row["prompt_tokens"]) * 2 * 2
    D = 64 // 4
    assert row["allocated_kv_bytes"] == sum(n for layer in heads for n in layer) * 2 * D * 4  # K+V fp32, one head
    assert row["layer_kv_tokens"] == [round(sum(layer) / 2) for layer in heads]


def test_bench_decode_compares_head_split_and_uniform_at_equal_kept_tokens(tmp_path, capsys):
    out = tmp_path / "d.json"
    specs = "laprox:budget_ratio=0.5,prefill_window=4;laprox:budget_ratio=0.5,prefill_window=4,granularity=head"
    code = main(["bench", "decode", "--model", "random:qwen2", "--dtype", "fp32", "--threads", "1", "--policies",
                 specs, "--prompt-tokens", "40", "--lengths", "3,5", "--span", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["prompt_tokens"] == 40
    layer, head = report["runs"]
    assert (layer["policy"], head["policy"]) == tuple(specs.split(";"))
    # the same entries per (layer, kv head) on average: 20 kept of the 40-token prompt, + 4 decoded
    assert layer["kv_tokens"] == head["kv_tokens"] == {"3": 22, "5": 24}
    assert head["allocated_peak_bytes"] > 0


@pytest.mark.parametrize("knobs", [dict(name="adakv", budget=12, prefill_window=4, floor_ratio=0.0),
                                   dict(name="laprox", budget_ratio=0.3, prefill_window=4, granularity="head")])
@pytest.mark.parametrize("chunk", [0, 16])
def test_every_head_stays_within_its_planned_bounds(sharp, knobs, chunk):
    """What each (layer, kv head) holds after every prefill chunk never exceeds what memory.py planned for it
    (the per-unit bounds admission relies on), and some head holds more than the per-head budget."""
    from skipkv.engine import make_requests
    from skipkv.models.patches import routed

    policy = policy_of(knobs)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 45)]
    reqs = make_requests(sharp, prompts, SamplingParams(max_new_tokens=3, ignore_eos=True), policy)
    runner = ModelRunner(sharp, policy, num_slots=2, prefill_chunk=chunk)
    over = False
    with routed(sharp.model), torch.inference_mode():
        runner.start_cohort(reqs)
        step, done = 0, []
        while not done:
            done = runner.prefill_step()[1]
            step += 1
            for i, r in enumerate(reqs):
                assert r.plan is not None
                held = runner.store.lengths[:, i]
                bound = r.plan.held[min(step, len(r.plan.held) - 1)]
                assert (held <= bound).all(), f"request {i} after chunk {step}: {held.tolist()} > {bound.tolist()}"
                assert (held <= r.plan.capacity).all()
                per_head = knobs.get("budget") or round(knobs["budget_ratio"] * r.prompt_len)
                over |= bool((held > per_head).any())
    assert over, "a head should keep more than the per-head budget (else the bounds are not exercised)"


def test_trace_records_what_each_head_kept(monkeypatch, sharp):
    """`generate(..., trace=True)` on a head-split store: per (layer, kv head), the prompt positions never
    evicted are exactly what that head kept (a head's padding up to its layer's longest is not counted)."""
    from skipkv.engine.trace import decode_evicted

    _, kept = engine_kept(monkeypatch, sharp, policy_of(ADAKV), PROMPTS[:1], [3], EngineConfig())
    [res] = generate(sharp, PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True), policy_of(ADAKV),
                     trace=True)
    assert res.trace is not None
    ev = decode_evicted(res.trace)  # [L, H, T]
    P = res.prompt_tokens
    got = [[[p for p in range(P) if ev[l, h, p] < 0] for h in range(ev.shape[1])] for l in range(ev.shape[0])]
    assert got == kept[0][0]


def test_each_head_masks_with_its_own_lengths_when_key_counts_match():
    """Two kv heads of one layer whose rows hold swapped counts (head 0: 5 and 3 entries, head 1: 3 and 5) need
    the same number of keys but different masks: every (row, query head) must attend exactly the entries its
    own kv head holds plus the new one, as a per-head softmax over those entries computes it."""
    from skipkv.attention import StepContext, _head_split_attention

    torch.manual_seed(0)
    S, H, G, D, cap = 2, 2, 2, 8, 8
    store = KVStore(1, S, H, D, cap, torch.float32, head_split=True)
    held = [[5, 3], [3, 5]]  # [head][row], before this decode step
    for u in range(H):
        store.k[u].copy_(torch.randn(S, 1, cap, D) * 3)  # entries past what a row holds are garbage to mask out
        store.v[u].copy_(torch.randn(S, 1, cap, D))
        store.lengths[u] = torch.tensor(held[u])
    q = torch.randn(S, H * G, 1, D)
    ctx = StepContext(store, 0, torch.tensor([1, 1]), torch.tensor([[5], [5]]))
    new_k = torch.cat([store.k[u][:, :, :1] for u in range(H)], dim=1)  # [S, H, 1, D]: only its shape is read
    out, _ = _head_split_attention(ctx, 0, q, new_k, new_k, None)  # [S, 1, Hq, D]
    for b in range(S):
        for qh in range(H * G):
            h = qh // G
            n = held[h][b] + 1  # what the row holds in this head, and the new entry at its end
            k, v = store.k[h][b, 0, :n], store.v[h][b, 0, :n]
            want = torch.softmax(q[b, qh, 0] @ k.T * D**-0.5, dim=-1) @ v
            torch.testing.assert_close(out[b, 0, qh], want)
