"""A right-padded prefill runs each decoder MLP on its real positions only (models/unpad.py, EngineConfig.
unpad_prefill): the MLPs see exactly the real tokens, and in fp64 what the engine keeps is what the padded forward
gives up to the order of sums (a matmul over N rows may sum in another order than one over B x T), and what it
emits is the same tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, assert_same_entries
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import encode_prompt, make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.models import load_model, unpad
from skipkv.models.patches import ModelPatches, routed

KNOBS = dict(budget=12, window=4, interval=6)
POLICIES = {"full": {}, "rkv": KNOBS, "h2o": KNOBS, "snapkv": KNOBS | {"prefill_window": 8}, "skipkv": KNOBS,
            "laprox": KNOBS | {"prefill_window": 8}, "pyramidkv": KNOBS | {"prefill_window": 8}}


EXACT = dict(rtol=0, atol=1e-12)  # fp64: only the order of sums may differ


@pytest.fixture(scope="module")
def sharp():
    return load_model("random:qwen2:sharp", dtype="fp64")


def test_padding_index_lists_the_real_positions():
    """Against a naive double loop; None when no row is padded (or one position per row: a decode step)."""
    real, T = torch.tensor([3, 1, 4, 0]), 4
    want = [b * T + t for b in range(4) for t in range(T) if t < int(real[b])]
    assert unpad.padding_index(real, T).tolist() == want
    assert unpad.padding_index(torch.tensor([4, 4]), 4) is None
    assert unpad.padding_index(torch.tensor([1, 1]), 1) is None


def test_the_mlps_see_only_real_tokens(sharp):
    """During a ragged prefill every MLP linear gets the real tokens and no pad position; outside it, the full
    [B, T] block."""
    ids = [encode_prompt(sharp.tokenizer, p) for p in PROMPTS]
    assert len({len(x) for x in ids}) > 1
    rows: list[int] = []
    def spy(module, args, out) -> None:
        rows.append(args[0].numel() // args[0].shape[-1])

    hooks = [layer.mlp.gate_proj.register_forward_hook(spy) for layer in sharp.model.model.layers]
    try:
        for on in (True, False):
            rows.clear()
            policy = make_policy("full")
            runner = ModelRunner(sharp, policy, unpad_prefill=on)
            reqs = make_requests(sharp, ids, SamplingParams(max_new_tokens=2), policy)
            with routed(sharp.model), torch.inference_mode():
                runner.prefill(reqs)
            assert rows == [sum(map(len, ids)) if on else len(ids) * max(map(len, ids))] * len(sharp.model.model.layers)
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("name", list(POLICIES))
def test_unpadded_prefill_keeps_and_emits_what_the_padded_one_does(sharp, name):
    """fp64: store entries, accumulators and buffered queries after a ragged prefill are equal up to the order of
    sums, positions exactly, and the greedy tokens and compressions of a whole batched generation (a budget that
    compresses) are the same."""
    ids = [encode_prompt(sharp.tokenizer, p) for p in PROMPTS]

    def prefilled(on: bool) -> ModelRunner:
        policy = make_policy(name, **POLICIES[name])
        runner = ModelRunner(sharp, policy, unpad_prefill=on)
        reqs = make_requests(sharp, ids, SamplingParams(max_new_tokens=4), policy)
        with routed(sharp.model), torch.inference_mode():
            runner.prefill(reqs)
        return runner

    a, b = prefilled(False), prefilled(True)
    assert_same_entries(a.store, b.store, len(ids))
    if a.queries is not None:
        torch.testing.assert_close(b.queries.q, a.queries.q, **EXACT)
        assert torch.equal(a.queries.qpos, b.queries.qpos)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    policy = make_policy(name, **POLICIES[name])
    padded = generate(sharp, PROMPTS, sp, policy, EngineConfig(batch_size=4, unpad_prefill=False))
    unpadded = generate(sharp, PROMPTS, sp, policy, EngineConfig(batch_size=4))
    assert [r.token_ids for r in unpadded] == [r.token_ids for r in padded]
    assert [r.compressions for r in unpadded] == [r.compressions for r in padded]
    assert name == "full" or any(r.compressions for r in padded)


def test_install_is_idempotent_and_transparent_outside_the_context(sharp):
    layer = sharp.model.model.layers[0]
    patches = ModelPatches(sharp.model)
    assert patches.unpad_mlps() == patches.unpad_mlps() == len(sharp.model.model.layers)
    x = torch.randn(2, 5, sharp.model.config.hidden_size, dtype=torch.float64)
    want = layer.mlp.down_proj(layer.mlp.act_fn(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
    assert torch.equal(layer.mlp(x), want)
    index = unpad.padding_index(torch.tensor([5, 2]), 5)
    with unpad.real_positions(index):
        got = layer.mlp(x)
    torch.testing.assert_close(got[0], want[0], **EXACT)
    torch.testing.assert_close(got[1, :2], want[1, :2], **EXACT)
    assert not got[1, 2:].any()  # pad positions: zeros, never computed
    assert torch.equal(layer.mlp(x), want)  # the context is gone


def test_a_deep_copy_of_an_installed_model_runs_its_own_weights(sharp):
    """The wrapped forward is bound to its module: a deep copy computes with the copy's weights (a forward
    captured from the original would silently keep using the original's)."""
    import copy

    ModelPatches(sharp.model).unpad_mlps()
    clone = copy.deepcopy(sharp.model)
    mlp, twin = sharp.model.model.layers[0].mlp, clone.model.layers[0].mlp
    with torch.no_grad():
        twin.down_proj.weight.mul_(2)
    x = torch.randn(1, 3, sharp.model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), 2 * mlp(x), **EXACT)
        with unpad.real_positions(unpad.padding_index(torch.tensor([2]), 3)):
            got = twin(x)
        torch.testing.assert_close(got[0, :2], 2 * mlp(x)[0, :2], **EXACT)

