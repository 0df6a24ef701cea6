"""A skipkv policy inside plain transformers: `KVPress`, used the way kvpress's presses are.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from skipkv.press import KVPress
    press = KVPress("snapkv", budget=128)              # or KVPress("rkv", compression_ratio=0.5)
    with press(model, tokenizer):
        out = model.generate(input_ids, max_new_tokens=64)

Inside the block the model's decoder runs the skipkv attention backend over the engine's slot store
(cache/store.py), fed by two hooks on the decoder module: before each forward, the store takes the place of
transformers' cache (`SlotCache`) and the forward gets the engine's per-forward context; after it, the policy
observes and compresses exactly when the engine's runner would (`Policy.should_compress` after the prompt and
after every decode step, the runner's own `compress`). So a sequence generated this way is the sequence
`skipkv.generate` gives at batch 1 for the same policy and budget (tests/test_press.py). One sequence at a time
(a batch is refused); a forward at position 0 starts a new sequence. `compression_ratio` (kvpress's knob: the
share of the prompt evicted) sets each sequence's budget from its prompt: int(P * (1 - ratio)), at least
window + sink + 1; the policy's phase and interval still decide whether decode steps compress.

`press.hold()` leaves the forwards inside it uncompressed (the question after a compressed context, as
kvpress's pipeline keeps it out of compression): `skipkv.press_pipeline` does that for a context and questions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from skipkv.attention import BACKEND, StepContext
from skipkv.config import SamplingParams, check_fields, knob
from skipkv.engine.engine import new_request
from skipkv.engine.request import Request
from skipkv.engine.runner import NO_MASKS, ModelRunner
from skipkv.errors import SkipKVError
from skipkv.models import SUPPORTED_FAMILIES, ModelBundle, check_attention_layout
from skipkv.models.patches import routed
from skipkv.policies import Policy, make_policy

GROW = 64  # entries a full layer grows by at once when a sequence outgrows it (no reallocation per token)


@dataclass(frozen=True)
class _Ratio:
    compression_ratio: float = knob(0.5, "share of the prompt evicted", ge=0.0, lt=1.0)


class KVPress:
    """A registered policy (a name with its knobs as keywords, or a Policy) for transformers' `model.generate`
    and `pipeline`; `compression_ratio` in [0, 1) instead of a fixed budget (module docstring)."""

    def __init__(self, policy: str | Policy = "rkv", compression_ratio: float | None = None, **knobs) -> None:
        if isinstance(policy, Policy):
            if knobs:
                raise SkipKVError("KVPress: give knobs with a policy name, or set them on the Policy itself")
            self.policy = policy
        else:
            self.policy = make_policy(policy, **knobs)
        if compression_ratio is not None:
            check_fields(_Ratio(compression_ratio), "KVPress")
            if not self.policy.compresses:
                raise SkipKVError(f"KVPress: policy {type(self.policy).__name__} keeps every token; "
                                  "compression_ratio does not apply")
        self.compression_ratio = compression_ratio
        self._session: _Session | None = None
        self.request: Request | None = None  # the newest sequence (peak KV tokens and bytes, compressions, state)

    def __call__(self, model, tokenizer=None) -> contextlib.AbstractContextManager[KVPress]:
        """Apply this press to `model` (a Qwen2, Llama or Qwen3 *ForCausalLM) for the block. `tokenizer`: needed
        by policies that read the text (skipkv's sentences)."""
        return self._applied(model, tokenizer)

    @contextlib.contextmanager
    def _applied(self, model, tokenizer) -> Iterator[KVPress]:
        if self._session is not None:
            raise SkipKVError("KVPress is already applied to a model; leave that block first")
        family = getattr(model.config, "model_type", None)
        if family not in SUPPORTED_FAMILIES:
            raise SkipKVError(f"KVPress: model type {family!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_FAMILIES)})")
        check_attention_layout(model.config, family)
        if getattr(model.config, "_attn_implementation", None) == BACKEND:
            raise SkipKVError("KVPress: an Engine or another press is open on this model; close it first")
        bundle = ModelBundle(model, tokenizer, str(getattr(model.config, "_name_or_path", "") or family), family)
        # A steering file (SkipKV's and SEAL's `steering` knob) needs the engine's per-request gate each step.
        if getattr(self.policy, "steering", None):
            raise SkipKVError("KVPress: steering is not available inside model.generate; use skipkv.LLM")
        if "hidden" in self.policy.requirements() and tokenizer is None:
            raise SkipKVError(f"KVPress: policy {type(self.policy).__name__} reads the text; pass the tokenizer: "
                              "press(model, tokenizer)")
        session = _Session(self, bundle)
        self._session = session
        try:
            with routed(model), bundle.plan.sdpa_context(), session.hooked(), torch.inference_mode():
                yield self
        finally:
            self._session = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Forwards inside this block are not compressed (a question after a compressed context)."""
        if self._session is None:
            raise SkipKVError("KVPress.hold() is used inside `with press(model):`")
        self._session.holding = True
        try:
            yield
        finally:
            self._session.holding = False

    def budget_for(self, prompt_len: int) -> Policy:
        """The policy one sequence of a `prompt_len` prompt runs under (compression_ratio sets its budget)."""
        policy = self.policy
        if self.compression_ratio is not None:
            floor = policy.window + policy.sink + 1
            policy = replace(policy, budget=max(floor, int(prompt_len * (1 - self.compression_ratio))))
        return policy


class _Session:
    """The press on one model: the runner's store, query buffer and compression, one slot, one sequence."""

    def __init__(self, press: KVPress, bundle: ModelBundle) -> None:
        self.press, self.bundle = press, bundle
        self.runner = ModelRunner(bundle, press.policy, num_slots=1, unpad_prefill=False)
        self.request: Request | None = None
        self.holding = False
        self._pending: tuple[torch.Tensor, bool] | None = None  # the forward under way: its ids, is it a prefill

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        decoder = self.bundle.model.model
        handles = [decoder.register_forward_pre_hook(self.before, with_kwargs=True),
                   decoder.register_forward_hook(self.after, with_kwargs=True)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _start(self, ids: list[int]) -> Request:
        policy = self.press.budget_for(len(ids))
        # Sized as it goes (`_grow`), so the request's own max_new_tokens is not needed: one for the checks.
        r = new_request(self.bundle, ids, SamplingParams(max_new_tokens=1), policy, 0, frozenset(), "press prompt")
        store, queries = self.runner.store, self.runner.queries
        store.clear(0)
        if queries is not None:
            queries.clear(0)
        return r

    def _grow(self, T: int) -> None:
        store = self.runner.store
        need = (store.lengths[:, 0] + T).tolist()
        caps = store.capacities
        if any(n > c for n, c in zip(need, caps)):
            store.reshape(1, [c if n <= c else n + GROW for n, c in zip(need, caps)])

    def before(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise SkipKVError("KVPress: the decoder was called without input_ids (inputs_embeds are not supported)")
        B, T = ids.shape
        if B != 1:
            raise SkipKVError(f"KVPress: a batch of {B} sequences; run them one at a time, or use skipkv.LLM")
        pos = kwargs.get("position_ids")
        if pos is not None:
            start = int(pos[0, 0])
        else:  # no positions: the press's sequence goes on when its cache is passed back, else a new one starts
            ours = kwargs.get("cache", kwargs.get("past_key_values")) is self.runner.cache
            start = self.request.fed if ours and self.request is not None else 0
        if start == 0:
            self.request = self.press.request = self._start(ids[0].tolist())
        elif self.request is None or start != self.request.fed:
            held = self.request.fed if self.request is not None else 0
            raise SkipKVError(f"KVPress: a forward at position {start} does not continue the sequence in the press "
                              f"({held} tokens); start from position 0")
        r = self.request
        positions = torch.arange(r.fed, r.fed + T, device=ids.device)[None]
        self._grow(T)
        store = self.runner.store
        ctx = StepContext(store, 0, torch.tensor([T]), positions, self.runner.queries, "attn" in store.aux_names,
                          plan=self.runner.plan)
        self.runner.cache.bind(0, positions)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache", "attention_mask")}
        kwargs.update(input_ids=ids, position_ids=positions, cache=self.runner.cache, use_cache=True,
                      attention_mask=NO_MASKS, skipkv_ctx=ctx)
        # A prompt (or a chunk of one) is a prefill; one token after the prompt is a decode step.
        self._pending = (ids[0], T > 1 or start == 0)
        return (), kwargs

    def after(self, module, args: tuple, kwargs: dict, output):
        assert self._pending is not None and self.request is not None
        ids, prefill = self._pending
        self._pending = None
        r, runner = self.request, self.runner
        T = ids.shape[0]
        runner.store.advance(0, torch.tensor([T]))
        r.fed += T
        held = runner._note_memory(0, [r], decoding=not prefill)
        if runner.need_hidden:
            r.policy.observe(r.state, ids.cpu(), runner._host_hidden(output.last_hidden_state)[0])
        if not self.holding and r.policy.should_compress(held[0], prefill, r.state):
            runner.compress([(0, r)], is_prefill=prefill)
        return output
