"""LaProx (output-aware, model-wide) and PyramidKV (per-layer budgets): scores against naive loops, the model-wide
selection against a naive global sort, the engine invariants with layers of different lengths, real bytes."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from skipkv import SamplingParams, generate, load_model, make_policy
from skipkv.cli import main
from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.policies.laprox import model_wide_select, normalize_scores, output_scores


@pytest.fixture(scope="module")
def sharp():
    return load_model("random:qwen2:sharp", dtype="fp64")


def ragged_prompts(vocab: int, lens=(110, 67, 84), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


# ------------------------------------------------------------------------------------------- the score
def ref_scores(q, k, v, W, norm, scale):
    """Naive loop over rows, tokens, heads and window queries: the norm of the summed output (sum) or of the
    per-query output matrix (frobenius) that token i contributes to the layer after o_proj."""
    b, Hq, w, D = q.shape
    H, n = k.shape[1], k.shape[2]
    G = Hq // H
    E = W.shape[0]
    out = torch.zeros(b, n, dtype=torch.float64)
    for bi in range(b):
        A = torch.zeros(Hq, w, n, dtype=torch.float64)
        for h in range(Hq):
            for j in range(w):
                last = n - w + j  # query j is the token at key index n - w + j: it sees keys 0..last
                logits = [float(q[bi, h, j] @ k[bi, h // G, t]) * scale for t in range(last + 1)]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                for t in range(last + 1):
                    A[h, j, t] = math.exp(logits[t] - m) / z
        for i in range(n):
            vec = torch.zeros(E, dtype=torch.float64)
            mat = torch.zeros(w, E, dtype=torch.float64)
            for h in range(Hq):
                u = W[:, h * D:(h + 1) * D] @ v[bi, h // G, i]  # V_{g(h),i} W_O^h
                for j in range(w):
                    vec += A[h, j, i] * u
                    mat[j] += A[h, j, i] * u
            out[bi, i] = vec.norm() if norm == "sum" else mat.norm()
    return out


@pytest.mark.parametrize("norm", ["sum", "frobenius"])
@pytest.mark.parametrize("Hq,H", [(4, 2), (3, 3)])  # GQA (G = 2) and plain multi-head
def test_output_scores_match_naive_loop(norm, Hq, H):
    torch.manual_seed(1)
    b, w, n, D, E = 2, 3, 7, 4, 5
    q = torch.randn(b, Hq, w, D, dtype=torch.float64) * 2
    k = torch.randn(b, H, n, D, dtype=torch.float64)
    v = torch.randn(b, H, n, D, dtype=torch.float64)
    W = torch.randn(E, Hq * D, dtype=torch.float64)
    got = output_scores(q, k, v, W, norm, scale=0.7, chunk=3)  # chunk < n: the chunked Gram path
    torch.testing.assert_close(got, ref_scores(q, k, v, W, norm, 0.7))


def test_heads_interact_before_the_norm():
    # Two heads whose projected values cancel: their sum has norm 0, the sum of per-head norms does not.
    q = torch.zeros(1, 2, 1, 1, dtype=torch.float64)
    k = torch.zeros(1, 1, 2, 1, dtype=torch.float64)
    v = torch.ones(1, 1, 2, 1, dtype=torch.float64)
    W = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    for norm in ("sum", "frobenius"):
        assert output_scores(q, k, v, W, norm).abs().max() < 1e-12


def test_normalizations():
    s = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    torch.testing.assert_close(normalize_scores(s, "sum"), s / 12)
    z = normalize_scores(s, "zscore")
    assert abs(float(z.mean())) < 1e-12 and abs(float(z.std(unbiased=False)) - 1) < 1e-9
    assert torch.equal(normalize_scores(s, "none"), s)


# ------------------------------------------------------------------------------------------- the selection
def ref_select(scores, total, sink, window, floor):
    lens = [len(s) for s in scores]
    if sum(lens) <= total:
        return None
    kept, pool = [], []
    for l, s in enumerate(scores):
        n = len(s)
        prot = set(range(min(sink, n))) | set(range(max(n - window, 0), n))
        cand = sorted((i for i in range(n) if i not in prot), key=lambda i: (-s[i], i))
        extra = max(floor - len(prot), 0)
        kept.append(prot | set(cand[:extra]))
        pool += [(-s[i], l, i) for i in cand[extra:]]
    left = total - sum(len(k) for k in kept)
    for _, l, i in sorted(pool)[:left]:
        kept[l].add(i)
    return [sorted(k) for k in kept]


@pytest.mark.parametrize("seed", range(6))
def test_model_wide_select_matches_global_sort(seed):
    rng = random.Random(seed)
    lens = [rng.randrange(5, 30) for _ in range(rng.randrange(2, 6))]
    # Rounded scores: ties across layers and within a layer are common, and must break the same way.
    scores = [[round(rng.gauss(0, 1), 1) for _ in range(n)] for n in lens]
    sink, window, floor = rng.randrange(0, 3), rng.randrange(1, 4), rng.randrange(0, 8)
    prot = sum(max(min(sink + window, n), min(floor, n)) for n in lens)
    total = rng.randrange(prot, sum(lens) + 3)
    got = model_wide_select([torch.tensor(s, dtype=torch.float64) for s in scores], total, sink, window, floor)
    want = ref_select(scores, total, sink, window, floor)
    assert (got is None) == (want is None)
    if got is not None:
        assert [g.tolist() for g in got] == want
        assert sum(len(g) for g in got) == total


def test_model_wide_select_floor_keeps_a_weak_layer():
    # Layer 1 scores below every token of layer 0: without the floor it would keep only its window.
    s0 = torch.linspace(10, 11, 20, dtype=torch.float64)
    s1 = torch.linspace(-11, -10, 20, dtype=torch.float64)
    keep = model_wide_select([s0, s1], total=20, sink=0, window=2, floor=6)
    assert [len(k) for k in keep] == [14, 6]
    assert keep[1].tolist() == [14, 15, 16, 17, 18, 19]  # its 4 best candidates (the newest) + the window
    assert [len(k) for k in model_wide_select([s0, s1], total=20, sink=0, window=2, floor=0)] == [18, 2]


def test_model_wide_select_rejects_a_budget_below_the_protected_tokens():
    with pytest.raises(SkipKVError, match="protected"):
        model_wide_select([torch.zeros(20), torch.zeros(20)], total=10, sink=2, window=4, floor=0)


# ------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("name,knobs", [
    ("laprox", dict(budget_ratio=0.25, prefill_window=8, sink=2)),
    pytest.param("laprox", dict(budget=30, prefill_window=8, norm="frobenius", normalize="sum", kernel=3),
                 marks=pytest.mark.slow),
    ("pyramidkv", dict(budget=36, prefill_window=8, interval=8)),
])
def test_batch_equals_singles_sharp(sharp, name, knobs):
    policy = make_policy(name, **knobs)
    prompts = ragged_prompts(sharp.model.config.vocab_size)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batched = generate(sharp, prompts, sp, policy, EngineConfig(batch_size=3))
    full = generate(sharp, prompts, sp, make_policy("full"), EngineConfig(batch_size=3))
    assert any(r.token_ids != f.token_ids for r, f in zip(batched, full)), "the budget should change the output"
    for prompt, res in zip(prompts, batched):
        alone = generate(sharp, [prompt], sp, policy)[0]
        assert res.token_ids == alone.token_ids
        assert res.layer_kv_tokens == alone.layer_kv_tokens
        assert res.compressions == alone.compressions > 0
    assert any(len(set(r.layer_kv_tokens)) > 1 for r in batched), "layers should end at different lengths"


def test_laprox_keeps_the_model_wide_budget_and_protected_tokens(sharp):
    from skipkv.engine import make_requests
    from skipkv.engine.runner import ModelRunner
    from skipkv.models.patches import routed

    policy = make_policy("laprox", budget_ratio=0.2, prefill_window=8, sink=3, min_layer_tokens=15)
    prompts = ragged_prompts(sharp.model.config.vocab_size, (150, 97))
    reqs = make_requests(sharp, prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), policy)
    runner = ModelRunner(sharp, policy, num_slots=2)
    store = runner.store
    with routed(sharp.model), torch.inference_mode():
        runner.prefill(reqs)
    L = store.num_layers
    for s, r in enumerate(reqs):
        lengths = store.lengths[:, s]
        assert int(lengths.sum()) == round(0.2 * r.prompt_len) * L
        assert int(lengths.min()) >= 15
        for l in range(L):
            pos = store.pos[l][s, :, : int(lengths[l])]
            assert (pos == pos[:1]).all(), "all kv heads of a layer keep the same tokens"
            kept = set(pos[0].tolist())
            assert set(range(3)) <= kept and set(range(r.prompt_len - 8, r.prompt_len)) <= kept
            assert (pos[0, 1:] > pos[0, :-1]).all()
    # Real bytes: each layer's capacity is the most any slot keeps there plus the decode growth (4 new tokens,
    # of which the last is never fed: 3 more entries).
    want = [int(store.lengths[l, :2].max()) + 3 for l in range(L)]
    assert store.capacities == want
    assert store.allocated_bytes() == 2 * sum(want) * store.bytes_per_entry


def test_budget_covering_the_prompt_equals_full(sharp):
    prompts = ragged_prompts(sharp.model.config.vocab_size, (80, 45))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    full = generate(sharp, prompts, sp, make_policy("full"), EngineConfig(batch_size=2))
    for policy in (make_policy("laprox", budget_ratio=1.0, prefill_window=8), make_policy("laprox", budget=80),
                   make_policy("pyramidkv", budget=1000)):
        got = generate(sharp, prompts, sp, policy, EngineConfig(batch_size=2))
        assert [r.token_ids for r in got] == [r.token_ids for r in full]
        assert all(r.compressions == 0 for r in got)


def test_chunked_prefill_compresses_between_chunks(sharp):
    prompt = ragged_prompts(sharp.model.config.vocab_size, (240,))
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    policy = make_policy("laprox", budget_ratio=0.1, prefill_window=8)
    whole = generate(sharp, prompt, sp, policy)[0]
    chunked = generate(sharp, prompt, sp, policy, EngineConfig(prefill_chunk=32))[0]
    L = sharp.model.config.num_hidden_layers
    assert sum(chunked.layer_kv_tokens) == sum(whole.layer_kv_tokens) == (24 + 3) * L
    assert chunked.compressions > 1
    # Peak: the budget plus one staged chunk per layer (whole: the full prompt in every layer).
    cfg = sharp.model.config
    bpe = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8  # K+V, fp64
    assert chunked.peak_kv_bytes <= (24 + 32) * L * bpe
    assert chunked.peak_kv_bytes < whole.peak_kv_bytes


def test_must_show_layer_lengths_and_allocated_bytes(tiny):
    # One request: the store's allocated K/V bytes once it is sized after prefill are exactly the kept entries
    # plus the decode growth still to come per layer (max_new_tokens - 1: the last token is never fed).
    prompt = ragged_prompts(tiny.model.config.vocab_size, (400,))
    res = generate(tiny, prompt, SamplingParams(max_new_tokens=5, ignore_eos=True),
                   make_policy("laprox", budget_ratio=0.1, prefill_window=8))[0]
    L = tiny.model.config.num_hidden_layers
    kept = [n - (res.generated_tokens - 1) for n in res.layer_kv_tokens]
    assert sum(kept) == 40 * L and len(set(kept)) > 1
    cfg = tiny.model.config
    bpe = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8  # K+V, fp64
    assert res.allocated_kv_bytes == (sum(kept) + (res.generated_tokens - 1) * L) * bpe
    assert res.peak_total_bytes > res.peak_kv_bytes


BAD = {
    "budget_below_protected": ["--policy", "laprox", "--budget", "20"],
    "ratio_zero": ["--policy", "laprox", "--budget-ratio", "0"],
    "ratio_above_one": ["--policy", "laprox", "--budget-ratio", "1.5"],
    "ratio_below_protected": ["--policy", "laprox", "--budget-ratio", "0.01"],
    "window_longer_than_prompt": ["--policy", "laprox", "--budget-ratio", "0.5", "--prefill-window", "64"],
    "unknown_normalization": ["--policy", "laprox", "--budget-ratio", "0.1", "--normalize", "minmax"],
    "unknown_norm": ["--policy", "laprox", "--budget-ratio", "0.1", "--norm", "l1"],
    "decode_phase": ["--policy", "laprox", "--phase", "decode"],
    "pyramid_beta": ["--policy", "pyramidkv", "--beta", "0.5"],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2(case, capsys):
    prompt = "x" * 40 if case == "window_longer_than_prompt" else "y" * 300
    code = main(["generate", "--model", "random:qwen2", "--max-new-tokens", "2", "--raw", *BAD[case], prompt])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("skipkv: error:"), err


def test_pyramid_layer_budgets_and_real_lengths(sharp):
    policy = make_policy("pyramidkv", budget=100, prefill_window=8)
    # w = 8; the last layer gets (100 - 8) / 20, the first 2 x 92 minus that, linear in between.
    assert policy.layer_budgets(4) == [187, 129, 71, 13]
    small = make_policy("pyramidkv", budget=30, prefill_window=8, phase="prefill")
    L = sharp.model.config.num_hidden_layers
    res = generate(sharp, ragged_prompts(sharp.model.config.vocab_size, (90,)),
                   SamplingParams(max_new_tokens=3, ignore_eos=True), small)[0]
    assert [n - 2 for n in res.layer_kv_tokens] == small.layer_budgets(L)


# ------------------------------------------------------------------------------------------- fidelity bench
def test_fidelity_layer_output_matches_the_model(tiny):
    """`layer_output` over the full store reproduces what each attention module returned for the window."""
    from skipkv.bench.fidelity import layer_output
    from skipkv.engine.shared import prefill_full
    from skipkv.models.patches import routed

    ids = ragged_prompts(tiny.model.config.vocab_size, (60,))[0]
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, l=l: seen.__setitem__(l, out[0][0, -8:].clone()))
             for l, layer in enumerate(tiny.model.model.layers)]
    try:
        with routed(tiny.model), torch.inference_mode():
            run = prefill_full(tiny, ids, 8)[0]
    finally:
        for h in hooks:
            h.remove()
    s, slot = run.store, torch.tensor([0])
    for l, layer in enumerate(tiny.model.model.layers):
        got = layer_output(layer.self_attn, run.queries.recent(l, slot, 8)[0], torch.arange(52, 60),
                           s.k[l][0, :, :60], s.v[l][0, :, :60], s.pos[l][0, :, :60])
        torch.testing.assert_close(got.double(), seen[l].double())


def test_bench_fidelity_cli(tmp_path, capsys):
    out = tmp_path / "fid.json"
    args = ["bench", "fidelity", "--model", "random:qwen2", "--dataset", "niah", "--lengths", "600",
            "--policies", "streaming_llm,laprox", "--window", "8", "--dtype", "fp32", "--out", str(out)]
    assert main(args + ["--budget-ratio", "1.0"]) == 0
    whole = json.loads(out.read_text())["results"]
    for name in ("streaming_llm", "laprox"):  # nothing evicted: every layer's output is the full cache's
        assert all(abs(c - 1) < 1e-5 for c in whole[name]["600"]["per_layer"])
        assert whole[name]["600"]["needle"] == [1.0] * 2 and whole[name]["600"]["needle_whole"] == [1.0] * 2
    assert main(args + ["--budget-ratio", "0.2"]) == 0
    cut = json.loads(out.read_text())["results"]
    assert all(c < 0.9999 for c in cut["streaming_llm"]["600"]["per_layer"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| laprox | 600 |" in capsys.readouterr().out


def test_kernel_pools_candidate_scores_before_the_global_top_k():
    from dataclasses import dataclass as dc

    from skipkv.policies.base import Observation
    from skipkv.policies.laprox import LaProx

    fixed = [torch.zeros(20, dtype=torch.float64), torch.zeros(20, dtype=torch.float64)]
    fixed[0][10], fixed[1][3] = 5.0, 1.0

    @dc(frozen=True)
    class Fixed(LaProx):  # the score itself is tested above; here only what happens after it
        def layer_scores(self, obs):
            return fixed[obs.layer][None]

    def obs(l):
        x = torch.zeros(1, 1, 20, 2)
        return Observation(l, x, x, torch.zeros(1, 1, 20, dtype=torch.int32), None, None, None, True)

    def keep(**k) -> list:
        return [t[0, 0].tolist() for t in Fixed(budget=3, prefill_window=2, window=1, normalize="none", **k)
                .select_model_wide([obs(0), obs(1)])]
    assert keep() == [[10, 18, 19], [3, 18, 19]]
    assert keep(kernel=3) == [[9, 10, 18, 19], [18, 19]]  # the peak's neighbours tie with it; older first


def test_needle_positions_are_the_answer_tokens():
    from skipkv.bench.fidelity import needle_positions, retention

    tok = load_model("random:qwen2", dtype="fp32").tokenizer
    text = "hay hay The magic number is 48213. more hay, and 48213 again"
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    pos = needle_positions(tok, text, ids, "48213")
    assert tok.decode([ids[i] for i in pos]) == "4821348213"  # both occurrences, nothing else
    assert needle_positions(tok, text, ids[1:], "48213") is None  # ids that are not this text's: no guess
    assert needle_positions(tok, text, ids, "99999") is None

    class Store:  # two layers, two kv heads: layer 0 holds the needle in one head only
        lengths = torch.tensor([[3], [3]])
        pos = [torch.tensor([[[0, 5, 6], [5, 6, 7]]]), torch.tensor([[[5, 6, 7], [5, 6, 7]]])]

    needle = torch.tensor([5, 7])
    assert retention(Store, 0, needle) == (0.75, False)
    assert retention(Store, 1, needle) == (1.0, True)


def test_bench_fidelity_policy_specs_are_checked_before_loading(capsys):
    for spec, msg in (("laprox:kernel=x", "kernel must be int"), ("laprox:nope=1", "no knob 'nope'"),
                      ("full", "keeps the full cache")):
        assert main(["bench", "fidelity", "--model", "random:qwen2", "--policies", spec]) == 2
        assert msg in capsys.readouterr().err




# ------------------------------------------------------------------------------------------- the ablation knobs
def ref_attention_scores(q, k, scale):
    """Naive loop: sum over query heads and window queries of each window query's causal softmax weight on token i."""
    b, Hq, w, D = q.shape
    H, n = k.shape[1], k.shape[2]
    G = Hq // H
    out = torch.zeros(b, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(Hq):
            for j in range(w):
                last = n - w + j
                logits = [float(q[bi, h, j] @ k[bi, h // G, t]) * scale for t in range(last + 1)]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                for t in range(last + 1):
                    out[bi, t] += math.exp(logits[t] - m) / z
    return out


def ref_candidates(s, sink, window, kernel, how):
    """Naive: each candidate takes the max over the candidates within kernel // 2 of it, then the candidates are
    normalised among themselves (population z-score, share of the sum, or unchanged)."""
    n = len(s)
    lo, hi = min(sink, n), max(n - window, min(sink, n))
    out = list(s)
    pooled = [max(s[j] for j in range(max(lo, i - kernel // 2), min(hi, i + kernel // 2 + 1))) for i in range(lo, hi)]
    if pooled and how == "zscore":
        mu = sum(pooled) / len(pooled)
        sd = math.sqrt(sum((x - mu) ** 2 for x in pooled) / len(pooled))
        pooled = [(x - mu) / (sd + 1e-12) for x in pooled]
    elif pooled and how == "sum":
        pooled = [x / sum(pooled) for x in pooled]
    out[lo:hi] = pooled
    return out


def ref_layer_select(scores, per_layer, sink, window):
    """Naive: per layer, the protected entries plus the best others (ties: older), per_layer in all."""
    if all(len(s) <= per_layer for s in scores):
        return None
    out = []
    for s in scores:
        n = len(s)
        prot = set(range(min(sink, n))) | set(range(max(n - window, 0), n))
        cand = sorted((i for i in range(n) if i not in prot), key=lambda i: (-s[i], i))
        out.append(sorted(prot | set(cand[: max(per_layer - len(prot), 0)])) if n > per_layer else list(range(n)))
    return out


@pytest.mark.parametrize("Hq,H", [(4, 2), (3, 3)])
def test_attention_scores_match_naive_loop(Hq, H):
    from skipkv.policies.laprox import attention_scores

    torch.manual_seed(2)
    q = torch.randn(2, Hq, 3, 4, dtype=torch.float64) * 2
    k = torch.randn(2, H, 7, 4, dtype=torch.float64)
    torch.testing.assert_close(attention_scores(q, k, scale=0.7), ref_attention_scores(q, k, 0.7))


@pytest.mark.parametrize("seed", range(8))
def test_candidate_scores_match_naive_pooling_and_normalisation(seed):
    from skipkv.policies.laprox import candidate_scores

    rng = random.Random(seed)
    n = rng.randrange(1, 25)
    s = [rng.gauss(0, 1) for _ in range(n)]
    sink, window, kernel = rng.randrange(0, 4), rng.randrange(1, 5), rng.choice([1, 3, 5, 7])
    how = rng.choice(["zscore", "sum", "none"])
    if how == "sum":
        s = [abs(x) + 0.01 for x in s]
    got = candidate_scores(torch.tensor(s, dtype=torch.float64), sink, window, kernel, how)
    torch.testing.assert_close(got, torch.tensor(ref_candidates(s, sink, window, kernel, how), dtype=torch.float64))


@pytest.mark.parametrize("seed", range(6))
def test_layer_select_matches_per_layer_sort(seed):
    from skipkv.policies.laprox import layer_select

    rng = random.Random(seed)
    lens = [rng.randrange(5, 30) for _ in range(rng.randrange(1, 5))]
    scores = [[round(rng.gauss(0, 1), 1) for _ in range(n)] for n in lens]  # ties within a layer
    sink, window = rng.randrange(0, 3), rng.randrange(1, 4)
    per_layer = rng.randrange(sink + window, max(lens) + 3)
    got = layer_select([torch.tensor(s, dtype=torch.float64) for s in scores], per_layer, sink, window)
    want = ref_layer_select(scores, per_layer, sink, window)
    assert (got is None) == (want is None)
    if got is not None:
        assert [g.tolist() for g in got] == want


VARIANTS = [dict(scoring=s, allocation=a, kernel=k, granularity=g) for s in ("output", "attention")
            for a in ("model", "layer") for k in (1, 7) for g in ("layer", "head")]


@pytest.fixture(scope="module")
def ablation_kept(sharp):
    """Per variant, the positions each layer kept after the engine's prefill, and the naive pipeline's choice
    (naive scores from the full prefill's window queries and keys, naive pooling, normalisation and top-k)."""
    from skipkv.engine import make_requests
    from skipkv.engine.runner import ModelRunner
    from skipkv.engine.shared import prefill_full
    from skipkv.models.patches import routed

    ratio, window, sink = 0.2, 8, 2
    # seed 1: every model-wide variant splits the two layers unevenly, so allocation=layer keeps other tokens
    ids = ragged_prompts(sharp.model.config.vocab_size, (120,), seed=1)[0]
    P, layers = len(ids), sharp.model.model.layers
    with routed(sharp.model), torch.inference_mode():
        full = prefill_full(sharp, ids, window)[0]
        raw = {"output": [], "attention": []}
        for l, layer in enumerate(layers):
            q = full.queries.recent(l, torch.tensor([0]), window)[0][None]  # [1, Hq, w, D]
            k, v = full.store.k[l][:1, :, :P], full.store.v[l][:1, :, :P]
            scale = layer.self_attn.scaling
            raw["output"].append(ref_scores(q, k, v, layer.self_attn.o_proj.weight, "sum", scale)[0].tolist())
            raw["attention"].append(ref_attention_scores(q, k, scale)[0].tolist())
        H = sharp.model.config.num_key_value_heads
        G = sharp.model.config.num_attention_heads // H
        D = full.store.head_dim
        head_raw: dict = {"output": [], "attention": []}  # per (layer, kv head): its query heads only
        for l, layer in enumerate(layers):
            q = full.queries.recent(l, torch.tensor([0]), window)[0][None]
            scale, W = layer.self_attn.scaling, layer.self_attn.o_proj.weight
            for h in range(H):
                qh, k, v = q[:, h * G:(h + 1) * G], full.store.k[l][:1, h:h + 1, :P], full.store.v[l][:1, h:h + 1, :P]
                Wh = W[:, h * G * D:(h + 1) * G * D]
                head_raw["output"].append(ref_scores(qh, k, v, Wh, "sum", scale)[0].tolist())
                head_raw["attention"].append(ref_attention_scores(qh, k, scale)[0].tolist())
        out = {}
        for knobs in VARIANTS:
            policy = make_policy("laprox", budget_ratio=ratio, prefill_window=window, sink=sink, **knobs)
            runner = ModelRunner(sharp, policy, num_slots=1)
            runner.prefill(make_requests(sharp, [ids], SamplingParams(max_new_tokens=1), policy))
            store = runner.store
            # what every (layer, kv head) holds, layer-major, whatever the store's layout
            got = [store.pos[u][0, h, : int(store.lengths[u, 0])].tolist()
                   for l in range(len(layers)) for u, h in
                   (((l * H + hh, 0) if store.head_split else (l, hh)) for hh in range(H))]
            per_layer = round(ratio * P)
            units = 1 if knobs["granularity"] == "layer" else H  # selection units per layer
            raw_s = raw[knobs["scoring"]] if units == 1 else head_raw[knobs["scoring"]]
            cand = [ref_candidates(s, sink, window, knobs["kernel"], "zscore") for s in raw_s]
            want = (ref_layer_select(cand, per_layer, sink, window) if knobs["allocation"] == "layer"
                    else ref_select(cand, per_layer * len(cand), sink, window, 0))
            if units == 1:  # every kv head of a layer keeps the layer's choice
                want = [k for k in want for _ in range(H)]
            out[tuple(knobs.values())] = (got, want)
    return out


@pytest.mark.parametrize("knobs", VARIANTS, ids=lambda k: "-".join(map(str, k.values())))
def test_each_ablation_variant_keeps_what_the_naive_pipeline_keeps(ablation_kept, knobs):
    got, want = ablation_kept[tuple(knobs.values())]
    assert got == want
    if knobs["allocation"] == "layer":
        assert len({len(k) for k in got}) == 1, "uniform allocation: every layer keeps the same count"
    elif knobs["granularity"] == "head":
        H = 2  # the sharp model's kv heads
        assert any(len({len(k) for k in got[l:l + H]}) > 1 for l in range(0, len(got), H)), \
            "head granularity: the heads of a layer keep different counts"


def test_every_ablation_knob_changes_what_is_kept(ablation_kept):
    # On the sharp model each axis, flipped alone, keeps a different set: a knob that were ignored would fail.
    for key in ablation_kept:
        for axis, other in enumerate((("output", "attention"), ("model", "layer"), (1, 7), ("layer", "head"))):
            flipped = list(key)
            flipped[axis] = other[1 - other.index(key[axis])]
            assert ablation_kept[key][0] != ablation_kept[tuple(flipped)][0], (key, axis)


# ------------------------------------------------------------------------------------------- fidelity on unseen queries
def _full_runner_after(bundle, ids, steps, forced=None):
    from skipkv.bench.fidelity import feed_full
    from skipkv.engine.shared import prefill_full

    full, req, first = prefill_full(bundle, ids, steps, SamplingParams(max_new_tokens=steps + 1, ignore_eos=True))
    feed_full(full, req, first, steps, forced)
    return full, req


def test_decode_queries_are_the_answers_own(tiny):
    """The decode-mode reference is what each attention module returned at each step of the greedy answer, and
    the tokens fed are the full cache's own greedy tokens."""
    from skipkv.bench.fidelity import layer_output
    from skipkv.models.patches import routed

    ids = ragged_prompts(tiny.model.config.vocab_size, (50,), seed=4)[0]
    seen: dict[int, list] = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda m, a, out, l=l: seen.setdefault(l, []).append(out[0][0, -1].clone()))
        for l, layer in enumerate(tiny.model.model.layers)]
    try:
        with routed(tiny.model), torch.inference_mode():
            full, req = _full_runner_after(tiny, ids, 5)
    finally:
        for h in hooks:
            h.remove()
    greedy = generate(tiny, [ids], SamplingParams(max_new_tokens=6, ignore_eos=True), make_policy("full"))[0]
    assert req.output_ids == greedy.token_ids[:5]
    s, slot = full.store, torch.tensor([0])
    for l, layer in enumerate(tiny.model.model.layers):
        got = layer_output(layer.self_attn, full.queries.recent(l, slot, 5)[0], torch.arange(50, 55),
                           s.k[l][0, :, :55], s.v[l][0, :, :55], s.pos[l][0, :, :55])
        torch.testing.assert_close(got.double(), torch.stack(seen[l][1:]).double())  # [0] was the prefill


def test_heldout_queries_are_the_prompts_own(tiny):
    """Held-out tokens fed one at a time give the queries a prefill of the whole prompt gives its last tokens."""
    from skipkv.engine.shared import prefill_full
    from skipkv.models.patches import routed

    ids = ragged_prompts(tiny.model.config.vocab_size, (60,), seed=5)[0]
    with routed(tiny.model), torch.inference_mode():
        whole = prefill_full(tiny, ids, 8)[0]
        fed, _ = _full_runner_after(tiny, ids[:52], 8, ids[52:])
    slot = torch.tensor([0])
    for l in range(tiny.model.config.num_hidden_layers):
        torch.testing.assert_close(fed.queries.recent(l, slot, 8), whole.queries.recent(l, slot, 8))


def test_heldout_fidelity_compresses_only_the_prompt_before_the_window(sharp):
    from skipkv.bench.fidelity import fidelity_one

    ids = ragged_prompts(sharp.model.config.vocab_size, (100,), seed=6)[0]
    policies = {"laprox": make_policy("laprox", budget=20, prefill_window=8),
                "snapkv": make_policy("snapkv", budget=20, prefill_window=8, phase="prefill")}
    got = fidelity_one(sharp, ids, policies, 8, queries="heldout", steps=16)
    L = sharp.model.config.num_hidden_layers
    for name, want in (("laprox", 20 * L), ("snapkv", 20 * L)):
        assert got[name]["scored_len"] == 84 and sum(got[name]["kept"]) == want
    # What each policy kept is what it keeps of the 84-token prefix alone: the held-out tokens played no part.
    alone = generate(sharp, [ids[:84]], SamplingParams(max_new_tokens=1), policies["laprox"])[0]
    assert got["laprox"]["kept"] == alone.layer_kv_tokens
    window = fidelity_one(sharp, ids, policies, 8, queries="window")
    decode = fidelity_one(sharp, ids, policies, 8, queries="decode", steps=8)
    for name in policies:  # three different query sets: three different figures
        c = [tuple(round(x, 6) for x in r[name]["cosine"]) for r in (got, window, decode)]
        assert len(set(c)) == 3 and all(0 < x < 1 for t in c for x in t)


@pytest.mark.parametrize("queries", ["decode", "heldout"])
def test_bench_fidelity_unseen_queries_cli(tmp_path, queries):
    out = tmp_path / "fid.json"
    args = ["bench", "fidelity", "--model", "random:qwen2", "--dataset", "niah", "--lengths", "600", "--policies",
            "streaming_llm,laprox", "--window", "8", "--dtype", "fp32", "--out", str(out), "--queries", queries,
            "--steps", "6"]
    assert main(args + ["--budget-ratio", "1.0"]) == 0
    report = json.loads(out.read_text())
    assert report["queries"] == queries and report["steps"] == 6
    for name in ("streaming_llm", "laprox"):  # nothing evicted: the fed queries see the full cache's output
        assert all(abs(c - 1) < 1e-5 for c in report["results"][name]["600"]["per_layer"])
    assert main(args + ["--budget-ratio", "0.2"]) == 0
    assert all(c < 0.9999 for c in json.loads(out.read_text())["results"]["streaming_llm"]["600"]["per_layer"])


def test_bench_fidelity_rejects_an_unknown_query_mode(capsys):
    assert main(["bench", "fidelity", "--model", "random:qwen2", "--queries", "future", "--lengths", "600"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "query mode" in err
