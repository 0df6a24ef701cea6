"""The generation engine: `generate(bundle, prompts, sampling, policy)` with per-request KV budgets, and the
step-driven `Engine` it loops over (add requests at any time, one scheduling decision per `step()`).

    from skipkv import load_model, generate, SamplingParams, make_policy
    results = generate(load_model("random:qwen2"), ["a", "bb"], SamplingParams(max_new_tokens=8),
                       make_policy("rkv", budget=32))

The loop is short glue: admit waiting requests into free slots under the KV memory cap (batched, chunked
prefill), decode one token for every running request, let the policy compress any request whose cache
reached budget + interval, retire finished requests and refill their slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine.engine import Engine, EngineStats, StepOutput, check_fits, new_request
from skipkv.engine.request import Request, RequestResult, encode_prompt, eos_ids
from skipkv.errors import SkipKVError
from skipkv.policies import Policy, make_policy
from skipkv.steering.hook import ResidualAdd

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestResult", "SamplingParams", "StepOutput", "generate",
           "encode_prompt", "eos_ids", "make_requests", "check_fits"]


def make_requests(bundle, prompts, sampling, policy: Policy) -> list[Request]:
    """Validate and tokenize prompts into requests (one SamplingParams for all, or one per prompt)."""
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    if len(sampling) != len(prompts):
        raise SkipKVError(f"got {len(sampling)} sampling params for {len(prompts)} prompts")
    eos = eos_ids(bundle)
    return [new_request(bundle, encode_prompt(bundle.tokenizer, p), sp, policy, i, eos, f"prompt {i}")
            for i, (p, sp) in enumerate(zip(prompts, sampling))]


def generate(bundle, prompts: str | Sequence[str | Sequence[int]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             policy: Policy | str | None = None, engine: EngineConfig | None = None,
             on_result: Callable[[RequestResult], None] | None = None, progress: bool = False,
             steering: Callable[[object], ResidualAdd] | None = None, trace: bool = False) -> list[RequestResult]:
    """Generate a completion for every prompt (a string is one prompt); results come back in prompt order. Prompts
    are sent as they are: `skipkv.LLM.chat` (or the CLI) applies a chat template. `policy`: a Policy or a
    registered name (its default knobs).

    steering: a factory taking the model and returning a `ResidualAdd` hook (removed when generation ends).
    trace: record what each compression kept (`RequestResult.trace`, engine/trace.py; for `skipkv show`).
    Without an explicit `steering` factory, the policy's own `steering_hook` (if any) is used.
    """
    if isinstance(prompts, str):  # one prompt, not a sequence of one-character prompts
        prompts = [prompts]
    if isinstance(sampling, str):
        raise SkipKVError(f"generate() takes SamplingParams as its third argument, got the string {sampling!r}; "
                          "a policy goes fourth (a Policy or a registered name)")
    if isinstance(policy, str):
        policy = make_policy(policy)
    elif policy is not None and not isinstance(policy, Policy):
        raise SkipKVError(f"policy must be a Policy or a registered name, got {type(policy).__name__}")
    policy = policy or make_policy("full")
    requests = make_requests(bundle, list(prompts), sampling or SamplingParams(), policy)
    if not requests:
        return []
    results: list[RequestResult | None] = [None] * len(requests)
    bar = None
    eng = Engine(bundle, policy, engine or EngineConfig(), steering=steering, trace=trace)
    try:
        for r in requests:
            eng._enqueue(r)  # all validated (and never-fits refused) before any forward
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req")
        while eng.has_unfinished():
            for res in eng.step().finished:
                results[res.index] = res
                if on_result is not None:
                    on_result(res)
                if bar is not None:
                    bar.update(1)
    finally:
        eng.close()
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]
