"""One prefill, many policies: a prompt is prefilled once with the full cache, and each policy that compresses
from the stored K/V and the newest queries alone continues from a copy of that prefill.

    from skipkv.engine.shared import generate_shared
    results = generate_shared(bundle, ids, SamplingParams(max_new_tokens=32),
                              [make_policy("snapkv", budget=410, phase="prefill"), make_policy("laprox", budget=410)])

Why it is exact: a policy compresses right after the prefill forward (runner.prefill_step: forward, then
compress, then the first token from the full-cache logits), so the forward, its K/V and the window queries are
those of the full cache whatever the policy; only what each policy keeps afterwards differs. A branch gets a
deep copy of the store, the newest `query_window` queries of the shared buffer (re-laid in a ring of its own
size, so decode-time compression and the memory figures are the policy's own), runs that policy's compression,
and decodes on its own runner. Tests check that every branch returns the tokens, KV figures and layer lengths of
a batch-1 `generate` with that policy (bf16 included: the prefill is the same batch-1 forward).

A policy that needs the attention each prompt entry received during the prefill (H2O's `attn`) shares too: when
one does, the shared prefill accumulates it (H2O's slower prefill, once for all), and branches whose policy does
not read it get a copy without it. What cannot share (`shares_prefill` is False): a policy that needs the
prefill's hidden states (SkipKV) or a steering hook, or a window wider than the one captured; prefill in chunks
(a policy compresses between chunks, so the next chunk's inputs differ); sampling (a branch would replay the
full request's generator). Those raise SkipKVError.

Timing: a result's `seconds` is the shared prefill plus that branch's own compression and decode, i.e. what a
run of that policy alone would have spent on this request (without the others' branches), except that when the
prefill accumulated attention sums for an H2O branch, every branch's figure includes that slower prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from skipkv.attention import QueryBuffer
from skipkv.cache import KVStore, SlotCache
from skipkv.config import SamplingParams
from skipkv.engine.engine import finish_reason, make_result
from skipkv.engine.request import Request, RequestResult, budget_force
from skipkv.engine.runner import ModelRunner
from skipkv.errors import SkipKVError
from skipkv.models.patches import routed
from skipkv.policies import Policy, make_policy


def shares_prefill(policy: Policy, window: int | None = None) -> bool:
    """True when `policy` scores from the store, the newest queries and the prefill's attention sums alone (no
    hidden states, no steering), so it can compress a copy of the full prefill; with `window`, also that its
    query window fits the `window` queries captured."""
    if not policy.requirements() <= {"queries", "attn"} or type(policy).steering_hook is not Policy.steering_hook:
        return False
    return window is None or "queries" not in policy.requirements() or policy.query_window <= window


def capture_window(policies: Sequence[Policy]) -> int:
    """Queries the shared prefill must buffer: the widest window any of `policies` reads (0: none reads any)."""
    return max([p.query_window for p in policies if "queries" in p.requirements()], default=0)


def prefill_full(bundle, ids: list[int], window: int, sampling: SamplingParams | None = None, attn: bool = False
                 ) -> tuple[ModelRunner, Request, int]:
    """Prefill `ids` once with the full cache, buffering the newest `window` queries of every layer (0: none)
    and, with `attn`, accumulating the attention each entry receives (as H2O's prefill does).
    Returns (the runner, its request, the first token). Call under the attention backend and inference mode."""
    from skipkv.engine import make_requests

    full = make_policy("full")
    runner = ModelRunner(bundle, full, num_slots=0)
    if attn:
        s = runner.store
        runner.store = KVStore(s.num_layers, 0, s.num_kv_heads, s.head_dim, 0, s.dtype, s.device, aux=("attn",))
        runner.cache = SlotCache(runner.store)
    if window:
        cfg = bundle.model.config
        runner.queries = QueryBuffer(cfg.num_hidden_layers, 0, cfg.num_attention_heads, window, runner.head_dim,
                                     bundle.dtype, bundle.device)
    [req] = make_requests(bundle, [ids], sampling or SamplingParams(max_new_tokens=1), full)
    [first] = runner.prefill([req])
    return runner, req, first


def branch(bundle, full: ModelRunner, policy: Policy, ids: list[int], sampling: SamplingParams
           ) -> tuple[ModelRunner, Request]:
    """A runner for `policy` holding a copy of `full`'s prefilled slot 0, compressed as `policy`'s own prefill
    would have compressed it; its request is `running[0]`, with the prefill's memory peak noted, no token yet."""
    from skipkv.engine import make_requests

    missing = set(policy.requirements()) & {"attn"} - set(full.store.aux_names)
    if missing or not shares_prefill(policy, full.queries.window if full.queries is not None else 0):
        raise SkipKVError(f"policy {type(policy).__name__} cannot continue from this shared prefill "
                          "(it needs hidden states, attention sums not accumulated, or a wider query window)")
    run = ModelRunner(bundle, policy, num_slots=0)
    run.store = full.store.copy(aux=run.store.aux_names)  # the accumulators this policy reads, no others
    if policy.head_split:  # a policy whose heads keep different counts continues in its own layout
        run.store = run.store.split_heads()
    run.cache = SlotCache(run.store)
    if run.queries is not None:
        assert full.queries is not None  # the full run buffers queries whenever a policy does
        run.queries = full.queries.narrowed(policy.query_window)
    [req] = make_requests(bundle, [ids], sampling, policy)
    run._prepare([req])
    req.fed = req.prompt_len
    run.running = [req]
    held = run._note_memory(0, [req], decoding=False)  # the whole prompt, as the policy's own prefill staged it
    if policy.should_compress(held[0], True, req.state):
        run.compress([(0, req)], is_prefill=True)
    return run, req


def _finish(bundle, req: Request, token: int) -> str | None:
    req.add_token(token, time.perf_counter())
    if req.sampling.force_wait:
        budget_force(bundle.tokenizer, req)
    req.finish_reason = finish_reason(bundle.tokenizer, req)
    return req.finish_reason


def generate_shared(bundle, ids: list[int], sampling: SamplingParams, policies: Sequence[Policy],
                    on_result: Callable[[int, RequestResult], None] | None = None) -> list[RequestResult]:
    """Generate one prompt under each of `policies` from one full-cache prefill; results in policy order
    (`on_result(i, result)` as each finishes). Greedy decoding only; see the module docstring."""
    if not sampling.greedy:
        raise SkipKVError("a shared prefill needs greedy decoding (temperature 0)")
    refused = [type(p).__name__ for p in policies if not shares_prefill(p)]
    if refused:
        raise SkipKVError(f"policy {refused[0]} cannot continue from a shared prefill "
                          "(it needs the prefill's hidden states or a steering hook)")
    results: list[RequestResult] = []
    with routed(bundle.model), torch.inference_mode():
        t0 = time.perf_counter()
        attn = any("attn" in p.requirements() for p in policies)
        full, _, first = prefill_full(bundle, ids, capture_window(policies), sampling, attn=attn)
        prefill_seconds = time.perf_counter() - t0
        for i, policy in enumerate(policies):
            began = time.perf_counter()
            run, req = branch(bundle, full, policy, ids, sampling)
            req.started = req.arrived = began - prefill_seconds  # as if this request alone had been prefilled
            done = _finish(bundle, req, first)
            run.fit(exact=True)  # sized for what it keeps and its remaining growth, as the engine does after a prefill
            req.allocated_kv_bytes = run.store.allocated_bytes()
            while not done:
                [token] = run.decode()
                done = _finish(bundle, req, token)
                run.fit(exact=True)
            run.release([req])
            result = make_result(bundle.tokenizer, req, time.perf_counter())
            results.append(result)
            if on_result is not None:
                on_result(i, result)
    return results
