"""Admission: which waiting requests enter the batch, and when — by free slots and by KV memory.

Waiting requests are ordered by prompt length when `group_by_length` is on (SkipKV's batch grouping: a
batched prefill then pads little; a long prompt can be passed over while shorter ones keep arriving, so a
server that must be fair turns it off). Whenever no admitted group is still prefilling, the next requests
from the head of the queue are admitted together (continuous batching), as many as

- `batch_size` allows (a cap on requests holding a slot),
- `prefill_budget` allows (padded prompt tokens of one prefill step, summed over the group; one always enters),
- and `kv_memory` allows: the slot store is one rectangle, slots x capacity entries per layer, so the engine
  sizes it from reservations: slots = requests holding one, capacity = the largest reservation among them
  (and the staging of the group being prefilled). A request's reservation is what it can ever hold: the
  policy's capacity (`Policy.capacity`: budget + interval for decode-time policies, prompt + max_new_tokens
  for the full cache) or, if larger, the entries its prompt stages before prefill compression. Admission
  keeps slots x capacity x bytes per entry x layers <= kv_memory, so the store's allocated bytes never exceed
  the cap. A request whose reservation alone exceeds the cap is refused when it is added.

Admission is first come, first served within that order: when the head does not fit, nobody passes it, and
it enters once running requests finish (it fits alone, so this never hangs).

    Scheduler(EngineConfig(kv_memory=48 << 20), entry_bytes=12288)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from skipkv.config import EngineConfig
from skipkv.engine.request import Request
from skipkv.errors import SkipKVError


def chunk_width(chunk: int, longest: int) -> int:
    """Prompt tokens per prefill step for a group whose longest prompt is `longest` (0 = whole)."""
    return chunk if 0 < chunk < longest else longest


def staging(group: Sequence[Request], chunk: int) -> int:
    """Most entries any slot of `group` needs while the group is prefilled together, chunk by chunk.

    Rows are padded to the longest prompt and every chunk is staged whole (padding rows write past their
    length, see KVStore.append) before compression brings a row back to its budget, so a chunk [c0, c1) needs
    max(held) + (c1 - c0) entries; the simulation follows ModelRunner.prefill_step exactly.
    """
    longest = max(r.prompt_len for r in group)
    w = chunk_width(chunk, longest)
    held = [0] * len(group)
    peak = 0
    for c0 in range(0, longest, w):
        c1 = min(c0 + w, longest)
        peak = max(peak, max(held) + c1 - c0)
        for i, r in enumerate(group):
            held[i] += min(max(r.prompt_len - c0, 0), c1 - c0)
            if r.policy.should_compress(held[i], True, r.state):
                held[i] = r.policy.budget
    return peak


def reservation(r: Request, chunk: int) -> int:
    """Slot entries per layer that request `r` may hold at once: its policy's capacity, or its prompt staging."""
    return max(r.policy.capacity(r.prompt_len, r.sampling.max_new_tokens), staging([r], chunk))


class Scheduler:
    def __init__(self, config: EngineConfig, entry_bytes: int) -> None:
        self.config = config
        self.entry_bytes = entry_bytes  # bytes of one slot entry over all layers (K + V)
        self.waiting: list[Request] = []
        self._keys: list[tuple[int, int]] = []  # sort keys of `waiting`
        self._seq = 0

    def add(self, r: Request) -> None:
        """Queue `r` (its reservation is set here); SkipKVError if it can never fit under the cap."""
        r.reserve = reservation(r, self.config.prefill_chunk)
        cap = self.config.kv_memory
        if cap and r.reserve * self.entry_bytes > cap:
            raise SkipKVError(f"request {r.request_id or r.index} needs {r.reserve} KV entries per layer "
                              f"({r.reserve * self.entry_bytes} bytes over all layers) but kv_memory is {cap} bytes")
        self._seq += 1
        key = (r.prompt_len if self.config.group_by_length else 0, self._seq)
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self.waiting.insert(at, r)

    def remove(self, r: Request) -> bool:
        for i, w in enumerate(self.waiting):
            if w is r:
                del self.waiting[i], self._keys[i]
                return True
        return False

    def shape(self, running: Sequence[Request], group: Sequence[Request]) -> tuple[int, int]:
        """(slots, capacity) of the store holding `running` in slots [0, n) and `group` right after them."""
        live = list(running) + list(group)
        capacity = max((r.reserve for r in live), default=0)
        if group:
            capacity = max(capacity, staging(group, self.config.prefill_chunk))
        return len(live), capacity

    def fits(self, running: Sequence[Request], group: Sequence[Request]) -> bool:
        cfg = self.config
        if len(running) + len(group) > cfg.batch_size:
            return False
        if cfg.prefill_budget and len(group) > 1:
            longest = max(r.prompt_len for r in group)
            if len(group) * chunk_width(cfg.prefill_chunk, longest) > cfg.prefill_budget:
                return False
        if cfg.kv_memory:
            slots, capacity = self.shape(running, group)
            return slots * capacity * self.entry_bytes <= cfg.kv_memory
        return True

    def admit(self, running: Sequence[Request]) -> list[Request]:
        """Take the next group to prefill from the head of the queue (possibly none)."""
        group: list[Request] = []
        while len(group) < len(self.waiting) and self.fits(running, group + [self.waiting[len(group)]]):
            group.append(self.waiting[len(group)])
        del self.waiting[:len(group)], self._keys[:len(group)]
        return group

    def __bool__(self) -> bool:
        return bool(self.waiting)
