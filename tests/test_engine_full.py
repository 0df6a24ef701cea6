"""`full` through the engine must equal transformers' own greedy generate, token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import encode_prompt


def hf_greedy(bundle, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([encode_prompt(bundle.tokenizer, prompt)])
    out = bundle.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n, pad_token_id=bundle.tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_full_equals_hf_generate_batch1(tiny):
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = generate(tiny, [PROMPTS[1]], sp, make_policy("full"))[0].token_ids
    assert got == hf_greedy(tiny, PROMPTS[1], 24)


def test_full_equals_hf_generate_ragged_batch4(tiny):
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = generate(tiny, PROMPTS, sp, make_policy("full"), EngineConfig(batch_size=4))
    for prompt, res in zip(PROMPTS, got):
        assert res.token_ids == hf_greedy(tiny, prompt, 24)


def test_full_equals_hf_other_families(tiny_other):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    got = generate(tiny_other, PROMPTS[:3], sp, make_policy("full"), EngineConfig(batch_size=3))
    for prompt, res in zip(PROMPTS, got):
        assert res.token_ids == hf_greedy(tiny_other, prompt, 12)


def test_chunked_prefill_equals_whole(tiny):
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    whole = generate(tiny, PROMPTS, sp, make_policy("full"))
    chunked = generate(tiny, PROMPTS, sp, make_policy("full"), EngineConfig(prefill_chunk=7))
    assert [r.token_ids for r in whole] == [r.token_ids for r in chunked]


def test_continuous_batching_refills_slots(tiny):
    # Batch size 2 with 4 requests of different lengths: finished slots are refilled mid-flight.
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 20, 9, 14)]
    batched = generate(tiny, PROMPTS, sps, make_policy("full"), EngineConfig(batch_size=2))
    for prompt, sp, res in zip(PROMPTS, sps, batched):
        alone = generate(tiny, [prompt], sp, make_policy("full"))[0]
        assert res.token_ids == alone.token_ids
        assert res.generated_tokens == sp.max_new_tokens


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_low_precision_runs(dtype):
    from skipkv.models import load_model

    b = load_model("random:qwen2", dtype=dtype)
    res = generate(b, PROMPTS[:2], SamplingParams(max_new_tokens=6, ignore_eos=True),
                   make_policy("rkv", budget=12, interval=4))
    assert [r.generated_tokens for r in res] == [6, 6]
    assert all(r.peak_kv_bytes > 0 for r in res)
