"""`KVPress` inside transformers' own `model.generate` and `pipeline`: the engine's tokens, the question kept out.

    python -m pytest tests/test_press.py -q
"""

from __future__ import annotations

import pytest
import torch

from skipkv import SamplingParams, SkipKVError, generate, make_policy
from skipkv.press import KVPress
from skipkv.press_pipeline import KVPressPipeline

PROMPT = ("In the beginning the Universe was created. This has made a lot of people very angry and been widely "
          "regarded as a bad move.")
KNOBS = dict(budget=40, window=4, interval=8)


def engine_tokens(bundle, ids: list[int], policy, n: int):
    return generate(bundle, [ids], SamplingParams(max_new_tokens=n, ignore_eos=True), policy)[0]


def hf_generate(bundle, press, ids: list[int], n: int) -> list[int]:
    with press(bundle.model, bundle.tokenizer):
        out = bundle.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["rkv", "snapkv", "adakv"])
def test_model_generate_equals_the_engine(tiny, name):
    ids = tiny.tokenizer(PROMPT)["input_ids"]
    policy = make_policy(name, **KNOBS)
    want = engine_tokens(tiny, ids, policy, 40)
    press = KVPress(name, **KNOBS)
    assert hf_generate(tiny, press, ids, 40) == want.token_ids
    r = press.request
    assert r is not None and want.compressions > 0
    assert (r.compressions, r.peak_kv_tokens, r.peak_kv_bytes) == (want.compressions, want.peak_kv_tokens,
                                                                     want.peak_kv_bytes)


def test_text_generation_pipeline_and_compression_ratio(tiny):
    from transformers import pipeline

    ids = tiny.tokenizer(PROMPT)["input_ids"]
    want = engine_tokens(tiny, ids, make_policy("rkv", budget=len(ids) // 2, window=4, interval=8), 12)
    press = KVPress("rkv", compression_ratio=0.5, window=4, interval=8)
    pipe = pipeline("text-generation", model=tiny.model, tokenizer=tiny.tokenizer)
    with press(pipe.model, pipe.tokenizer):
        text = pipe(PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False, return_full_text=False)
    assert press.request is not None and press.request.policy.budget == len(ids) // 2
    assert text[0]["generated_text"] == tiny.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert tiny.model.config._attn_implementation != "skipkv"  # restored when the block ends


def test_question_stays_out_of_compression(tiny):
    pipe = KVPressPipeline(model=tiny.model, tokenizer=tiny.tokenizer)
    question = "Who was angry about it, and why was it a bad move?"
    ctx_ids, q_ids = pipe.split(PROMPT, question)
    assert len(q_ids) > 8 and len(ctx_ids) > 40
    press = KVPress("snapkv", phase="prefill", **KNOBS)
    out = pipe(PROMPT, question=question, press=press, max_new_tokens=6)
    r = press.request
    assert isinstance(out["answer"], str) and r is not None
    # one compression (the context, to 40); the question's entries all stay, then decode grows the cache
    assert r.compressions == 1
    assert r.peak_kv_tokens == max(len(ctx_ids), 40 + len(q_ids) + (r.fed - len(ctx_ids) - len(q_ids)))
    two = pipe(PROMPT, questions=[question, question], press=press, max_new_tokens=6)
    assert two["answers"] == [out["answer"]] * 2


def test_refusals(tiny, tmp_path):
    from test_steering import write_vector

    press = KVPress("rkv", **KNOBS)
    with pytest.raises(SkipKVError, match="a batch of 2"), press(tiny.model):
        tiny.model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=2)
    with press(tiny.model), pytest.raises(SkipKVError, match="position 5 does not continue"):
        tiny.model(input_ids=torch.tensor([[1, 2, 3]]))
        tiny.model(input_ids=torch.tensor([[4]]), position_ids=torch.tensor([[5]]))
    with pytest.raises(SkipKVError, match="compression_ratio must be < 1"):
        KVPress("rkv", compression_ratio=1.0)
    with pytest.raises(SkipKVError, match="reads the text"), KVPress("skipkv", **KNOBS)(tiny.model):
        pass
    with pytest.raises(SkipKVError, match="steering is not available"), KVPress(
            "skipkv", steering=write_vector(tmp_path / "v.safetensors"), **KNOBS)(tiny.model, tiny.tokenizer):
        pass
    assert tiny.model.config._attn_implementation != "skipkv"
    with pytest.raises(SkipKVError, match="press=KVPress"):
        KVPressPipeline(model=tiny.model, tokenizer=tiny.tokenizer)(PROMPT, question="q")


def test_other_families(tiny_other):
    ids = tiny_other.tokenizer(PROMPT)["input_ids"]
    want = engine_tokens(tiny_other, ids, make_policy("rkv", **KNOBS), 24)
    assert want.compressions > 0
    assert hf_generate(tiny_other, KVPress("rkv", **KNOBS), ids, 24) == want.token_ids
