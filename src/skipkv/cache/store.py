"""The slot KV store: preallocated per-layer tensors, in-place appends, compaction by keep indices.

Layout (one set of tensors per layer l, never after `repeat_kv`; each layer has its own capacity C_l, so a
policy that leaves layers at different lengths (LaProx, PyramidKV) really allocates less for short layers):
    k[l], v[l]       [S, H, C_l, D]   S slots, H kv heads, C_l capacity of layer l, D head dim
    pos[l]           [S, H, C_l]      int32 original (true) token position of every entry
    aux[name][l]     [S, H, C_l]      float32 per-entry accumulators that move with their entry (H2O's attention sum)
    lengths          [L, S]           int64 valid entries per slot and layer (the same for every head)

Head-split mode (`head_split=True`, for policies whose kv heads of one layer keep different counts: LaProx at
`granularity=head`, Ada-KV): every (model layer l, kv head h) becomes its own store layer ("unit") u = l*H + h
with ONE kv head, so `num_layers` is L*H, `num_kv_heads` is 1, `lengths` is [L*H, S] and each unit has its own
capacity C_u. Everything per layer above (capacities, `reshape`, `compact`, byte counts) then holds per head, so
a head that keeps fewer entries really allocates fewer bytes: no padding to a layer-wide length. The price is
H separate buffers per layer, so attention runs per kv head (attention.py) instead of one grouped call; the
uniform mode keeps its layout and code path. `model_layers`/`model_kv_heads` keep the model's L and H, and
`split` is the number of units per model layer (H in head-split mode, 1 otherwise). Chosen over one buffer
per layer with per-head lengths, which would have to allocate every head to the longest one's capacity.

Running requests always occupy slots [0, n) so that a forward over them reads plain views, never copies;
`move` fills a hole left by a finished request. Bytes are counted from what is allocated and from what each
request holds: `allocated_bytes`/`held_bytes`/`bytes_per_entry` count K/V only (what papers report);
`allocated_total_bytes`/`held_total_bytes`/`total_bytes_per_entry` add the int32 positions and the aux
accumulators that travel with every entry. `reshape` changes the number of slots and the capacities together,
so that an engine under a KV memory cap allocates only the slots its admitted requests reserved.

    python -c "from skipkv.cache import KVStore; import torch; \\
        s = KVStore(2, 4, 2, 16, 32, torch.float32); print(s.allocated_bytes())"
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to `device` without a host sync: on CUDA through pinned memory, non-blocking
    (a plain pageable copy waits for the stream). The pinned staging copy keeps later in-place edits of `t`
    (e.g. `lengths += ...`) out of the transfer."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class KVStore:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", aux: tuple[str, ...] = (),
                 head_split: bool = False) -> None:
        """`num_layers`, `num_kv_heads`: the model's; with `head_split` the store holds num_layers x num_kv_heads
        units of one kv head each (module docstring)."""
        self.model_layers, self.model_kv_heads, self.head_split = num_layers, num_kv_heads, head_split
        self.split = num_kv_heads if head_split else 1
        if head_split:
            num_layers, num_kv_heads = num_layers * num_kv_heads, 1
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.aux_names = tuple(aux)
        self.capacities = [0] * num_layers
        self.k: list[torch.Tensor] = [self._buf(0) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [self._buf(0) for _ in range(num_layers)]
        self.pos: list[torch.Tensor] = [self._side(0, torch.int32, -1) for _ in range(num_layers)]
        self.aux: dict[str, list[torch.Tensor]] = {n: [self._side(0, torch.float32, 0) for _ in range(num_layers)]
                                                   for n in self.aux_names}
        # Lengths live on the host: the engine reads them for control flow every step, so a device copy would sync.
        self.lengths = torch.zeros(num_layers, num_slots, dtype=torch.long)
        self.peak_allocated = 0  # K/V bytes
        self.peak_allocated_total = 0  # K/V + positions + accumulators
        self._allocate([capacity] * num_layers)

    def copy(self, aux: tuple[str, ...] | None = None) -> KVStore:
        """A deep copy holding the same entries; `aux`: the accumulators it keeps (default: all of them)."""
        keep = self.aux_names if aux is None else tuple(aux)
        if not set(keep) <= set(self.aux_names):
            raise ValueError(f"this store has no accumulator {sorted(set(keep) - set(self.aux_names))[0]!r}")
        mine = self.aux, self.aux_names
        self.aux, self.aux_names = {n: self.aux[n] for n in keep}, keep
        try:
            return copy.deepcopy(self)
        finally:
            self.aux, self.aux_names = mine

    def split_heads(self) -> KVStore:
        """A head-split copy of this uniform store (same slots, entries and accumulators; each unit's capacity
        its layer's): how a head-split policy continues from a prefill run with the uniform layout."""
        if self.head_split:
            raise ValueError("the store is head-split already")
        out = KVStore(self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim, 0, self.dtype, self.device,
                      aux=self.aux_names, head_split=True)
        out._allocate([c for c in self.capacities for _ in range(self.num_kv_heads)])
        for l in range(self.num_layers):
            for h in range(self.num_kv_heads):
                u = l * self.num_kv_heads + h
                out.k[u].copy_(self.k[l][:, h:h + 1])
                out.v[u].copy_(self.v[l][:, h:h + 1])
                out.pos[u].copy_(self.pos[l][:, h:h + 1])
                for n in self.aux_names:
                    out.aux[n][u].copy_(self.aux[n][l][:, h:h + 1])
                out.lengths[u] = self.lengths[l]
        return out

    def head_lengths(self, slot: int) -> list[list[int]]:
        """Entries `slot` holds per model layer and kv head, [L][H] (every head of a layer alike unless
        head-split)."""
        held = self.lengths[:, slot].view(self.model_layers, self.split).tolist()
        return [row * self.model_kv_heads if self.split == 1 else row for row in held]

    # ----------------------------------------------------------------------------------------- memory
    def _buf(self, capacity: int) -> torch.Tensor:
        return torch.zeros(self.num_slots, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def _side(self, capacity: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
        return torch.full((self.num_slots, self.num_kv_heads, capacity), fill, dtype=dtype, device=self.device)

    def _allocate(self, capacities: list[int], num_slots: int | None = None) -> None:
        """(Re)allocate the layers whose capacity changes (every layer when the slot count changes), keeping the
        valid prefix of each kept slot."""
        old_slots = self.num_slots
        self.num_slots = old_slots if num_slots is None else num_slots
        ks = min(old_slots, self.num_slots)
        for l, cap in enumerate(capacities):
            if cap == self.capacities[l] and self.num_slots == old_slots:
                continue
            keep = min(self.capacities[l], cap)
            k, v, pos = self._buf(cap), self._buf(cap), self._side(cap, torch.int32, -1)
            k[:ks, :, :keep] = self.k[l][:ks, :, :keep]
            v[:ks, :, :keep] = self.v[l][:ks, :, :keep]
            pos[:ks, :, :keep] = self.pos[l][:ks, :, :keep]
            self.k[l], self.v[l], self.pos[l] = k, v, pos
            for n in self.aux_names:
                a = self._side(cap, torch.float32, 0)
                a[:ks, :, :keep] = self.aux[n][l][:ks, :, :keep]
                self.aux[n][l] = a
            self.capacities[l] = cap
        if self.lengths.shape[1] != self.num_slots:
            lengths = torch.zeros(self.num_layers, self.num_slots, dtype=torch.long)
            lengths[:, :ks] = self.lengths[:, :ks]
            self.lengths = lengths
        self.peak_allocated = max(self.peak_allocated, self.allocated_bytes())
        self.peak_allocated_total = max(self.peak_allocated_total, self.allocated_total_bytes())

    def _per_layer(self, capacity: int | Sequence[int]) -> list[int]:
        caps = [int(capacity)] * self.num_layers if isinstance(capacity, int) else [int(c) for c in capacity]
        if len(caps) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} per-layer capacities, got {len(caps)}")
        return caps

    @property
    def capacity(self) -> int:
        """The largest layer capacity (every layer's when they are equal)."""
        return max(self.capacities)

    def ensure_capacity(self, capacity: int | Sequence[int]) -> None:
        """Grow (never shrink) to hold `capacity` entries per slot: one int for every layer, or one per layer.
        Growth happens only when requests are admitted or a prompt chunk is staged, never per decode step,
        so exact sizes cost few copies."""
        want = self._per_layer(capacity)
        self._allocate([max(w, c) for w, c in zip(want, self.capacities)])

    def resize(self, capacity: int | Sequence[int]) -> None:
        """Set the capacity exactly, one int for every layer or one per layer (e.g. shrink each layer back to
        what its slots keep + their decode growth after a long prompt was compressed)."""
        want = self._per_layer(capacity)
        for l, w in enumerate(want):
            if int(self.lengths[l].max()) > w:
                raise ValueError(f"cannot resize layer {l} to {w}: a slot holds {int(self.lengths[l].max())} entries")
        self._allocate(want)

    def reshape(self, num_slots: int, capacity: int | Sequence[int]) -> None:
        """Set the number of slots and the capacities (one int for every layer, or one per layer) exactly;
        slots [0, num_slots) keep their entries."""
        want = self._per_layer(capacity)
        if num_slots < self.num_slots and int(self.lengths[:, num_slots:].max()) > 0:
            raise ValueError(f"cannot drop to {num_slots} slots: a higher slot holds entries")
        held = self.lengths[:, :num_slots]
        for l, w in enumerate(want):
            if held.numel() and int(held[l].max()) > w:
                raise ValueError(f"cannot reshape layer {l} to capacity {w}: a slot holds {int(held[l].max())} entries")
        if num_slots != self.num_slots or want != self.capacities:
            self._allocate(want, num_slots)

    @property
    def bytes_per_entry(self) -> int:
        """K/V bytes of one cached token in one layer, over all kv heads (one unit, i.e. one head, if head-split)."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def total_bytes_per_entry(self) -> int:
        """All bytes of one cached token in one layer: K/V + its int32 positions + its float32 accumulators."""
        return self.bytes_per_entry + self.num_kv_heads * 4 * (1 + len(self.aux_names))

    def allocated_bytes(self) -> int:
        """Bytes of the K/V buffers as allocated (all slots, all layers)."""
        return self.num_slots * sum(self.capacities) * self.bytes_per_entry

    def allocated_total_bytes(self) -> int:
        """Bytes of every per-entry buffer as allocated: K/V, positions and accumulators."""
        return self.num_slots * sum(self.capacities) * self.total_bytes_per_entry

    def held_bytes(self, slot: int) -> int:
        """Bytes of K/V that `slot` holds right now, summed over layers."""
        return int(self.lengths[:, slot].sum()) * self.bytes_per_entry

    def held_total_bytes(self, slot: int) -> int:
        """K/V + position + accumulator bytes that `slot` holds right now, summed over layers."""
        return int(self.lengths[:, slot].sum()) * self.total_bytes_per_entry

    # ----------------------------------------------------------------------------------------- writes
    def append(self, layer: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new entries per row into slots [start, start+B) of `layer` at each slot's current length.

        k_new, v_new: [B, H, T, D]; positions: [B, T] true positions. Rows that are padding past their real
        length write harmless junk beyond it: `advance` later moves each length by that row's real count.
        Returns views [B, H, K, D] of the slots with K = max(length) + T.
        """
        B, _, T, _ = k_new.shape
        base = self.lengths[layer, start:start + B]
        b0, top = (int(base[0]),) * 2 if B == 1 else (int(base.min()), int(base.max()))
        top += T
        if top > self.capacities[layer]:
            raise RuntimeError(f"KV slot overflow: need {top} entries in layer {layer}, "
                               f"capacity {self.capacities[layer]}")
        if b0 + T == top:
            # Every row at the same length (always so at batch 1): plain slice writes, no index tensors.
            self.k[layer][start:start + B, :, b0:top] = k_new
            self.v[layer][start:start + B, :, b0:top] = v_new
            self.pos[layer][start:start + B, :, b0:top] = positions[:, None, :]
            for n in self.aux_names:  # a reused entry must not inherit the previous occupant's accumulator
                self.aux[n][layer][start:start + B, :, b0:top] = 0.0
            return self.k[layer][start:start + B, :, :top], self.v[layer][start:start + B, :, :top]
        rows = torch.arange(start, start + B, device=self.device)
        if T == 1:
            idx = to_device(base, self.device)
            self.k[layer][rows, :, idx] = k_new[:, :, 0]
            self.v[layer][rows, :, idx] = v_new[:, :, 0]
            self.pos[layer][rows, :, idx] = positions[:, :1].to(torch.int32).expand(B, self.num_kv_heads)
            for n in self.aux_names:  # a reused entry must not inherit the previous occupant's accumulator
                self.aux[n][layer][rows, :, idx] = 0.0
        else:
            idx = to_device(base, self.device)[:, None] + torch.arange(T, device=self.device)  # [B, T]
            self.k[layer][rows[:, None], :, idx] = k_new.transpose(1, 2)
            self.v[layer][rows[:, None], :, idx] = v_new.transpose(1, 2)
            pos = positions.to(torch.int32)[:, :, None].expand(B, T, self.num_kv_heads)
            self.pos[layer][rows[:, None], :, idx] = pos
            for n in self.aux_names:
                self.aux[n][layer][rows[:, None], :, idx] = 0.0
        return self.k[layer][start:start + B, :, :top], self.v[layer][start:start + B, :, :top]

    def advance(self, start: int, counts: torch.Tensor, layers: range | None = None) -> None:
        """Add each row's real token count (host tensor [B]) to its length after a forward."""
        sl = slice(None) if layers is None else slice(layers.start, layers.stop)
        self.lengths[sl, start:start + len(counts)] += counts

    def compact(self, layer: int, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep entries `keep` [b, H, K] (ascending per head) of `slots` [b] in `layer`, moved to the front.
        Pass `slots` as a host tensor: the host lengths are indexed by it (a device one costs a sync)."""
        b, H, K = keep.shape
        host_slots = slots.cpu()
        slots = to_device(slots, self.device)
        keep = keep.to(self.device)
        idx = keep[..., None].expand(b, H, K, self.head_dim)
        for buf in (self.k[layer], self.v[layer]):
            buf[slots, :, :K] = torch.gather(buf[slots], 2, idx)
        self.pos[layer][slots, :, :K] = torch.gather(self.pos[layer][slots], 2, keep)
        for n in self.aux_names:
            self.aux[n][layer][slots, :, :K] = torch.gather(self.aux[n][layer][slots], 2, keep)
        self.lengths[layer, host_slots] = K

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` over slot `dst` (used to keep running requests in slots [0, n))."""
        if src == dst:
            return
        self.copy_slot(src, slice(dst, dst + 1))
        self.clear(src)

    def copy_slot(self, src: int, dsts: slice) -> None:
        """Copy what slot `src` holds (entries, positions, accumulators, lengths) over every slot in `dsts`, a
        contiguous range without `src` (a shared prompt prefix: engine/runner.py). `src` keeps its entries."""
        for l in range(self.num_layers):
            n = int(self.lengths[l, src])
            self.k[l][dsts, :, :n] = self.k[l][src, :, :n]
            self.v[l][dsts, :, :n] = self.v[l][src, :, :n]
            self.pos[l][dsts, :, :n] = self.pos[l][src, :, :n]
            for name in self.aux_names:
                self.aux[name][l][dsts, :, :n] = self.aux[name][l][src, :, :n]
        self.lengths[:, dsts] = self.lengths[:, src:src + 1]

    def clear(self, slot: int) -> None:
        self.lengths[:, slot] = 0
        for name in self.aux_names:
            for a in self.aux[name]:
                a[slot].zero_()
