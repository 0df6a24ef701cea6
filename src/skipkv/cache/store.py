"""The slot KV store: preallocated per-layer tensors, in-place appends, compaction by keep indices.

Layout (one tensor per layer, never after `repeat_kv`):
    k[l], v[l]   [S, H, C, D]   S slots, H kv heads, C capacity, D head dim
    pos          [L, S, H, C]   int32 original (true) token position of every entry
    aux[name]    [L, S, H, C]   float32 per-entry accumulators that move with their entry (e.g. H2O's attention sum)
    lengths      [L, S]         int64 valid entries per slot and layer (the same for every head)

Running requests always occupy slots [0, n) so that a forward over them reads plain views, never copies;
`move` fills a hole left by a finished request. Bytes are counted from what is allocated (`allocated_bytes`)
and from what each request holds (`held_bytes`). `reshape` changes the number of slots and the capacity
together, so that an engine under a KV memory cap allocates only the slots its admitted requests reserved.

    python -c "from skipkv.cache import KVStore; import torch; s = KVStore(2, 4, 2, 16, 32, torch.float32); print(s.allocated_bytes())"
"""

from __future__ import annotations

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
                 dtype: torch.dtype, device: torch.device | str = "cpu", aux: tuple[str, ...] = ()) -> None:
        self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim = num_layers, num_slots, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.aux_names = tuple(aux)
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pos = torch.empty(0)
        self.aux: dict[str, torch.Tensor] = {}
        # Lengths live on the host: the engine reads them for control flow every step, so a device copy would sync.
        self.lengths = torch.zeros(num_layers, num_slots, dtype=torch.long)
        self.peak_allocated = 0
        self._allocate(capacity)

    # ----------------------------------------------------------------------------------------- memory
    def _allocate(self, capacity: int, num_slots: int | None = None) -> None:
        """(Re)allocate every buffer with `capacity` entries per slot (and `num_slots` slots, default: as now),
        keeping the valid prefix of each kept slot."""
        old_slots = len(self.k[0]) if self.k else 0
        self.num_slots = self.num_slots if num_slots is None else num_slots
        keep = min(self.capacity, capacity)
        ks = min(old_slots, self.num_slots)
        shape = (self.num_slots, self.num_kv_heads, capacity, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        aux_shape = (self.num_layers, self.num_slots, self.num_kv_heads, capacity)
        new_pos = torch.full(aux_shape, -1, dtype=torch.int32, device=self.device)
        new_aux = {n: torch.zeros(aux_shape, dtype=torch.float32, device=self.device) for n in self.aux_names}
        if keep and ks:
            for l in range(self.num_layers):
                new_k[l][:ks, :, :keep] = self.k[l][:ks, :, :keep]
                new_v[l][:ks, :, :keep] = self.v[l][:ks, :, :keep]
            new_pos[:, :ks, :, :keep] = self.pos[:, :ks, :, :keep]
            for n in self.aux_names:
                new_aux[n][:, :ks, :, :keep] = self.aux[n][:, :ks, :, :keep]
        if self.lengths.shape[1] != self.num_slots:
            lengths = torch.zeros(self.num_layers, self.num_slots, dtype=torch.long)
            lengths[:, :ks] = self.lengths[:, :ks]
            self.lengths = lengths
        # Drop the old buffers before counting, so the peak reflects the transient of holding both.
        self.k, self.v, self.pos, self.aux = new_k, new_v, new_pos, new_aux
        self.capacity = capacity
        self.peak_allocated = max(self.peak_allocated, self.allocated_bytes())

    def ensure_capacity(self, capacity: int) -> None:
        """Grow (never shrink) to hold exactly `capacity` entries per slot. Growth happens only when requests
        are admitted or a prompt chunk is staged, never per decode step, so exact sizes cost few copies."""
        if capacity > self.capacity:
            self._allocate(capacity)

    def resize(self, capacity: int) -> None:
        """Set the capacity exactly (e.g. shrink back to budget + interval after a long prompt was compressed)."""
        if int(self.lengths.max()) > capacity:
            raise ValueError(f"cannot resize to {capacity}: a slot holds {int(self.lengths.max())} entries")
        if capacity != self.capacity:
            self._allocate(capacity)

    def reshape(self, num_slots: int, capacity: int) -> None:
        """Set the number of slots and the capacity exactly; slots [0, num_slots) keep their entries."""
        if num_slots < self.num_slots and int(self.lengths[:, num_slots:].max()) > 0:
            raise ValueError(f"cannot drop to {num_slots} slots: a higher slot holds entries")
        if self.lengths[:, :num_slots].numel() and int(self.lengths[:, :num_slots].max()) > capacity:
            raise ValueError(f"cannot reshape to capacity {capacity}: a slot holds {int(self.lengths.max())} entries")
        if (num_slots, capacity) != (self.num_slots, self.capacity):
            self._allocate(capacity, num_slots)

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one cached token in one layer: keys + values over all kv heads."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def allocated_bytes(self) -> int:
        """Bytes of the K/V buffers as allocated (all slots, all layers)."""
        return self.num_layers * self.num_slots * self.capacity * self.bytes_per_entry

    def held_bytes(self, slot: int) -> int:
        """Bytes of K/V that `slot` holds right now, summed over layers."""
        return int(self.lengths[:, slot].sum()) * self.bytes_per_entry

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
        top = int(base.max()) + T
        if top > self.capacity:
            raise RuntimeError(f"KV slot overflow: need {top} entries, capacity {self.capacity}")
        rows = torch.arange(start, start + B, device=self.device)
        if T == 1:
            idx = to_device(base, self.device)
            self.k[layer][rows, :, idx] = k_new[:, :, 0]
            self.v[layer][rows, :, idx] = v_new[:, :, 0]
            self.pos[layer, rows, :, idx] = positions[:, :1].to(torch.int32).expand(B, self.num_kv_heads)
            for n in self.aux_names:  # a reused entry must not inherit the previous occupant's accumulator
                self.aux[n][layer, rows, :, idx] = 0.0
        else:
            idx = to_device(base, self.device)[:, None] + torch.arange(T, device=self.device)  # [B, T]
            self.k[layer][rows[:, None], :, idx] = k_new.transpose(1, 2)
            self.v[layer][rows[:, None], :, idx] = v_new.transpose(1, 2)
            self.pos[layer, rows[:, None], :, idx] = positions.to(torch.int32)[:, :, None].expand(B, T, self.num_kv_heads)
            for n in self.aux_names:
                self.aux[n][layer, rows[:, None], :, idx] = 0.0
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
        self.pos[layer, slots, :, :K] = torch.gather(self.pos[layer, slots], 2, keep)
        for n in self.aux_names:
            self.aux[n][layer, slots, :, :K] = torch.gather(self.aux[n][layer, slots], 2, keep)
        self.lengths[layer, host_slots] = K

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` over slot `dst` (used to keep running requests in slots [0, n))."""
        if src == dst:
            return
        n = int(self.lengths[:, src].max())
        for l in range(self.num_layers):
            self.k[l][dst, :, :n] = self.k[l][src, :, :n]
            self.v[l][dst, :, :n] = self.v[l][src, :, :n]
        self.pos[:, dst, :, :n] = self.pos[:, src, :, :n]
        for name in self.aux_names:
            self.aux[name][:, dst, :, :n] = self.aux[name][:, src, :, :n]
        self.lengths[:, dst] = self.lengths[:, src]
        self.clear(src)

    def clear(self, slot: int) -> None:
        self.lengths[:, slot] = 0
        for name in self.aux_names:
            self.aux[name][:, slot].zero_()
