"""Admission order: which waiting requests enter the batch, and when — by free slots and by KV memory.

Waiting requests are ordered by prompt length when `group_by_length` is on (SkipKV's batch grouping: a
batched prefill then pads little; a long prompt can be passed over while shorter ones keep arriving, so a
server that must be fair turns it off). Whenever no admitted group is still prefilling, the next requests
from the head of the queue are admitted together (continuous batching), as many as

- `batch_size` allows (a cap on requests holding a slot),
- `prefill_budget` allows (padded prompt tokens of one prefill step, summed over the group; one always enters),
- and `kv_memory` allows: engine/memory.py (`KVMemory.fits`) says whether the store, sized for the running
  requests and the group over its whole life, stays within the cap. A request that can never fit, even
  alone, is refused when it is added (`KVMemory.check`).

Admission is first come, first served within that order: when the head does not fit, nobody passes it, and
it enters once running requests finish (it fits alone, so this never hangs).

    Scheduler(EngineConfig(kv_memory=48 << 20), KVMemory(num_layers=24, entry_bytes=512, cap=48 << 20))
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from skipkv.config import EngineConfig
from skipkv.engine.memory import KVMemory, chunk_width
from skipkv.engine.request import Request


class Scheduler:
    def __init__(self, config: EngineConfig, memory: KVMemory) -> None:
        self.config = config
        self.memory = memory
        self.waiting: list[Request] = []
        self._keys: list[tuple[int, int]] = []  # sort keys of `waiting`
        self._seq = 0

    def add(self, r: Request) -> None:
        """Queue `r` (its memory plan is made here); SkipKVError if it can never fit under the cap."""
        self.memory.check(r)
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

    def fits(self, need: torch.Tensor, num_running: int, group: Sequence[Request]) -> bool:
        """May `group` join `num_running` decoding requests that need `need` [L] entries per layer?"""
        cfg = self.config
        if num_running + len(group) > cfg.batch_size:
            return False
        if cfg.prefill_budget and len(group) > 1:
            longest = max(r.prompt_len for r in group)
            if len(group) * chunk_width(cfg.prefill_chunk, longest) > cfg.prefill_budget:
                return False
        return self.memory.fits(need, num_running, group)

    def admit(self, need: torch.Tensor, num_running: int) -> list[Request]:
        """Take the next group to prefill from the head of the queue (possibly none), next to `num_running`
        decoding requests that need `need` [L] entries per layer (memory.running_need)."""
        group: list[Request] = []
        while len(group) < len(self.waiting) and self.fits(need, num_running, group + [self.waiting[len(group)]]):
            group.append(self.waiting[len(group)])
        del self.waiting[:len(group)], self._keys[:len(group)]
        return group

    def __bool__(self) -> bool:
        return bool(self.waiting)
