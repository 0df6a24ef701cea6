"""`SlotCache`: the transformers `Cache` subclass through which HF attention layers write into the slot store.

The model calls `cache.update(k, v, layer_idx)` with post-RoPE keys; we append them to the slot store at each
request's own length and hand back views of the slots. The per-forward context (which slots, true positions)
is set by the engine before every forward. A head-split store (store.py) gets each kv head written into its
own unit at that head's own length; the attention backend then reads the units itself (attention.py), so
`update` hands back the new keys and values only.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from skipkv.cache.store import KVStore


class SlotCache(Cache):
    def __init__(self, store: KVStore) -> None:
        super().__init__(layers=[])
        self.store = store
        self.start = 0  # first slot of the rows in the current forward
        self.positions: torch.Tensor | None = None  # [B, T] true positions of the current forward's tokens

    def bind(self, start: int, positions: torch.Tensor) -> None:
        # Stored as int32 once per forward (the store's position dtype), not once per layer.
        self.start, self.positions = start, positions.to(torch.int32)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        assert self.positions is not None, "SlotCache.bind() must be called before a forward"
        store = self.store
        if store.head_split:
            H = store.split
            for h in range(H):
                store.append(layer_idx * H + h, self.start, key_states[:, h:h + 1], value_states[:, h:h + 1],
                             self.positions)
            return key_states, value_states
        return store.append(layer_idx, self.start, key_states, value_states, self.positions)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        s = self.store.split
        return int(self.store.lengths[layer_idx * s:(layer_idx + 1) * s].max())

    def __len__(self) -> int:
        return self.store.model_layers
