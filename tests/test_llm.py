"""`skipkv.LLM` and the vLLM-named SamplingParams: each field does what vLLM's does, or is refused in one line.

    python -m pytest tests/test_llm.py -q
"""

from __future__ import annotations

import pytest
import torch

from skipkv import LLM, SamplingParams, SkipKVError, generate, make_policy


@pytest.fixture(scope="module")
def llm():
    return LLM("random:qwen2", policy="rkv", budget=24, window=4, interval=8, dtype="fp64")


def test_max_tokens_is_max_new_tokens(llm):
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    assert sp.max_new_tokens == 7 and sp.max_tokens == 7 and sp == SamplingParams(max_new_tokens=7, ignore_eos=True)
    out = llm.generate("The quick brown fox", sp)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 7 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(SkipKVError, match="same parameter"):
        SamplingParams(max_tokens=3, max_new_tokens=4)


@pytest.mark.parametrize("name", ["presence_penalty", "best_of", "logprobs", "min_p"])
def test_unimplemented_vllm_fields_refused(name):
    with pytest.raises(SkipKVError, match=f"{name} is not implemented"):
        SamplingParams(**{name: 1})
    with pytest.raises(SkipKVError, match="no parameter 'colour'"):
        SamplingParams(colour=1)


def test_n_completions_are_seeds_seed_plus_j(llm):
    sp = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=5, ignore_eos=True)
    out = llm.generate(["2 + 2 =", "Once upon a time"], sp)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [0, 1, 2]
    # completion j of a prompt is what one completion with seed + j gives
    for j in (0, 2):
        alone = llm.generate("2 + 2 =", SamplingParams(max_tokens=6, temperature=1.0, seed=5 + j, ignore_eos=True))
        assert out[0].outputs[j].token_ids == alone[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 3
    greedy = llm.generate("2 + 2 =", SamplingParams(max_tokens=6, n=2, ignore_eos=True))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids


def test_repetition_penalty_matches_transformers(llm):
    """Greedy with repetition_penalty 1.8 gives transformers' own generate's tokens (full cache, fp64)."""
    full = LLM.__new__(LLM)
    full.bundle, full.config, full.policy = llm.bundle, llm.config, make_policy("full")
    prompt = "The quick brown fox"
    ids = llm.bundle.tokenizer(prompt, return_tensors="pt").input_ids
    want = llm.bundle.model.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.8,
                                     min_new_tokens=24)[0, ids.shape[1]:].tolist()
    got = full.generate(prompt, SamplingParams(max_tokens=24, repetition_penalty=1.8, ignore_eos=True))
    plain = full.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert got[0].outputs[0].token_ids == want
    assert plain[0].outputs[0].token_ids != want  # the penalty changed the greedy chain


def test_stop_string_and_finish_reasons(llm):
    first = llm.generate("2 + 2 =", SamplingParams(max_tokens=24, ignore_eos=True))[0].outputs[0]
    # Two whole characters from the middle of the output, first seen there (a U+FFFD stands for bytes of a
    # character still incomplete while decoding, which a stop never matches).
    stop = next(first.text[i:i + 2] for i in range(2, len(first.text) - 1)
                if "\ufffd" not in first.text[i:i + 2] and first.text.find(first.text[i:i + 2]) == i)
    assert stop and stop not in first.text[:2]
    out = llm.generate("2 + 2 =", SamplingParams(max_tokens=24, stop=stop, ignore_eos=True))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, first.text[:first.text.find(stop)])
    assert out.peak_kv_tokens > 0 and out.peak_kv_bytes > 0 and out.result.generated_tokens == len(out.token_ids)


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "What is 17 * 23?"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    text = llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and "<|im_start|>assistant" in text
    assert out.outputs[0].token_ids == llm.generate(text, SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[
        0].token_ids
    two = llm.chat([msgs, msgs], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(two) == 2 and two[0].outputs[0].token_ids == two[1].outputs[0].token_ids
    with pytest.raises(SkipKVError, match="chat\\(\\) takes a conversation"):
        llm.chat([["hello"]])


def test_bare_string_and_policy_name(llm, tiny):
    assert len(llm.generate("hello", SamplingParams(max_tokens=2))) == 1  # one prompt, not one per character
    with pytest.raises(SkipKVError, match="takes SamplingParams"):
        llm.generate(["hi"], "rkv")  # type: ignore[arg-type]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    res = generate(tiny, "What is 2+2?", sp)
    assert len(res) == 1
    by_name = generate(tiny, ["hi there"], sp, "streaming_llm")
    assert by_name[0].token_ids == generate(tiny, ["hi there"], sp, make_policy("streaming_llm"))[0].token_ids
    with pytest.raises(SkipKVError, match="third argument"):
        generate(tiny, ["hi"], "rkv")  # type: ignore[arg-type]
    with pytest.raises(SkipKVError, match="n=2"):
        generate(tiny, ["hi"], SamplingParams(n=2))


def test_llm_arguments_refused_in_one_line():
    with pytest.raises(SkipKVError, match="budget"):
        LLM("random:qwen2", policy=make_policy("rkv"), budget=64)
    with pytest.raises(SkipKVError, match="no knob 'windw'"):
        LLM("random:qwen2", policy="rkv", windw=3)
    with pytest.raises(SkipKVError, match="size like"):
        LLM("random:qwen2", kv_memory="lots")


def test_kv_memory_size_string():
    llm = LLM("random:qwen2", policy="rkv", budget=24, window=4, kv_memory="1MiB", dtype="fp32")
    assert llm.config.kv_memory == 1 << 20
    assert torch.is_tensor(torch.tensor(llm.generate("hi", SamplingParams(max_tokens=3))[0].prompt_token_ids))


def test_penalize_repetition_is_transformers_rule():
    from transformers import RepetitionPenaltyLogitsProcessor

    from skipkv.engine.sampler import penalize_repetition

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g, dtype=torch.float64)
    seen = [3, 7, 7, 20, 41, 0]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), logits[None].clone())[0]
    assert torch.equal(penalize_repetition(logits, seen, 1.7), want)
    assert (logits[seen] < 0).any() and (logits[seen] > 0).any()  # both branches of the rule are exercised
