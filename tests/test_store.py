"""The slot store against a naive per-slot, per-head list of entries."""

from __future__ import annotations

import pytest
import torch

from skipkv.cache import KVStore

L, S, H, D = 2, 3, 2, 4


def entries(store: KVStore, layer: int, slot: int, head: int) -> list[tuple[int, list[float]]]:
    n = int(store.lengths[layer, slot])
    return [(int(store.pos[layer][slot, head, j]), store.k[layer][slot, head, j].tolist()) for j in range(n)]


def test_append_compact_move_against_lists():
    torch.manual_seed(0)
    store = KVStore(L, S, H, D, capacity=10, dtype=torch.float64)
    ref = {(l, s, h): [] for l in range(L) for s in range(S) for h in range(H)}
    # a ragged prefill of slots 0..2: 3, 5 and 2 real tokens (rows padded to 5)
    real = torch.tensor([3, 5, 2])
    k = torch.randn(S, H, 5, D, dtype=torch.float64)
    pos = torch.arange(5).expand(S, 5)
    for l in range(L):
        store.append(l, 0, k, k.clone(), pos)
    store.advance(0, real)
    for (_, s, h), lst in ref.items():
        lst += [(p, k[s, h, p].tolist()) for p in range(int(real[s]))]
    # one decode token for slots 1..2 (start = 1)
    k1 = torch.randn(2, H, 1, D, dtype=torch.float64)
    pos1 = torch.tensor([[5], [2]])
    for l in range(L):
        store.append(l, 1, k1, k1.clone(), pos1)
    store.advance(1, torch.tensor([1, 1]))
    for (_, s, h), lst in ref.items():
        if s > 0:
            lst.append((int(pos1[s - 1, 0]), k1[s - 1, h, 0].tolist()))
    for key, lst in ref.items():
        assert entries(store, *key) == lst
    # compact slot 1 in layer 0 to different entries per head
    keep = torch.tensor([[[0, 2, 5], [1, 3, 4]]])
    store.compact(0, torch.tensor([1]), keep)
    for h in range(H):
        ref[(0, 1, h)] = [ref[(0, 1, h)][j] for j in keep[0, h].tolist()]
    for key, lst in ref.items():
        assert entries(store, *key) == lst
    # move slot 2 into slot 0 (slot 0 finished)
    store.move(2, 0)
    for l in range(L):
        for h in range(H):
            ref[(l, 0, h)] = ref[(l, 2, h)]
            ref[(l, 2, h)] = []
    for key, lst in ref.items():
        assert entries(store, *key) == lst


def test_bytes_accounting():
    store = KVStore(L, S, H, D, capacity=8, dtype=torch.bfloat16)
    assert store.bytes_per_entry == 2 * H * D * 2
    assert store.allocated_bytes() == L * S * 8 * store.bytes_per_entry
    store.lengths[:, 1] = torch.tensor([5, 3])
    assert store.held_bytes(1) == 8 * store.bytes_per_entry
    store.ensure_capacity(20)
    assert store.capacity == 20 and store.peak_allocated == store.allocated_bytes()
    store.resize(8)
    assert store.allocated_bytes() < store.peak_allocated
    assert int(store.lengths[0, 1]) == 5  # lengths survive reallocation


def test_overflow_is_an_error():
    store = KVStore(1, 1, H, D, capacity=2, dtype=torch.float32)
    k = torch.zeros(1, H, 3, D)
    with pytest.raises(RuntimeError, match="overflow"):
        store.append(0, 0, k, k, torch.arange(3)[None])


def test_per_layer_lengths_and_capacities_against_lists():
    """Layers compacted to different lengths: appends land at each layer's own length, a per-layer resize
    keeps every entry, `move` carries each layer's own count, and the bytes follow the capacities."""
    torch.manual_seed(1)
    store = KVStore(L, S, H, D, capacity=8, dtype=torch.float64, aux=("attn",))
    ref = {(l, s, h): [] for l in range(L) for s in range(S) for h in range(H)}
    k = torch.randn(S, H, 6, D, dtype=torch.float64)
    for l in range(L):
        store.append(l, 0, k, k.clone(), torch.arange(6).expand(S, 6))
    store.advance(0, torch.tensor([6, 6, 6]))
    for (_, s, h), lst in ref.items():
        lst += [(p, k[s, h, p].tolist()) for p in range(6)]
    # layer 0 of slot 1 keeps 2 entries, layer 1 keeps 4 (the same for both heads: layer-level)
    for l, keep in ((0, [1, 5]), (1, [0, 2, 3, 5])):
        idx = torch.tensor(keep).expand(1, H, -1)
        store.compact(l, torch.tensor([1]), idx)
        for h in range(H):
            ref[(l, 1, h)] = [ref[(l, 1, h)][j] for j in keep]
    assert store.lengths[:, 1].tolist() == [2, 4]
    # one decode token for slot 1 lands at index 2 in layer 0 and at index 4 in layer 1
    k1 = torch.randn(1, H, 1, D, dtype=torch.float64)
    for l in range(L):
        store.append(l, 1, k1, k1.clone(), torch.tensor([[6]]))
    store.advance(1, torch.tensor([1]))
    for l in range(L):
        for h in range(H):
            ref[(l, 1, h)].append((6, k1[0, h, 0].tolist()))
    # move slot 1 into slot 2, drop slot 0, then shrink each layer to what its slots hold
    store.move(1, 2)
    store.clear(0)
    for l in range(L):
        for h in range(H):
            ref[(l, 2, h)], ref[(l, 1, h)], ref[(l, 0, h)] = ref[(l, 1, h)], [], []
    assert store.lengths[:, 2].tolist() == [3, 5]
    store.resize([3, 5])
    assert store.capacities == [3, 5] and store.capacity == 5
    for key, lst in ref.items():
        assert entries(store, *key) == lst
    assert store.allocated_bytes() == S * (5 + 3) * store.bytes_per_entry
    assert store.allocated_total_bytes() == S * (5 + 3) * (store.bytes_per_entry + H * 4 * 2)  # + pos + attn
    assert store.held_bytes(2) == 8 * store.bytes_per_entry
    with pytest.raises(ValueError, match="layer 1"):
        store.resize([3, 4])
    store.ensure_capacity(4)  # grows only the layers below 4
    assert store.capacities == [4, 5]
    with pytest.raises(RuntimeError, match="overflow"):
        store.append(0, 2, torch.zeros(1, H, 2, D, dtype=torch.float64), torch.zeros(1, H, 2, D, dtype=torch.float64),
                     torch.tensor([[7, 8]]))
