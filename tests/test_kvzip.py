"""KVzip (policies/kvzip.py) against a naive reference: the reconstruction's score from plain
loops over an independent forward (refdecoder's eager attention over a DynamicCache, prompt then reconstruction
input as one causal sequence), and what the engine kept equals the naive top-k of those scores.

    python -m pytest tests/test_kvzip.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

import frontier_ref as ref
from refdecoder import NO_MASKS, REF_BACKEND, RefState
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.policies import kvzip
from test_frontier_policies import SHARP, prompts, run_captured


@pytest.fixture(scope="module")
def sharp():
    return load_model(SHARP, dtype="fp64")


# ------------------------------------------------------------------------------------------ the naive reference
def ref_inputs(tok, prompt: list[int], chunk: int, overlap: int) -> list[list[int]]:
    """The reconstruction inputs, spelled out: instruction, (later chunks: the previous chunk's last tokens), the
    chat template's end of the user turn and start of the assistant's, the chunk."""
    tail = tok.apply_chat_template([{"role": "user", "content": "@@"}], add_generation_prompt=True,
                                   tokenize=False).split("@@")[1]
    assert tail == "<|im_end|>\n<|im_start|>assistant\n"
    out = []
    for c0 in range(0, len(prompt), chunk):
        head = ("\n\nRepeat the previous context exactly." if c0 == 0 else
                "\n\nRepeat the part of the previous context exactly, starting with ")
        out.append(tok.encode(head, add_special_tokens=False) + prompt[max(0, c0 - overlap):c0]
                   + tok.encode(tail, add_special_tokens=False) + prompt[c0:c0 + chunk])
    return out


def ref_forward(bundle, ids: list[int]) -> RefState:
    """Every post-RoPE query and key of one causal forward over `ids` (positions 0..N-1), in refdecoder's eager
    attention over a transformers DynamicCache: nothing of skipkv's store, backend or query buffer."""
    model, cfg = bundle.model, bundle.model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    st = RefState(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, D, len(ids))
    previous = cfg._attn_implementation
    model.set_attn_implementation(REF_BACKEND)
    try:
        with torch.inference_mode():
            model.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                        attention_mask=NO_MASKS, cache=DynamicCache(config=cfg), use_cache=True, ref_state=st)
    finally:
        model.set_attn_implementation(previous)
    return st


def naive_kvzip(bundle, prompt: list[int], chunk: int, overlap: int = 8) -> list[list[float]]:
    """KVzip's score of every (layer, kv head) unit (layer-major) [P]: the max over every chunk's reconstruction."""
    P, L = len(prompt), bundle.model.config.num_hidden_layers
    best: list[list[float]] | None = None
    for inp in ref_inputs(bundle.tokenizer, prompt, chunk, overlap):
        st = ref_forward(bundle, prompt + inp)
        units = []
        for l in range(L):
            scale = bundle.model.model.layers[l].self_attn.scaling
            units += ref.kvzip_scores(st.q[l], st.k[l], P, scale)
        best = units if best is None else [[max(a, b) for a, b in zip(x, y)] for x, y in zip(best, units)]
    assert best is not None
    return best


def naive_keep(scores: list[list[float]], per: int, budget: int, sink: int, window: int) -> list[list[int]]:
    out = []
    for i in range(0, len(scores), per):
        out += ref.global_topk(scores[i:i + per], budget * per, sink, window, 0)
    return out


# ------------------------------------------------------------------------------------------ the policy in the engine
@pytest.mark.parametrize("block_bytes", [kvzip.RECON_BLOCK_BYTES, 1], ids=["whole-chunks", "one-query-forwards"])
def test_kvzip_keeps_the_naive_selection(monkeypatch, sharp, block_bytes):
    """Two prompts at batch 2, three reconstruction chunks each: the scores the policy computed from the engine's
    observation equal the naive ones, and what it kept (one top-k over every layer and kv head) equals the naive
    top-k; the per-layer and per-head allocations on the same observation too. Heads keep different counts. A
    chunk reconstructed one query per forward gives the same."""
    monkeypatch.setattr(kvzip, "RECON_BLOCK_BYTES", block_bytes)
    kvzip._LAST.clear()
    pol = make_policy("kvzip", budget=16, sink=2, window=2, chunk_size=20)
    ids = prompts(48, 37)
    calls = run_captured(monkeypatch, sharp, pol, ids, 6, batch=2)
    assert len(calls) == 2 and all(o.is_prefill for _, obs, _ in calls for o in obs)  # prompts only, once each
    L, H = sharp.model.config.num_hidden_layers, sharp.model.config.num_key_value_heads
    for p, obs, keeps in list(calls):  # (the allocations below run through the spy, which appends)
        P = obs[0].keys.shape[2]
        prompt = next(x for x in ids if len(x) == P)
        want = naive_kvzip(sharp, prompt, p.chunk_size)
        got = p.unit_scores(obs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, torch.tensor(w, dtype=torch.float64), rtol=1e-9, atol=1e-15)
        assert [k[0, 0].tolist() for k in keeps] == naive_keep(want, L * H, p.budget, p.sink, p.window)
        counts = [k.shape[-1] for k in keeps]
        assert len(set(counts)) > 1 and sum(counts) == p.budget * L * H
        for allocation, per in (("layer", H), ("head", 1)):
            other = dataclasses.replace(p, allocation=allocation).select_model_wide(obs)
            assert other is not None
            assert [k[0, 0].tolist() for k in other] == naive_keep(want, per, p.budget, p.sink, p.window)


def test_kvzip_batch_equals_singles(sharp):
    pol = make_policy("kvzip", budget=16, chunk_size=24)
    ids = prompts(52, 30, 41)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    batched = generate(sharp, ids, sp, pol, EngineConfig(batch_size=3))
    for prompt, res in zip(ids, batched):
        alone = generate(sharp, [prompt], sp, pol)[0]
        assert res.token_ids == alone.token_ids and res.head_kv_tokens == alone.head_kv_tokens
        assert res.compressions == alone.compressions == 1


def test_kvzip_refuses_chunked_prefill_in_one_line(sharp, capsys):
    from skipkv.cli import main

    with pytest.raises(SkipKVError, match="chunked prefill"):
        generate(sharp, prompts(40), SamplingParams(max_new_tokens=2), make_policy("kvzip", budget=16),
                 EngineConfig(prefill_chunk=16))
    code = main(["generate", "--model", "random:qwen2", "--policy", "kvzip", "--budget", "8", "--prefill-chunk", "4",
                 "a prompt long enough to be compressed"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "chunked prefill" in err


def test_kvzip_reconstruction_entries_are_not_kept(sharp):
    """After the prefill compression every unit holds prompt positions only (the reconstruction sat at positions
    P.. in a temporary store), then each generated token once; never more than its share."""
    pol = make_policy("kvzip", budget=12)
    res = generate(sharp, prompts(40), SamplingParams(max_new_tokens=5, ignore_eos=True), pol)[0]
    L, H = sharp.model.config.num_hidden_layers, sharp.model.config.num_key_value_heads
    heads = [n for layer in res.head_kv_tokens for n in layer]
    assert len(heads) == L * H and sum(heads) == (pol.budget + 4) * L * H  # the last token is never cached


def test_kvzip_reconstructs_a_prompt_once_per_cache(monkeypatch, sharp):
    """Two budgets on the same prompt (as a shared prefill's branches) reconstruct it once; the same prompt under
    other weights (the same model object) is reconstructed again, and the scores kept are those of a fresh run."""
    calls: list[int] = []
    real = kvzip.reconstruct
    monkeypatch.setattr(kvzip, "reconstruct", lambda *a: calls.append(1) or real(*a))
    prompt, sp = prompts(44), SamplingParams(max_new_tokens=4, ignore_eos=True)
    kvzip._LAST.clear()
    generate(sharp, prompt, sp, make_policy("kvzip", budget=12, chunk_size=24))
    assert len(calls) == 2  # two chunks
    generate(sharp, prompt, sp, make_policy("kvzip", budget=20, chunk_size=24))
    assert len(calls) == 2
    weight = sharp.model.model.layers[0].self_attn.k_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.5)
        generate(sharp, prompt, sp, make_policy("kvzip", budget=12, chunk_size=24))
        assert len(calls) == 4
        kept = kvzip._LAST[0][1]
        kvzip._LAST.clear()
        generate(sharp, prompt, sp, make_policy("kvzip", budget=12, chunk_size=24))
        assert all(torch.equal(a, b) for a, b in zip(kept, kvzip._LAST[0][1]))
    finally:
        with torch.no_grad():
            weight.copy_(saved)
