"""Stops (EOS, stop strings, max_new_tokens), the sampler's filters, and the residual-add hook."""

from __future__ import annotations

import torch

from conftest import PROMPTS
from skipkv import SamplingParams, generate
from skipkv.config import EngineConfig
from skipkv.engine.sampler import filter_logits, greedy_tokens, sample
from skipkv.models import load_model
from skipkv.steering.hook import ResidualAdd


def test_eos_stops_unless_ignored(tiny, monkeypatch):
    import skipkv.engine as engine

    base = generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    # Declare the 5th generated token to be the EOS: the run must stop at its first occurrence.
    eos = base.token_ids[4]
    first = base.token_ids.index(eos)
    monkeypatch.setattr(engine, "eos_ids", lambda bundle: frozenset({eos}))
    stopped = generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=12))[0]
    ignored = generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert stopped.finish_reason == "eos" and stopped.token_ids == base.token_ids[: first + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == base.token_ids


def test_stop_string_truncates_text(tiny):
    base = generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop = tiny.tokenizer.decode(base.token_ids[6:8])
    res = generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    assert res.finish_reason == "stop"
    assert res.generated_tokens <= 8
    assert stop not in res.text and base.text.startswith(res.text)


def ref_filter(logits, temperature, top_k, top_p):
    x = [v / temperature for v in logits.tolist()]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    # As in transformers: top-k first, then the nucleus of the renormalised top-k distribution.
    keep = set(order[:top_k] if top_k else order)
    z = sum(float(torch.tensor(x[i]).exp()) for i in keep)
    probs = {i: float(torch.tensor(x[i]).exp()) / z for i in keep}
    if top_p < 1:
        cum, nucleus = 0.0, set()
        for i in [i for i in order if i in keep]:
            nucleus.add(i)
            cum += probs[i]
            if cum >= top_p:
                break
        keep &= nucleus
    return keep


def test_filter_logits_matches_reference():
    torch.manual_seed(0)
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.5), (8, 0.9), (3, 0.99)]:
        logits = torch.randn(20)
        from skipkv.config import SamplingParams as SP

        got = filter_logits(logits, SP(temperature=0.7, top_k=top_k, top_p=top_p))
        kept = {i for i, v in enumerate(got.tolist()) if v != float("-inf")}
        assert kept == ref_filter(logits, 0.7, top_k, top_p)


def test_greedy_pick_is_the_first_largest_logit_in_any_dtype():
    """The greedy pick reads 16-bit logits as they are: it must be the first index of the largest value, as
    `float().argmax()` gives, including the ties that bf16's rounding makes common."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-6, 6, (16, 300), generator=g).float() / 4  # few distinct values: many tied maxima
    base[3] = 1.5  # a row that is all one value
    base[5, 7] = base[5, 290] = 9.0  # two tied maxima far apart
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = base.to(dtype) + torch.randn(16, 300, generator=g).to(dtype) * 1e-3 * (dtype == torch.float32)
        want = [max(range(300), key=lambda j, row=row: (row[j], -j)) for row in logits.float().tolist()]
        assert greedy_tokens(logits).tolist() == want, dtype
        assert greedy_tokens(logits).tolist() == logits.float().argmax(dim=-1).tolist()


def test_sampled_rows_draw_the_same_from_16bit_logits():
    """The sampler no longer widens the whole logits block: each sampled row must still be filtered and turned into
    probabilities at full precision, so bf16 logits draw what their fp32 copy draws (probabilities rounded to bf16
    would move the draws over a few thousand tokens)."""
    from types import SimpleNamespace

    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sps = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=7),
           SamplingParams(max_new_tokens=4, temperature=1.3, top_k=5, seed=3)]
    def draw(x):
        reqs = [SimpleNamespace(sampling=sp, generator=None if sp.greedy else torch.Generator().manual_seed(sp.seed))
                for sp in sps]  # what sample() reads of a Request
        return [sample(x, reqs) for _ in range(200)]
    assert draw(logits) == draw(logits.float())


def test_residual_add_hook(tiny):
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = generate(tiny, PROMPTS[:2], sp, engine=EngineConfig(batch_size=2))
    v = torch.randn(tiny.config.hidden_size, dtype=torch.float64) * 5

    def zero(model):
        return ResidualAdd(model, layer=1, vector=v, coef=lambda s: 0.0)

    def strong(model):
        return ResidualAdd(model, layer=1, vector=v, coef=lambda s: 1.0)

    assert [r.token_ids for r in generate(tiny, PROMPTS[:2], sp, steering=zero, engine=EngineConfig(batch_size=2))] == \
        [r.token_ids for r in plain]
    steered = generate(tiny, PROMPTS[:2], sp, steering=strong, engine=EngineConfig(batch_size=2))
    assert all(s.token_ids != p.token_ids for s, p in zip(steered, plain))
    # The first token comes from prefill, which is never steered.
    assert all(s.token_ids[0] == p.token_ids[0] for s, p in zip(steered, plain))
    # The hook is removed when generation ends.
    assert [r.token_ids for r in generate(tiny, PROMPTS[:2], sp, engine=EngineConfig(batch_size=2))] == \
        [r.token_ids for r in plain]


def test_hidden_states_reach_the_policy(tiny):
    """A policy that requires "hidden" sees every token once, with last-layer states of the model's width."""
    from dataclasses import dataclass
    from typing import ClassVar

    from skipkv.engine import encode_prompt
    from skipkv.policies.full import FullKV

    states: list[dict] = []

    @dataclass(frozen=True)
    class Spy(FullKV):
        needs: ClassVar[frozenset[str]] = frozenset({"hidden"})

        def init_state(self, prompt_ids, tokenizer):
            states.append({"tokens": [], "width": set()})
            return states[-1]

        def observe(self, state, token_ids, hidden):
            state["tokens"].extend(token_ids.tolist())
            state["width"].add(hidden.shape[-1])
            state.setdefault("where", set()).add((token_ids.device.type, hidden.device.type, hidden.dtype))

    bf16 = load_model("random:qwen2", dtype="bf16")
    for bundle, share in ((tiny, 0), (bf16, 0), (bf16, 4)):  # share_prefix 4: the shared-prefix forward too
        states.clear()
        res = generate(bundle, PROMPTS[:2], SamplingParams(max_new_tokens=6, ignore_eos=True), Spy(),
                       EngineConfig(batch_size=2, share_prefix=share))
        for prompt, r, st in zip(PROMPTS, res, states):
            assert st["tokens"] == encode_prompt(bundle.tokenizer, prompt) + r.token_ids[:-1]
            assert st["width"] == {bundle.config.hidden_size}
            # on the host, in fp32 at least (the runner copies each forward's rows once, before the policies)
            assert st["where"] == {("cpu", "cpu", torch.promote_types(bundle.dtype, torch.float32))}
