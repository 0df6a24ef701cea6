"""The model runner's compression half: bring rows down to their budgets, per layer or model-wide, and what a
policy observes of a layer (engine/runner.py's ModelRunner inherits it; the split follows the seam between running
forwards and choosing what the store keeps).

    runner.compress([(slot, request), ...], is_prefill=False)    # every row over its budget, scored and compacted
"""

from __future__ import annotations

import time
from typing import Any

import torch

from skipkv.attention import QueryBuffer
from skipkv.cache import KVStore
from skipkv.cache.store import to_device
from skipkv.engine.request import Request
from skipkv.engine.trace import RequestTrace, token_texts
from skipkv.plan import KernelPlan
from skipkv.policies.base import Observation, Policy


class Compression:
    """Methods of ModelRunner that choose what the slot store keeps; the attributes are ModelRunner's."""

    store: KVStore
    queries: QueryBuffer | None
    model: Any  # the HF causal LM (a policy may run its own forward over copies of what it observes: KVzip)
    plan: KernelPlan  # its kernel plan (plan.py), enforce_eager applied
    layers: Any  # the model's decoder layers (their attention modules are what policies may read)
    tokenizer: Any
    trace: bool
    compressions: int
    compress_seconds: float
    _reshape_due: bool

    def compress(self, rows: list[tuple[int, Request]], is_prefill: bool) -> None:
        """Bring each (slot, request) in `rows` down to its budget. Per layer, rows of equal length and policy (a
        request may run a lower budget than the engine's policy) are scored together; a model-wide policy sees
        every layer of one row at once (rows split the budget differently)."""
        if not rows:
            return
        self._reshape_due = True
        t0 = time.perf_counter()
        # Per-request work that does not depend on the layer (e.g. SkipKV's sentence comparison): once per compression.
        by_policy: dict[Policy, list] = {}
        for _, r in rows:
            by_policy.setdefault(r.policy, []).append(r.state)
        for policy, states in by_policy.items():
            policy.before_compress(states, is_prefill)
        per_layer = [(s, r) for s, r in rows if not r.policy.model_wide]
        done = per_layer + [(s, r) for s, r in rows
                            if r.policy.model_wide and self._compress_model_wide(s, r, is_prefill)]
        if per_layer:
            for l in range(self.store.num_layers):
                groups: dict[tuple[int, Policy], list[tuple[int, Request]]] = {}
                for s, r in per_layer:
                    groups.setdefault((int(self.store.lengths[l, s]), r.policy), []).append((s, r))
                for (n, policy), group in groups.items():
                    host_slots = torch.tensor([s for s, _ in group])
                    slots = to_device(host_slots, self.store.device)
                    states = [r.state for _, r in group]
                    self.store.compact(l, host_slots,
                                       policy.select(self._observe(policy, l, slots, n, is_prefill, states)))
        spent = time.perf_counter() - t0
        self.compress_seconds += spent
        share = spent / len(rows)
        if self.trace:  # outside the timing: compress_seconds is the same with or without tracing
            self._record_trace(rows)
        self.compressions += len(done)
        for _, r in rows:
            r.compress_seconds += share
        for _, r in done:
            r.compressions += 1

    def _compress_model_wide(self, s: int, r: Request, is_prefill: bool) -> bool:
        """One row through `policy.select_model_wide`; False when it kept everything (nothing evicted)."""
        host_slots = torch.tensor([s])
        slots = to_device(host_slots, self.store.device)
        obs = [self._observe(r.policy, l, slots, int(self.store.lengths[l, s]), is_prefill, [r.state])
               for l in range(self.store.num_layers)]
        keeps = r.policy.select_model_wide(obs)
        if keeps is None:
            return False
        for l, keep in enumerate(keeps):
            self.store.compact(l, host_slots, keep)
        return True

    def _record_trace(self, rows: list[tuple[int, Request]]) -> None:
        """Tracing only: note what each row holds right after its compression (before the count moves)."""
        store = self.store
        for s, r in rows:
            if r.trace is None:
                r.trace = RequestTrace(store.model_layers, store.model_kv_heads,
                                       r.prompt_len + r.sampling.max_new_tokens)
            lengths = store.lengths[:, s]
            # Layers (units) may hold different lengths (and capacities): pad each one's positions to the longest.
            pos = torch.full((store.num_layers, store.num_kv_heads, int(lengths.max())), -1,
                             dtype=torch.int32, device=store.device)
            for l, p in enumerate(store.pos):
                pos[l, :, : int(lengths[l])] = p[s, :, : int(lengths[l])]
            if store.head_split:  # units -> [L, H, C]; a padded entry (-1) is never counted as kept
                pos = pos.view(store.model_layers, store.split, -1)
                lengths = lengths.view(store.model_layers, store.split).amax(dim=1)
            r.trace.record(pos, lengths, len(r.output_ids), r.policy.trace_state(r.state))

    def trace_result(self, r: Request) -> dict:
        """Tracing only: the finished request's JSON-able trace (token texts, compressions, final policy state)."""
        t = r.trace or RequestTrace(self.store.model_layers, self.store.model_kv_heads,
                                    r.prompt_len + len(r.output_ids))
        return t.to_json(token_texts(self.tokenizer, r.prompt_ids), token_texts(self.tokenizer, r.output_ids),
                         r.policy.trace_state(r.state))

    def _observe(self, policy: Policy, layer: int, slots: torch.Tensor, n: int, is_prefill: bool,
                 states: list) -> Observation:
        """Store layer `layer` (a (model layer, kv head) unit if head-split) of `slots`, its first n entries."""
        store = self.store
        model_layer, kv_head = divmod(layer, store.split) if store.head_split else (layer, None)
        queries = None
        if self.queries is not None:
            seen = int((self.queries.qpos[slots] >= 0).sum(dim=-1).min())
            queries = self.queries.recent(model_layer, slots, min(policy.query_window, seen))
            if kv_head is not None:  # the query heads that read this kv head
                G = queries.shape[1] // store.split
                queries = queries[:, kv_head * G:(kv_head + 1) * G]
        attn = store.aux["attn"][layer][slots, :, :n] if "attn" in store.aux else None
        return Observation(layer=model_layer, keys=store.k[layer][slots, :, :n], values=store.v[layer][slots, :, :n],
                           positions=store.pos[layer][slots, :, :n], queries=queries, attn=attn,
                           module=self.layers[model_layer].self_attn, is_prefill=is_prefill, states=states,
                           kv_head=kv_head, model=self.model, plan=self.plan)

