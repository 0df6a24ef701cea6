"""`LLM`: the offline entry point shaped like vLLM's, over skipkv's engine and a compressed KV cache.

    from skipkv import LLM, SamplingParams
    llm = LLM("random:qwen2", policy="rkv", budget=64, dtype="fp32")
    for out in llm.chat([{"role": "user", "content": "What is 17 + 25?"}], SamplingParams(max_tokens=32)):
        print(out.outputs[0].text, out.outputs[0].peak_kv_bytes)

`generate` sends prompts as they are (as vLLM does); `chat` applies the tokenizer's chat template. Outputs
mirror vLLM's `RequestOutput` / `CompletionOutput` (request_id, prompt, prompt_token_ids, outputs[i].text,
token_ids, finish_reason "stop" | "length", stop_reason) and add what skipkv measures per completion: peak KV
tokens and bytes, compressions, and the engine's whole `RequestResult` (`.result`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from skipkv.config import EngineConfig, SamplingParams, parse_bytes
from skipkv.engine import RequestResult, encode_prompt, generate
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.policies import Policy, make_policy

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"  # the offline real model (`skipkv models pull`)


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput, plus skipkv's KV figures)."""

    index: int  # which of the prompt's `n` completions
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence token or a stop string) or "length", as vLLM reports it
    stop_reason: str | None  # the stop string that ended it; None for an end-of-sequence token or a length stop
    peak_kv_tokens: int  # most entries held per kv head (largest layer)
    peak_kv_bytes: int  # most K/V bytes held over all layers
    compressions: int
    result: RequestResult  # everything the engine measured (timings, per-layer entries, the policy's figures)

    def finished(self) -> bool:
        return True


@dataclass
class RequestOutput:
    """All completions of one prompt (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def _completion(j: int, r: RequestResult, stop: tuple[str, ...], tokenizer) -> CompletionOutput:
    stop_reason = None
    if r.finish_reason == "stop":  # the stop string found first in the untruncated text ended it
        full = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        stop_reason = min((s for s in stop if s in full), key=full.find, default=None)
    return CompletionOutput(index=j, text=r.text, token_ids=list(r.token_ids),
                            finish_reason="length" if r.finish_reason == "length" else "stop",
                            stop_reason=stop_reason, peak_kv_tokens=r.peak_kv_tokens, peak_kv_bytes=r.peak_kv_bytes,
                            compressions=r.compressions, result=r)


class LLM:
    """A model, a KV policy and an engine configuration; `generate` and `chat` run batches through the engine.

    model: a pulled name, hub id, folder, .gguf or random:<family>; policy: a registered name (`skipkv
    policies`) with `budget` and any of its knobs as keywords (window=, interval=, ...), or a Policy;
    kv_memory: bytes or a size like "1GiB" (0 = no cap); device, dtype as `load_model`."""

    def __init__(self, model: str = DEFAULT_MODEL, policy: str | Policy = "full", budget: int | None = None,
                 kv_memory: int | str = 0, device: str = "cpu", dtype: str = "auto", batch_size: int = 8,
                 prefill_chunk: int = 0, seed: int = 0, **knobs) -> None:
        if isinstance(policy, Policy):
            if budget is not None or knobs:
                raise SkipKVError("LLM: give budget and knobs with a policy name, or set them on the Policy itself")
            self.policy = policy
        elif isinstance(policy, str):
            self.policy = make_policy(policy, budget=budget, **knobs)
        else:
            raise SkipKVError(f"LLM policy must be a registered name or a Policy, got {type(policy).__name__}")
        if isinstance(kv_memory, str):
            kv_memory = parse_bytes(kv_memory)
        self.config = EngineConfig(batch_size=batch_size, prefill_chunk=prefill_chunk, kv_memory=kv_memory)
        self.bundle = load_model(model, dtype=dtype, device=device, seed=seed)

    def get_tokenizer(self):
        return self.bundle.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt (a string is one prompt; a list of ints one tokenized prompt), sent as it is.
        One SamplingParams for all, or one per prompt. Returns one RequestOutput per prompt, in order."""
        one = isinstance(prompts, str) or (bool(prompts) and all(isinstance(t, int) for t in prompts))
        batch: list = [prompts] if one else list(prompts)
        prompts = batch
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, str):
            raise SkipKVError(f"generate() takes SamplingParams, got the string {params!r}; the policy is "
                              "LLM(policy=...)")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts) or not all(isinstance(p, SamplingParams) for p in plist):
            raise SkipKVError(f"generate() takes one SamplingParams or one per prompt ({len(prompts)}), "
                              f"got {params!r:.80}")
        tok = self.bundle.tokenizer
        ids = [encode_prompt(tok, p) for p in prompts]
        # n completions of a prompt are n engine requests; sampled ones draw from seeds seed, seed + 1, ...
        flat_ids, flat_params, owner = [], [], []
        for i, (p_ids, sp) in enumerate(zip(ids, plist)):
            for j in range(sp.n):
                flat_ids.append(p_ids)
                flat_params.append(dataclasses.replace(sp, n=1, seed=sp.seed + j))
                owner.append((i, j))
        results = generate(self.bundle, flat_ids, flat_params, self.policy, self.config, progress=use_tqdm)
        outs = [RequestOutput(request_id=str(i), prompt=p if isinstance(p, str) else None, prompt_token_ids=p_ids)
                for i, (p, p_ids) in enumerate(zip(prompts, ids))]
        for (i, j), r, sp in zip(owner, results, flat_params):
            outs[i].outputs.append(_completion(j, r, sp.stop, tok))
        return outs

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or several, each with the tokenizer's chat
        template applied and the assistant's turn opened; then `generate`."""
        convs: list = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.bundle.tokenizer
        if not getattr(tok, "chat_template", None):
            raise SkipKVError(f"model {self.bundle.name!r} has no chat template; use generate() with plain prompts")
        for c in convs:
            if not isinstance(c, Sequence) or not c or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                               for m in c):
                raise SkipKVError("chat() takes a conversation: a list of {'role': ..., 'content': ...} messages "
                                  "(or a list of such lists)")
        texts = [tok.apply_chat_template(list(c), tokenize=False, add_generation_prompt=True) for c in convs]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)
