"""KVzip (Kim et al., NeurIPS 2025, arXiv 2505.23416): query-agnostic compression by context reconstruction.
Registered so that it is listed and named, but REFUSED: the engine cannot run it yet.

    skipkv generate --model random:qwen2 --policy kvzip "..."   # -> skipkv: error: policy kvzip is not runnable ...

The method: after the prompt is prefilled, the model is fed "Repeat the previous context:" followed by the
context itself (in chunks), attending to the cached prompt; each cached entry scores the most attention any of
those reconstruction queries (any head of its kv group) gives it; the entries that reconstruction needs least are
evicted, and the reconstruction's own entries are dropped. 2-3x the prefill cost (kvpress kvzip_press.py).

Why it is refused rather than approximated: the reconstruction is a second forward inside prefill, through every
layer, whose entries must be staged in the slot store and then removed, and whose attention must be reduced by a
max per cached entry inside the attention backend (which only sums, for H2O, today). That touches the runner's
prefill, the attention backend, the store's accumulators and the memory plan that admission relies on (a prompt
of P tokens would stage P + P + template entries per layer). Scoring without the reconstruction (e.g. from the
prompt's own queries) would be another method under KVzip's name. Until the engine runs the extra forward,
`make_policy("kvzip")` and `--policy kvzip` fail with a one-line error (tests/test_frontier_policies.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from skipkv.policies import POLICIES
from skipkv.policies.base import Policy


@POLICIES.register("kvzip")
@dataclass(frozen=True)
class KVzip(Policy):
    paper = "KVzip (arXiv 2505.23416)"
    keeps = ("not runnable yet, refused with a one-line error: KVzip keeps the entries that get the most attention "
             "while the model reconstructs its context (\"Repeat the previous context\"), a second forward inside "
             "prefill that the engine does not run")
    unavailable: ClassVar[str] = ("policy kvzip is not runnable yet: its context-reconstruction forward inside prefill "
                                  "is not implemented in the engine (see policies/kvzip.py)")
