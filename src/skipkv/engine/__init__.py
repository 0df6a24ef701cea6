"""The generation engine: `generate(bundle, prompts, sampling, policy)` with per-request KV budgets.

    from skipkv import load_model, generate, SamplingParams, make_policy
    results = generate(load_model("random:qwen2"), ["a", "bb"], SamplingParams(max_new_tokens=8), make_policy("rkv", budget=32))

The loop is short glue: admit waiting requests into free slots (batched prefill), decode one token for
every running request, let the policy compress any request whose cache reached budget + interval, retire
finished requests and refill their slots.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from skipkv.attention import attention_backend
from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine.hooks import ResidualAdd
from skipkv.engine.request import Request, RequestResult
from skipkv.engine.runner import ModelRunner
from skipkv.engine.scheduler import Scheduler
from skipkv.errors import SkipKVError
from skipkv.policies import Policy, make_policy

__all__ = ["EngineConfig", "RequestResult", "SamplingParams", "generate", "encode_prompt", "eos_ids", "make_requests"]


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt. Text that already starts with the BOS text (a chat template's output) gets no second BOS."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and prompt.startswith(bos))
    return list(tokenizer(prompt, add_special_tokens=add)["input_ids"])


def eos_ids(bundle) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models often have two)."""
    ids: set[int] = set()
    for src in (bundle.tokenizer.eos_token_id, getattr(getattr(bundle.model, "generation_config", None), "eos_token_id", None)):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    return frozenset(int(i) for i in ids)


def _stop_hit(tokenizer, r: Request) -> bool:
    if not r.sampling.stop:
        return False
    longest = max(len(s) for s in r.sampling.stop)
    # Decoding a short tail is enough: a stop string can only end in the newest token.
    tail = tokenizer.decode(r.output_ids[-(longest + 8):], skip_special_tokens=False)
    return any(s in tail for s in r.sampling.stop)


def _finish_reason(tokenizer, r: Request) -> str | None:
    if r.output_ids[-1] in r.eos_ids and not r.sampling.ignore_eos:
        return "eos"
    if _stop_hit(tokenizer, r):
        return "stop"
    if len(r.output_ids) >= r.sampling.max_new_tokens:
        return "length"
    return None


def _result(tokenizer, r: Request, policy: Policy) -> RequestResult:
    out = r.output_ids
    if r.finish_reason == "eos":
        out = out[:-1]
    text = tokenizer.decode(out, skip_special_tokens=True)
    if r.finish_reason == "stop":
        cut = [text.find(s) for s in r.sampling.stop if s in text]
        text = text[: min(cut)] if cut else text
    return RequestResult(index=r.index, text=text, token_ids=list(r.output_ids), prompt_tokens=r.prompt_len,
                         generated_tokens=len(r.output_ids), peak_kv_tokens=r.peak_kv_tokens,
                         peak_kv_bytes=r.peak_kv_bytes, decode_peak_kv_tokens=r.decode_peak_kv_tokens,
                         decode_peak_kv_bytes=r.decode_peak_kv_bytes, compressions=r.compressions,
                         compress_seconds=r.compress_seconds, seconds=time.perf_counter() - r.started,
                         finish_reason=r.finish_reason or "length", extra=dict(policy.stats(r.state)))


def make_requests(bundle, prompts, sampling, policy: Policy) -> list[Request]:
    """Validate and tokenize prompts into requests (one SamplingParams for all, or one per prompt)."""
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    if len(sampling) != len(prompts):
        raise SkipKVError(f"got {len(sampling)} sampling params for {len(prompts)} prompts")
    eos = eos_ids(bundle)
    out = []
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        ids = encode_prompt(bundle.tokenizer, p)
        if not ids:
            raise SkipKVError(f"prompt {i} is empty")
        if len(ids) >= bundle.max_context:
            raise SkipKVError(f"prompt {i} has {len(ids)} tokens; the model's context is {bundle.max_context}")
        gen = None
        if not sp.greedy:
            gen = torch.Generator(device=bundle.device)
            gen.manual_seed(sp.seed)
        req = Request(index=i, prompt_ids=ids, sampling=sp, eos_ids=eos, generator=gen)
        req.state = policy.init_state(ids, bundle.tokenizer)
        out.append(req)
    return out


def generate(bundle, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             policy: Policy | None = None, engine: EngineConfig | None = None,
             on_result: Callable[[RequestResult], None] | None = None, progress: bool = False,
             steering: Callable[[object], ResidualAdd] | None = None) -> list[RequestResult]:
    """Generate a completion for every prompt; results come back in prompt order.

    steering: a factory taking the model and returning a `ResidualAdd` hook (removed when generation ends);
    without one, the policy's own `steering_hook` (if any) is used.
    """
    policy = policy or make_policy("full")
    engine = engine or EngineConfig()
    requests = make_requests(bundle, list(prompts), sampling or SamplingParams(), policy)
    if not requests:
        return []
    results: list[RequestResult | None] = [None] * len(requests)
    scheduler = Scheduler(requests, engine.batch_size, engine.group_by_length)
    hook = steering(bundle.model) if steering is not None else policy.steering_hook(bundle)
    runner = ModelRunner(bundle, policy, num_slots=min(engine.batch_size, len(requests)),
                         prefill_chunk=engine.prefill_chunk, steering=hook)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="generate", unit="req")
    try:
        with attention_backend(bundle.model), torch.inference_mode():
            while scheduler or runner.running:
                new = scheduler.admit(len(runner.running))
                if new:
                    for r in new:
                        r.started = time.perf_counter()
                    step = list(zip(new, runner.prefill(new)))
                else:
                    step = list(zip(runner.running, runner.decode()))
                finished = []
                for r, tok in step:
                    r.output_ids.append(tok)
                    r.finish_reason = _finish_reason(bundle.tokenizer, r)
                    if r.finish_reason:
                        finished.append(r)
                runner.release(finished)
                for r in finished:
                    res = results[r.index] = _result(bundle.tokenizer, r, policy)
                    if on_result is not None:
                        on_result(res)
                    if bar is not None:
                        bar.update(1)
    finally:
        if hook is not None:
            hook.remove()
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]
