"""The step-driven engine: add requests at any time, call `step()` until nothing is left, abort any request.

    from skipkv.engine import Engine, EngineConfig, SamplingParams
    eng = Engine(load_model("random:qwen2"), make_policy("rkv", budget=32), EngineConfig(kv_memory=1 << 20))
    rid = eng.add_request("Hello", SamplingParams(max_new_tokens=20))
    while eng.has_unfinished():
        out = eng.step()   # out.new_tokens [(request_id, token)], out.finished [RequestResult], out.stats
    eng.close()

One step is one scheduling decision: if no admitted group is still prefilling, the scheduler admits the
next group (by free slots and KV memory, see scheduler.py and memory.py); then every running request decodes one token,
and the prefilling group (if any) runs one prompt chunk (`prefill_chunk` tokens per request, 0 = whole), so
long prompts entering do not stall the requests already decoding for more than one chunk per step. With
`share_prefix`, a prompt prefix that the whole group shares is prefilled once for all of it (runner.py).
`generate()` is a loop over this engine. While an Engine is open, its model runs the skipkv attention
backend and unpadded MLPs (one open Engine per model); `close()` removes every change it made to the model
(models/patches.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine.detokenize import TextStream
from skipkv.engine.request import Request, RequestResult, budget_force, encode_prompt, eos_ids, percentile
from skipkv.engine.runner import ModelRunner
from skipkv.engine.scheduler import Scheduler
from skipkv.errors import SkipKVError
from skipkv.models.patches import ModelPatches
from skipkv.policies import Policy, make_policy
from skipkv.steering.hook import ResidualAdd


@dataclass
class EngineStats:
    """The engine after one step. Bytes are K/V over all layers."""

    running: int  # requests holding a slot (decoding, or prefilling)
    waiting: int
    kv_reserved_bytes: int  # what the live requests may still need, each on its own (KVMemory.reserved_bytes)
    kv_held_bytes: int  # K/V the running requests hold now
    kv_allocated_bytes: int  # the slot store as allocated (never above kv_cap_bytes when a cap is set)
    kv_cap_bytes: int  # EngineConfig.kv_memory (0 = no cap)
    generated_tokens: int  # cumulative
    compressions: int  # cumulative (one per request compressed)
    compress_seconds: float  # cumulative wall time spent compressing
    prefill_tokens: int  # prompt tokens prefilled in this step
    step_seconds: float


@dataclass
class StepOutput:
    new_tokens: list[tuple[str, int]] = field(default_factory=list)  # (request_id, token), in sampling order
    finished: list[RequestResult] = field(default_factory=list)
    stats: EngineStats | None = None


def _stop_hit(tokenizer, r: Request) -> bool:
    """Whether the newest token completes a stop string. Each request keeps an incremental decode of its output
    (special tokens included) and a linear-time matcher per stop string, so a stop string matches however many
    tokens it spans (a CJK or astral character is several byte-level tokens); called once per added token."""
    if not r.sampling.stop:
        return False
    if r.stop_scan is None:
        r.stop_scan = TextStream(tokenizer, r.sampling.stop, skip_special_tokens=False)
    r.stop_scan.add(r.output_ids[len(r.stop_scan.ids):])
    return any(m.found is not None for m in r.stop_scan.matchers)


def finish_reason(tokenizer, r: Request) -> str | None:
    if r.output_ids[-1] in r.eos_ids and not r.sampling.ignore_eos:
        return "eos"
    if _stop_hit(tokenizer, r):
        return "stop"
    if len(r.output_ids) >= r.sampling.max_new_tokens:
        return "length"
    return None


def make_result(tokenizer, r: Request, now: float) -> RequestResult:
    out = r.output_ids
    if r.finish_reason == "eos":
        out = out[:-1]
    text = tokenizer.decode(out, skip_special_tokens=True)
    if r.finish_reason == "stop":
        cut = [text.find(s) for s in r.sampling.stop if s in text]
        text = text[: min(cut)] if cut else text
    gaps = r.token_gaps
    return RequestResult(index=r.index, text=text, token_ids=list(r.output_ids), prompt_tokens=r.prompt_len,
                         generated_tokens=len(r.output_ids), peak_kv_tokens=r.peak_kv_tokens,
                         peak_kv_bytes=r.peak_kv_bytes, decode_peak_kv_tokens=r.decode_peak_kv_tokens,
                         decode_peak_kv_bytes=r.decode_peak_kv_bytes, compressions=r.compressions,
                         compress_seconds=r.compress_seconds, seconds=now - r.started,
                         finish_reason=r.finish_reason or "length", request_id=r.request_id,
                         queued_seconds=r.started - r.arrived, ttft_seconds=r.first_token_at - r.arrived,
                         tpot_p50_seconds=percentile(gaps, 0.5) if gaps else None,
                         tpot_p99_seconds=percentile(gaps, 0.99) if gaps else None,
                         peak_total_bytes=r.peak_total_bytes, layer_kv_tokens=list(r.layer_kv_tokens),
                         head_kv_tokens=[list(h) for h in r.head_kv_tokens],
                         allocated_kv_bytes=r.allocated_kv_bytes, extra=dict(r.policy.stats(r.state)),
                         forced_waits=r.forced)


def check_fits(what: str, prompt_len: int, max_new_tokens: int, max_context: int) -> None:
    """A prompt plus its generation must fit the model's context (the cache is sized for it up front)."""
    if prompt_len + max_new_tokens > max_context:
        raise SkipKVError(f"{what}: {prompt_len} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                          f"model's context of {max_context}; lower max_tokens (--max-tokens)")


def new_request(bundle, ids: list[int], sp: SamplingParams, policy: Policy, index: int, eos: frozenset[int],
                what: str, budget: int | None = None) -> Request:
    """A validated request (`what` names it in errors): non-empty, prompt + max_new_tokens within context, and
    run under `policy`, or under its own lower `budget` (Policy.for_request) when one is given."""
    if not isinstance(sp, SamplingParams):
        raise SkipKVError(f"{what}: sampling must be SamplingParams, got {type(sp).__name__}")
    if sp.n != 1:
        raise SkipKVError(f"{what}: an engine request is one completion (sampling n={sp.n}); skipkv.LLM.generate "
                          "expands n")
    if not ids:
        raise SkipKVError(f"{what} is empty")
    check_fits(what, len(ids), sp.max_new_tokens, bundle.max_context)
    try:
        policy = policy.for_request(len(ids), budget)
    except SkipKVError as e:
        raise SkipKVError(f"{what}: {e}") from None
    gen = None
    if not sp.greedy:
        gen = torch.Generator(device=bundle.device)
        gen.manual_seed(sp.seed)
    req = Request(index=index, prompt_ids=ids, sampling=sp, eos_ids=eos, generator=gen, request_id=str(index),
                  policy=policy)
    req.state = policy.init_state(ids, bundle.tokenizer)
    return req


class Engine:
    def __init__(self, bundle, policy: Policy | None = None, config: EngineConfig | None = None,
                 steering: Callable[[object], ResidualAdd] | None = None, trace: bool = False) -> None:
        self.bundle = bundle
        self.policy = policy or make_policy("full")
        self.config = config or EngineConfig()
        # Every change to the model (models/patches.py) goes through this one object, removed by close().
        self.patches = ModelPatches(bundle.model)
        self.patches.route_attention()  # refused where another Engine (or a press) is open on the model
        try:
            # An explicit steering factory, else the policy's own hook (SkipKV / SEAL with a steering file), if any.
            self.hook = steering(bundle.model) if steering is not None else self.policy.steering_hook(bundle)
            if self.hook is not None:
                self.patches.steer(self.hook)
            self.runner = ModelRunner(bundle, self.policy, num_slots=0, prefill_chunk=self.config.prefill_chunk,
                                      steering=self.hook, trace=trace, kv_memory=self.config.kv_memory,
                                      share_prefix=self.config.share_prefix,
                                      unpad_prefill=self.config.unpad_prefill,
                                      enforce_eager=self.config.enforce_eager, patches=self.patches)
        except BaseException:
            self.patches.close()  # a refused policy must leave the model as it was
            raise
        self.plan = self.runner.plan  # every kernel this engine's forwards run (plan.py), enforce_eager applied
        self.scheduler = Scheduler(self.config, self.runner.memory)
        self._eos = eos_ids(bundle)
        self._next_index = 0
        self._live: dict[str, Request] = {}  # request_id -> request, waiting or holding a slot
        self._generated = 0
        self._closed = False

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, budget: int | None = None) -> str:
        """Queue a prompt; returns its request id. `budget`: a lower KV budget than the policy's for this prompt
        (tokens per kv head; under LaProx's budget_ratio, at most the ratio's budget, which it then replaces),
        for this request only. SkipKVError for an empty or too long prompt, a bad budget, or one that can
        never fit."""
        what = f"request {request_id}" if request_id is not None else f"prompt {self._next_index}"
        ids = encode_prompt(self.bundle.tokenizer, prompt)
        r = new_request(self.bundle, ids, sampling or SamplingParams(), self.policy, self._next_index, self._eos,
                        what, budget)
        if request_id is not None:
            r.request_id = str(request_id)
        self._enqueue(r)
        return r.request_id

    def _enqueue(self, r: Request) -> None:
        """Queue a prepared request (generate() builds its requests with make_requests)."""
        if self._closed:
            raise SkipKVError("the engine is closed")
        if not r.request_id:
            r.request_id = str(r.index)
        if r.request_id in self._live:
            raise SkipKVError(f"request id {r.request_id!r} is already in use")
        self.scheduler.add(r)
        self._next_index = max(self._next_index, r.index + 1)
        self._live[r.request_id] = r

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request; its slot and memory are freed at once. False if unknown/finished."""
        r = self._live.pop(request_id, None)
        if r is None:
            return False
        if not self.scheduler.remove(r):
            with torch.inference_mode():
                self.runner.release([r])
                self.runner.fit(exact=True)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    # ------------------------------------------------------------------------------------ the step
    def step(self) -> StepOutput:
        """One scheduling decision: admit (if no group is prefilling), decode every running request one
        token, prefill one chunk of the admitted group; retire finished requests."""
        t0 = time.perf_counter()
        with torch.inference_mode():  # buffers (re)allocated here are inference tensors: touch them only inside
            out, prefill_tokens = self._step(t0)
        out.stats = self.stats(prefill_tokens, time.perf_counter() - t0)
        return out

    def _step(self, t0: float) -> tuple[StepOutput, int]:
        runner = self.runner
        pairs: list[tuple[Request, int]] = []
        prefill_tokens = 0
        if not runner.cohort and self.scheduler:
            new = self.scheduler.admit(runner.running_need(), len(runner.running))
            if new:
                for r in new:
                    r.started = t0
                runner.start_cohort(new)
        if runner.running:
            pairs += zip(list(runner.running), runner.decode())
        if runner.cohort:
            prefill_tokens, done = runner.prefill_step()
            pairs += done
        now = time.perf_counter()
        out = StepOutput()
        finished: list[Request] = []
        for r, tok in pairs:
            r.add_token(tok, now)
            if r.sampling.force_wait:
                budget_force(self.bundle.tokenizer, r)  # may replace the token just added (s1 budget forcing)
            out.new_tokens.append((r.request_id, r.output_ids[-1]))
            r.finish_reason = finish_reason(self.bundle.tokenizer, r)
            if r.finish_reason:
                finished.append(r)
        self._generated += len(pairs)
        if finished:
            runner.release(finished)
        # Keep a freed slot's memory while others wait for it; give it back when nobody does.
        runner.fit(exact=not self.scheduler)
        for r, _ in pairs:
            if len(r.output_ids) == 1:  # just prefilled: what the store allocates once it is sized for it
                r.allocated_kv_bytes = runner.store.allocated_bytes()
        for r in finished:
            del self._live[r.request_id]
            res = make_result(self.bundle.tokenizer, r, now)
            if runner.trace:
                res.trace = runner.trace_result(r)
            out.finished.append(res)
        return out, prefill_tokens

    def stats(self, prefill_tokens: int = 0, step_seconds: float = 0.0) -> EngineStats:
        runner = self.runner
        live = runner.running + runner.cohort
        store = runner.store
        return EngineStats(running=len(live), waiting=len(self.scheduler.waiting),
                           kv_reserved_bytes=runner.memory.reserved_bytes(store.lengths, runner.running, runner.cohort),
                           kv_held_bytes=int(store.lengths.sum()) * store.bytes_per_entry,
                           kv_allocated_bytes=store.allocated_bytes(), kv_cap_bytes=self.config.kv_memory,
                           generated_tokens=self._generated, compressions=runner.compressions,
                           compress_seconds=runner.compress_seconds,
                           prefill_tokens=prefill_tokens, step_seconds=step_seconds)

    def close(self) -> None:
        """Remove every change this engine made to the model: attention, unpadded MLPs, steering hook
        (models/patches.py; idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.patches.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
