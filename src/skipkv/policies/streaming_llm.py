"""StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453): attention sinks + a window of recent tokens.

    skipkv generate --model random:qwen2 --policy streaming_llm --budget 64 --sink 4 "Hello"

Keeps the first `sink` tokens and the newest `budget - sink`. Departures from the paper: positions are
not re-assigned inside the cache (keys keep the RoPE of their true position, as the R-KV/SkipKV baselines
do), and eviction happens every `interval` steps rather than every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy


@POLICIES.register("streaming_llm")
@dataclass(frozen=True)
class StreamingLLM(Policy):
    paper = "StreamingLLM (arXiv 2309.17453)"
    keeps = "`sink` first tokens + the newest"
    contract_knobs = {"window": 0, "sink": 4}

    sink: int = knob(4, "oldest tokens always kept (attention sinks)", ge=0)
    # Every non-sink slot already goes to the newest tokens.
    window: int = knob(0, "unused: every non-sink slot holds the newest tokens", ge=0)

    def score(self, obs: Observation) -> torch.Tensor:
        # Newer is better: the shared selection then keeps the sinks and the newest budget - sink tokens.
        b, H, n, _ = obs.keys.shape
        return torch.arange(n, dtype=torch.float32, device=obs.keys.device).expand(b, H, n)
