"""FullKV: keep every token. The reference every other policy is measured against.

    skipkv generate --model random:qwen2 --policy full "Hello"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from skipkv.policies import POLICIES
from skipkv.policies.base import Policy


@POLICIES.register("full")
@dataclass(frozen=True)
class FullKV(Policy):
    """No eviction; the budget knobs are ignored."""
    keeps = "everything"

    compresses: ClassVar[bool] = False
