"""KV memory, in one place: what each request may hold per layer, how the slot store is sized, and admission
under a KV memory cap (`EngineConfig.kv_memory`).

The slot store (cache/store.py) is one rectangle per layer: S slots x C_l entries in layer l, so it allocates
S x sum_l C_l entries, and C_l must cover the most ANY live slot holds in layer l (`store_bytes`). Under
per-layer budgets (PyramidKV) or a model-wide split (LaProx) two requests can hold different layers long, and
the rectangle then costs more than the sum of what they hold; everything below counts the rectangle.

What a request may hold comes from its policy, never from a default knob:
- `Policy.layer_capacity(L, prompt_len, max_new_tokens)`: the most entries each layer holds at once after its
  prompt is in (decode growth and `budget + interval` included);
- `Policy.prefill_keep(L, prompt_len, prefix_len)`: the most each layer keeps after a prefill compression
  (run when `Policy.should_compress` says so), which bounds prompt staging under chunked prefill.
With a head-split store (policies whose kv heads keep different counts) every "layer" here is one
(layer, kv head) unit of the store, and the policy answers per unit (`Policy.head_capacity`,
`Policy.head_prefill_keep`); `heads` is then H, the units per model layer.
`plan` turns these into a request's `Plan` once (the entries each layer holds before every prompt chunk, as
ModelRunner.prefill_step stages them: rows padded to the group's longest prompt, each chunk staged whole).

Sizing (`running_need`, `staging`): a decoding request needs, per layer, what it holds now plus the growth it
may still see, bounded by its layer capacity; a group being prefilled needs the staging of its next chunks.
Admission (`KVMemory.fits`): a group enters only if the store sized for the running requests' needs (exact:
read from the store) and the group's bound over its whole life (staging, then what it may keep and grow to)
stays within the cap. The running requests' needs never grow (a decode step fills room already counted,
a compression only frees), so the store never exceeds the cap afterwards either. A request whose bound
alone exceeds the cap is refused when it is added (`KVMemory.check`).

    python -c "from skipkv.engine.memory import chunk_width; print(chunk_width(512, 2000))"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skipkv.engine.request import Plan, Request
from skipkv.errors import SkipKVError


def chunk_width(chunk: int, longest: int) -> int:
    """Prompt tokens per prefill step for a group whose longest prompt is `longest` (0 = whole)."""
    return chunk if 0 < chunk < longest else longest


def _layer_capacity(r: Request, num_layers: int, heads: int) -> list[int]:
    P, M = r.prompt_len, r.sampling.max_new_tokens
    if heads == 1:
        return r.policy.layer_capacity(num_layers, P, M)
    return r.policy.head_capacity(num_layers // heads, heads, P, M)


def _prefill_keep(r: Request, num_layers: int, heads: int, prefix_len: int) -> list[int]:
    if heads == 1:
        return r.policy.prefill_keep(num_layers, r.prompt_len, prefix_len)
    return r.policy.head_prefill_keep(num_layers // heads, heads, r.prompt_len, prefix_len)


def trajectory(r: Request, num_layers: int, chunk: int, heads: int = 1) -> torch.Tensor:
    """Entries each layer of `r` holds (at most) before each of its prompt chunks and after the last, [K + 1, L].
    Follows ModelRunner.prefill_step: a chunk is appended to every layer, then the policy compresses when
    `should_compress` (on the longest layer) says so, leaving each layer at most `prefill_keep`."""
    P, policy = r.prompt_len, r.policy
    w = chunk_width(chunk, P)
    held = [0] * num_layers
    rows = [list(held)]
    for c0 in range(0, P, w):
        c1 = min(c0 + w, P)
        held = [h + c1 - c0 for h in held]
        if policy.should_compress(max(held), True, r.state):
            held = [min(h, k) for h, k in zip(held, _prefill_keep(r, num_layers, heads, c1))]
        rows.append(list(held))
    return torch.tensor(rows, dtype=torch.long)


def plan(r: Request, num_layers: int, chunk: int, heads: int = 1) -> Plan:
    """`r`'s Plan under prefill chunks of `chunk` tokens (0 = whole prompts); `num_layers` store layers, `heads`
    of them per model layer (head-split: H, else 1)."""
    M = r.sampling.max_new_tokens
    capacity = torch.tensor(_layer_capacity(r, num_layers, heads), dtype=torch.long)
    held = trajectory(r, num_layers, chunk, heads)
    final = held[-1]
    # Right after prefill the first token is sampled but not yet cached: M - 1 entries may still be appended.
    after = torch.maximum(final, torch.minimum(capacity, final + M - 1))
    width = chunk_width(chunk, r.prompt_len)
    stage = (held[:-1] + torch.tensor([min(width, r.prompt_len - k * width) for k in range(len(held) - 1)])[:, None])
    return Plan(capacity, held, after, torch.maximum(stage.amax(dim=0), after))


def _plan(r: Request) -> Plan:
    assert r.plan is not None, "a request is planned (KVMemory.plan) when it is queued"
    return r.plan


def staging(group: Sequence[Request], chunk: int) -> torch.Tensor:
    """Entries [L] each layer must hold while `group` is prefilled together, chunk by chunk: per chunk, the
    most any row holds before it plus the chunk (padding rows are staged whole too, see KVStore.append)."""
    longest = max(r.prompt_len for r in group)
    w = chunk_width(chunk, longest)
    K = -(-longest // w)
    # A row whose prompt ended holds what it kept; rows shorter than a chunk were planned as one chunk, which
    # is how the group stages them (their whole prompt lies in the group's first chunk).
    held = torch.stack([torch.cat([_plan(r).held[:-1], _plan(r).held[-1:].expand(K - len(_plan(r).held) + 1, -1)])
                        if len(_plan(r).held) <= K else _plan(r).held[:K] for r in group])  # [rows, K, L]
    widths = torch.tensor([min(w, longest - k * w) for k in range(K)])
    return (held.amax(dim=0) + widths[:, None]).amax(dim=0)


def slot_needs(lengths: torch.Tensor, running: Sequence[Request]) -> torch.Tensor:
    """Entries [L, n] each decoding request in slots [0, n) may need per layer from now on: what it holds now
    (lengths [L, >=n]) plus the growth it may still see, bounded by its layer capacity."""
    held = lengths[:, :len(running)]
    # Counted from what each request has fed, not from its outputs: within a step the decode has fed a token
    # whose sampled successor is added only after the next prefill chunk is staged (Engine._step).
    remaining = torch.tensor([r.to_feed() for r in running], dtype=torch.long)
    bound = torch.stack([_plan(r).capacity for r in running], dim=1) if running else held  # [L, n]
    return torch.maximum(held, torch.minimum(bound, held + remaining))


def running_need(lengths: torch.Tensor, running: Sequence[Request]) -> torch.Tensor:
    """Entries [L] each layer must hold for the decoding requests: the most any of them may need there."""
    if not running:
        return torch.zeros(lengths.shape[0], dtype=torch.long)
    return slot_needs(lengths, running).amax(dim=1)


def group_bound(group: Sequence[Request], chunk: int) -> torch.Tensor:
    """Entries [L] each layer may need for `group` from its admission on: its staging, then what any row may
    keep and grow to."""
    after = torch.stack([_plan(r).after for r in group]).amax(dim=0)
    return torch.maximum(staging(group, chunk), after)


class KVMemory:
    """The engine's KV memory: plans requests, sizes the store, admits under `cap` bytes (0 = no cap).
    `num_layers`: the store's layers (units, if head-split, `heads` per model layer); `entry_bytes`: K/V bytes
    of one entry in one of them."""

    def __init__(self, num_layers: int, entry_bytes: int, chunk: int = 0, cap: int = 0, heads: int = 1) -> None:
        self.num_layers, self.entry_bytes, self.chunk, self.cap = num_layers, entry_bytes, chunk, cap
        self.heads = heads

    def plan(self, r: Request) -> Plan:
        """Attach (once) and return `r`'s Plan."""
        if r.plan is None:
            r.plan = plan(r, self.num_layers, self.chunk, self.heads)
        return r.plan

    def store_bytes(self, slots: int, caps: torch.Tensor | Sequence[int]) -> int:
        """K/V bytes of a store of `slots` slots with per-layer capacities `caps`."""
        return slots * int(sum(int(c) for c in caps)) * self.entry_bytes

    def check(self, r: Request) -> None:
        """Plan `r`; SkipKVError when it can never fit under the cap, even alone."""
        need = self.store_bytes(1, self.plan(r).alone)
        if self.cap and need > self.cap:
            raise SkipKVError(f"request {r.request_id or r.index} needs up to {int(_plan(r).alone.sum())} KV entries "
                              f"over its {self.num_layers} layers ({need} bytes) but kv_memory is {self.cap} bytes")

    def staging(self, group: Sequence[Request]) -> torch.Tensor:
        return staging(group, self.chunk)

    def fits(self, need: torch.Tensor, num_running: int, group: Sequence[Request]) -> bool:
        """Can `group` be admitted next to `num_running` decoding requests needing `need` [L] (running_need)?"""
        if not self.cap or not group:
            return True
        caps = torch.maximum(need, group_bound(group, self.chunk))
        return self.store_bytes(num_running + len(group), caps) <= self.cap

    def reserved_bytes(self, lengths: torch.Tensor, running: Sequence[Request], cohort: Sequence[Request]) -> int:
        """What the live requests reserve, each counted on its own (the rectangle not included): a decoding
        request what it may still need (slot_needs), a prefilling one its bound when admitted alone."""
        total: int = int(slot_needs(lengths, running).sum()) if running else 0
        total += sum(int(_plan(r).alone.sum()) for r in cohort)
        return total * self.entry_bytes
