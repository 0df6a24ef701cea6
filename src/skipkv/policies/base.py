"""The policy contract: a frozen dataclass that scores cached tokens; the engine decides when, the store gathers.

A policy declares what it needs (`needs`), and returns per-token scores [b, H, n] for one layer
(`score`). The shared `select` keeps the sink and window tokens and the best-scoring rest, `budget` in all.
The runner compresses layer by layer, grouping rows of equal length in that layer, so a policy may leave
layers at different lengths (per-layer budgets). Model-wide policies (`model_wide = True`, LaProx) instead
get every layer of one request at once through `select_model_wide` and return one keep tensor per layer, of
different lengths; the store gives each layer its own capacity, so the bytes follow.

Head-split policies (`head_split`, LaProx at granularity head, Ada-KV) let the kv heads of one layer keep
different counts: the store then holds each (layer, kv head) as its own unit (cache/store.py), observations
come one unit at a time (`Observation.kv_head`; keys [b, 1, n, D], queries the head's G query heads) and keep
tensors are [1, 1, K_u]; memory asks `head_capacity`/`head_prefill_keep` ([L*H], layer-major) instead.

Memory: a policy says what each layer of a request can hold (`layer_capacity`, after the prompt is in;
`prefill_keep`, after a prefill compression); engine/memory.py sizes the store and admits requests from
these alone. A request may run a lower budget than the policy's (`for_request`, e.g. the server's kv_budget).

Protected prompts (`protect_prompt`, every compressing policy but the model-wide ones): the prompt is never
evicted and `budget` counts generated tokens. `for_request` realises it per request as `budget + P` and
`sink + P` (P = the prompt's length): the P oldest entries are the prompt, the sink is always kept, and kept
indices stay in cache order, so every capacity, admission and selection rule holds unchanged. Nothing is then
compressed at prefill (the prompt never exceeds P + budget), so `phase prefill` is refused with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from skipkv.config import check_fields, knob
from skipkv.errors import SkipKVError
from skipkv.scoring import protect_and_select

if TYPE_CHECKING:
    from skipkv.steering.hook import ResidualAdd

PHASES = ("prefill", "decode", "both")


@dataclass
class Observation:
    """What a policy sees of one layer for the b rows being compressed (all of equal length n)."""

    layer: int
    keys: torch.Tensor  # [b, H, n, D] post-RoPE
    values: torch.Tensor  # [b, H, n, D]
    positions: torch.Tensor  # [b, H, n] true positions (int32)
    queries: torch.Tensor | None  # [b, Hq, w, D] newest w queries (w = policy.query_window), if "queries" in needs
    attn: torch.Tensor | None  # [b, H, n] attention accumulated since each entry arrived, if "attn" in needs
    module: Any  # the HF attention module of this layer (o_proj, config: attributes read by name)
    is_prefill: bool
    states: list | None = None  # per-request policy state (see Policy.init_state), one per row
    kv_head: int | None = None  # head-split stores: the one kv head observed (keys [b, 1, n, D], queries its group)
    model: Any = None  # the HF causal LM, for a policy that runs its own forward over copies of the cache (KVzip)
    plan: Any = None  # that model's kernel plan (plan.KernelPlan), for such a forward


@dataclass(frozen=True)
class Policy:
    """Shared knobs. budget: tokens kept per request per kv head; window: newest tokens always kept;
    sink: oldest tokens always kept; interval: decode steps the cache may grow past the budget before the
    next compression (capacity = budget + interval); phase: when compression runs (prefill, decode, both)."""

    budget: int = knob(128, "tokens kept per request per kv head", gt=0)
    window: int = knob(8, "newest tokens always kept (and observation queries)", ge=1)
    sink: int = knob(0, "oldest tokens always kept", ge=0)
    interval: int = knob(128, "decode steps the cache may grow past the budget", gt=0)
    phase: str = knob("both", "when compression runs", choices=PHASES)
    protect_prompt: bool = knob(False, "never evict prompt entries; budget counts generated tokens "
                                "(each request runs with budget and sink raised by its prompt length)")

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    compresses: ClassVar[bool] = True
    model_wide: ClassVar[bool] = False
    # False: the policy scores the whole prompt at once, and the runner refuses chunked prefill for it.
    chunked_prefill: ClassVar[bool] = True
    # Non-empty: the policy is listed but cannot run (the reason, a one-line error raised when it is built).
    unavailable: ClassVar[str] = ""
    # The README's row (`skipkv policies --markdown`): the paper, and what the policy keeps.
    paper: ClassVar[str] = "—"
    keeps: ClassVar[str] = ""
    # Knobs the shared contract test (tests/test_policies.py) sets for this policy on its tiny model, over
    # its defaults (budget 24, window 4, interval 8): what the policy needs to compress there.
    contract_knobs: ClassVar[Mapping[str, object]] = {}

    def __post_init__(self) -> None:
        # Every knob is checked here, once, against the constraints declared beside its default (`knob`);
        # subclasses add only cross-field rules.
        if self.unavailable:
            raise SkipKVError(self.unavailable)
        check_fields(self, f"{self.name or type(self).__name__} policy knob")
        if not self.compresses:
            return
        if self.budget <= self.window + self.sink:
            raise SkipKVError(f"budget ({self.budget}) must exceed window + sink ({self.window} + {self.sink})")
        if self.protect_prompt and self.model_wide:
            raise SkipKVError(f"protect_prompt does not apply to {self.name or type(self).__name__}: it selects "
                              "among the prompt's own entries")
        if self.protect_prompt and self.phase == "prefill":
            raise SkipKVError("protect_prompt keeps the whole prompt, so phase prefill would never compress; "
                              "use phase decode or both")

    def requirements(self) -> frozenset[str]:
        """What the engine must capture for this instance: subset of {"queries", "attn", "hidden"}."""
        return self.needs

    def init_state(self, prompt_ids: list[int], tokenizer) -> Any:
        """Per-request state (e.g. a sentence tracker); None for stateless policies. (The state is typed Any
        here: each policy's own methods annotate the type it uses.)"""
        return None

    def observe(self, state: Any, token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Called once per forward per request when "hidden" is required: token_ids [T], hidden [T, hidden]
        (last layer, after the final norm), both on the host, hidden in fp32 (fp64 for an fp64 model)."""

    def trace_state(self, state: Any) -> dict | None:
        """Per-request information a retention viewer shows (`skipkv show`), asked at each compression and
        when the request finishes, only when tracing. JSON-able, spans in true positions, ends inclusive, e.g.
        {"sentences": [[start, end, label], ...], "flagged": [[start, end, sim], ...]} (label "check" or
        "other"; sim the similarity that flagged the sentence). None: nothing beyond what the cache held."""
        return None

    @property
    def query_window(self) -> int:
        """How many recent queries the engine must buffer for this policy."""
        return self.window

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Entries one request may hold at once in a layer once its prompt is in (every layer alike unless
        `layer_capacity` says otherwise): never more than it can ever hold (prompt + generation), so a budget
        or interval far beyond the request's length allocates nothing for it."""
        whole = prompt_len + max_new_tokens
        if not self.compresses:
            return whole
        if self.phase == "prefill":  # compress the prompt once, then grow freely
            return min(prompt_len, self.budget) + max_new_tokens
        if self.phase == "decode":  # the prompt stays whole until the first decode-time compression
            return min(max(self.budget + self.interval, prompt_len + 1), whole)
        return min(self.budget + self.interval, whole)

    def should_compress(self, length: int, is_prefill: bool, state: Any = None) -> bool:
        """Compress a request that holds `length` entries now? (after prefill, or after a decode step)
        `state` is the request's policy state (for budgets that depend on the request, e.g. a protected prompt)."""
        if not self.compresses:
            return False
        if is_prefill:
            return self.phase in ("prefill", "both") and length > self.budget
        return self.phase in ("decode", "both") and length >= self.budget + self.interval

    def layer_capacity(self, num_layers: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        """Entries each layer of one request may hold at once once its prompt is in, decode growth included
        ([L]; the engine sizes and admits by it, engine/memory.py). A hard bound: holding more is a bug."""
        return [self.capacity(prompt_len, max_new_tokens)] * num_layers

    def prefill_keep(self, num_layers: int, prompt_len: int, prefix_len: int) -> list[int]:
        """Entries each layer keeps at most after a prefill compression once `prefix_len` of the `prompt_len`
        prompt tokens are in ([L]; asked only where `should_compress` says a prefill chunk compresses, and
        it must also bound a layer that the compression leaves whole)."""
        return [self.budget] * num_layers

    @property
    def head_split(self) -> bool:
        """Do the kv heads of one layer keep different counts (a head-split store, module docstring)?"""
        return False

    def head_capacity(self, num_layers: int, num_kv_heads: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        """Head-split policies: `layer_capacity` per (layer, kv head), [L*H] layer-major. Default: each head
        its layer's."""
        caps = self.layer_capacity(num_layers, prompt_len, max_new_tokens)
        return [c for c in caps for _ in range(num_kv_heads)]

    def head_prefill_keep(self, num_layers: int, num_kv_heads: int, prompt_len: int, prefix_len: int) -> list[int]:
        """Head-split policies: `prefill_keep` per (layer, kv head), [L*H] layer-major. Default: each head its
        layer's."""
        keep = self.prefill_keep(num_layers, prompt_len, prefix_len)
        return [k for k in keep for _ in range(num_kv_heads)]

    def request_budget(self, prompt_len: int) -> int:
        """The budget (tokens per kv head, per layer on average) this policy runs a `prompt_len` prompt under."""
        return self.budget

    def for_request(self, prompt_len: int, budget: int | None) -> Policy:
        """The policy one request runs under: this one, or (`budget`) the same with a lower budget for this
        request only, at most `request_budget(prompt_len)`; with `protect_prompt`, its budget and sink raised
        by `prompt_len` (module docstring). SkipKVError for a budget it cannot run."""
        policy = self
        if budget is not None:
            if not self.compresses:
                raise SkipKVError(f"policy {type(self).__name__} keeps every token; a budget does not apply")
            top = self.request_budget(prompt_len)
            if isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= top:
                raise SkipKVError(f"budget must be an integer in (0, {top}] (the policy's for this prompt), "
                                  f"got {budget!r}")
            policy = replace(self, budget=budget)  # validates budget > window + sink
        if policy.protect_prompt and policy.compresses:
            # Applied once: the request's copy says protect_prompt=False, its sink already holds the prompt.
            policy = replace(policy, budget=policy.budget + prompt_len, sink=policy.sink + prompt_len,
                             protect_prompt=False)
        return policy

    def select_model_wide(self, obs: list[Observation]) -> list[torch.Tensor] | None:
        """Model-wide policies only: obs holds every layer of ONE request (b = 1, n_l entries in layer l; every
        (layer, kv head) unit, layer-major, if `head_split`). Returns one keep tensor [1, H, K_l] (ascending) per
        layer (per unit: [1, 1, K_u]), or None when nothing is evicted."""
        raise NotImplementedError

    def before_compress(self, states: list, is_prefill: bool) -> None:
        """Called once per compression for a group of requests (their states), before any layer is scored:
        per-request work that does not depend on the layer (e.g. SkipKV's sentence comparison)."""

    def stats(self, state: Any) -> dict:
        """Per-request figures merged into the request's result (`RequestResult.extra`) when it finishes."""
        return {}

    def steering_hook(self, bundle) -> ResidualAdd | None:
        """A `ResidualAdd` hook for this run (removed when generation ends), or None. Used by `generate` when
        no explicit steering factory is given."""
        return None

    def check_run(self, bundle, dataset: str | None = None, example_ids: tuple | list = ()) -> None:
        """Refuse, with a SkipKVError, a run this policy cannot do on this model (or on these evaluation
        examples), before anything is generated or written. Called by the eval runner after the model loads."""

    def score(self, obs: Observation) -> torch.Tensor:
        """Per-token scores [b, H, n]; higher is kept. Window and sink tokens are kept whatever they score."""
        raise NotImplementedError

    def kept_window(self, obs: Observation) -> int:
        """How many of the newest tokens are kept whatever they score."""
        return self.window

    def select(self, obs: Observation) -> torch.Tensor:
        """Keep indices [b, H, budget], ascending."""
        return protect_and_select(self.score(obs), self.budget, self.kept_window(obs), self.sink)

    @classmethod
    def knobs(cls) -> list[tuple[str, type, object, str]]:
        """(name, type, default, help) for every field: what the CLI and configs build flags from."""
        out = []
        for f in fields(cls):
            out.append((f.name, f.metadata.get("kind", type(f.default)), f.default, f.metadata.get("help", "")))
        return out
