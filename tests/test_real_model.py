"""Real-model checks (slow; need `skipkv models pull qwen2.5-coder-0.5b-instruct`): run with `pytest -m slow`."""

from __future__ import annotations

import pytest
import torch

from skipkv import SamplingParams, generate, make_policy
from skipkv.engine import encode_prompt
from skipkv.models.recipes import RECIPES

NAME = "qwen2.5-coder-0.5b-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():
    if not (RECIPES[NAME].folder() / "config.json").exists():
        pytest.skip(f"{NAME} is not pulled")
    from skipkv.models import load_model

    return load_model(NAME, dtype="bf16")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bf16_full_cache_equals_hf_generate(real, impl):
    q = "Janet has 16 eggs, eats 3 and bakes with 4. She sells the rest at $2 each. How much does she make?"
    text = real.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True)
    ours = generate(real, [text], SamplingParams(max_new_tokens=120, ignore_eos=True), make_policy("full"))[0].token_ids
    ids = torch.tensor([encode_prompt(real.tokenizer, text)])
    previous = real.model.config._attn_implementation
    real.model.set_attn_implementation(impl)
    try:
        hf = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, min_new_tokens=120,
                                 do_sample=False)[0, ids.shape[1]:].tolist()
    finally:
        real.model.set_attn_implementation(previous)
    assert ours == hf
