"""Admission: which waiting requests enter the batch, and when.

Waiting requests are ordered by prompt length when `group_by_length` is on (SkipKV's batch grouping: a
batched prefill then pads little). Whenever slots are free — at the start, and each time requests finish —
the next ones are admitted (continuous batching), so a finished request's slot is refilled at once.
"""

from __future__ import annotations

from collections import deque

from skipkv.engine.request import Request


class Scheduler:
    def __init__(self, requests: list[Request], max_running: int, group_by_length: bool = True) -> None:
        order = sorted(requests, key=lambda r: r.prompt_len) if group_by_length else list(requests)
        self.waiting: deque[Request] = deque(order)
        self.max_running = max_running

    def admit(self, num_running: int) -> list[Request]:
        free = self.max_running - num_running
        return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]

    def __bool__(self) -> bool:
        return bool(self.waiting)
