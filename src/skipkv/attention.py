"""The `skipkv` attention backend, registered with transformers' `AttentionInterface`.

HF attention layers compute q/k/v and RoPE, write k/v through `SlotCache.update`, then call this function with
views of the request slots. We build the mask from each slot's own length (padding never costs budget), run
attention with GQA (no repeated keys are materialised), and let policies observe what they declared:
recent queries (`QueryBuffer`) and accumulated attention (store aux "attn", for H2O). A fresh prefill runs
torch's causal SDPA; every other forward (decode steps, later prefill chunks) runs grouped attention here.
With a head-split store (cache/store.py) every kv head has its own length: each kv head attends with its group
of query heads over its own unit, masked by that unit's lengths (`_head_split_attention`).

    with patches.routed(model): model.model(..., cache=slot_cache, skipkv_ctx=ctx)    # models/patches.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from skipkv.cache.store import KVStore, to_device
from skipkv.kernels import key_bucket
from skipkv.models.patches import BACKEND
from skipkv.plan import KernelPlan


class QueryBuffer:
    """The last W post-RoPE queries of every request and layer (a ring indexed by true position % W).

    q: [L, S, Hq, W, D]; qpos: [S, W] true position of each buffered query (-1 = empty).
    """

    def __init__(self, num_layers: int, num_slots: int, num_heads: int, window: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.window = window
        self.q = torch.zeros(num_layers, num_slots, num_heads, window, head_dim, dtype=dtype, device=device)
        self.qpos = torch.full((num_slots, window), -1, dtype=torch.long, device=device)

    def write(self, layer: int, start: int, q: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> None:
        """Record the last W real queries of rows [start, start+B). q: [B, Hq, T, D]; positions [B, T]; real [B]."""
        B, _, T, _ = q.shape
        W = self.window
        if T == 1:  # decode: every row has exactly one real query
            ring = positions[:, 0] % W
            rows = torch.arange(start, start + B, device=q.device)
            self.q[layer, rows, :, ring] = q[:, :, 0]
            if layer == 0:
                self.qpos[rows, ring] = positions[:, 0]
            return
        # [B, W] token index in this chunk
        t = to_device(real, q.device)[:, None] - W + torch.arange(W, device=q.device)
        valid = t >= 0
        t = t.clamp(min=0)
        rows = torch.arange(B, device=q.device)[:, None].expand(B, W)[valid]
        tok = t[valid]
        pos = positions.gather(1, t)[valid]
        ring = pos % W
        self.q[layer, start + rows, :, ring] = q[rows, :, tok]
        if layer == 0:
            self.qpos[start + rows, ring] = pos

    def recent(self, layer: int, slots: torch.Tensor, w: int) -> torch.Tensor:
        """The newest `w` queries of `slots` [b] in `layer`: [b, Hq, w, D] (order: oldest first)."""
        order = self.qpos[slots].argsort(dim=-1)[:, -w:]  # [b, w]
        q = self.q[layer, slots]  # [b, Hq, W, D]
        return torch.gather(q, 2, order[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))

    def narrowed(self, window: int) -> QueryBuffer:
        """A new buffer of `window` <= W queries per slot holding each slot's newest ones, each at its true
        position % window: what a buffer of that size would hold after the same writes."""
        if window > self.window:
            raise ValueError(f"cannot narrow a {self.window}-query buffer to {window}")
        L, S, Hq, _, D = self.q.shape
        out = QueryBuffer(L, S, Hq, window, D, self.q.dtype, self.q.device)
        for s in range(S):
            order = self.qpos[s].argsort()[-window:]
            order = order[self.qpos[s, order] >= 0]
            ring = self.qpos[s, order] % window
            out.q[:, s, :, ring] = self.q[:, s, :, order]
            out.qpos[s, ring] = self.qpos[s, order]
        return out

    def slot_bytes(self) -> int:
        """Bytes one slot's buffered queries occupy (all layers), positions included."""
        L, _, Hq, W, D = self.q.shape
        return L * Hq * W * D * self.q.element_size() + W * self.qpos.element_size()

    def allocated_bytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.qpos.numel() * self.qpos.element_size()

    def resize(self, num_slots: int) -> None:
        """Change the number of slots; slots [0, num_slots) keep their queries."""
        n = min(num_slots, self.q.shape[1])
        q = self.q.new_zeros(self.q.shape[0], num_slots, *self.q.shape[2:])
        qpos = self.qpos.new_full((num_slots, self.window), -1)
        q[:, :n], qpos[:n] = self.q[:, :n], self.qpos[:n]
        self.q, self.qpos = q, qpos

    def move(self, src: int, dst: int) -> None:
        self.copy_slot(src, slice(dst, dst + 1))
        self.clear(src)

    def copy_slot(self, src: int, dsts: slice) -> None:
        """Copy slot `src`'s queries over every slot in `dsts` (a contiguous range without `src`)."""
        self.q[:, dsts] = self.q[:, src:src + 1]
        self.qpos[dsts] = self.qpos[src:src + 1]

    def clear(self, slot: int) -> None:
        self.qpos[slot] = -1


@dataclass
class StepContext:
    """What one forward needs besides the HF arguments: which rows, how many real tokens, what to observe."""

    store: KVStore
    start: int  # first slot
    real: torch.Tensor  # [B] host, real (non-pad) tokens of each row in this forward
    positions: torch.Tensor  # [B, T] true positions of this forward's tokens
    queries: QueryBuffer | None = None
    accumulate: bool = False  # add attention probabilities into store.aux["attn"] (H2O)
    # KVzip (policies/kvzip.py): per layer, the most probability each key gets from any query head and query of
    # this forward, [B, H, K] (one tensor per block of rows), from the grouped attention's own softmax
    max_probs: dict[int, list[torch.Tensor]] | None = None
    # the model's kernel plan (plan.py: bundle.plan): decode attention, p.V dtype, key buckets. None: the plan of
    # this forward's dtype and device as skipkv.kernels resolves it now (a store driven outside an engine)
    plan: KernelPlan | None = None

    _masks: dict = field(default_factory=dict)
    _rows: list | None = None

    def kernels(self, query: torch.Tensor) -> KernelPlan:
        """The plan this forward runs: `plan`, else (set once) the plan of the query's dtype and device."""
        if self.plan is None:
            self.plan = KernelPlan.resolve(query.dtype, query.device)
        return self.plan

    def rows(self) -> list:
        """Each store layer's (unit's, if head-split) lengths of this forward's rows before it, as tuples."""
        if self._rows is None:  # once per forward: hashable, so that masks are shared between layers
            lengths = self.store.lengths[:, self.start:self.start + len(self.real)]
            self._rows = [tuple(row) for row in lengths.tolist()]
        return self._rows

    def mask(self, layer: int, T: int, K: int, device: torch.device) -> torch.Tensor | None:
        """[B, 1, T, K] bool: key j is visible to query i of row b iff j <= len_b + i (len before this forward);
        None when every key is visible to every query (a decode step whose rows all hold K - 1 entries).
        `layer` indexes the store's layers (units, if head-split).

        Built once per forward and shared by every layer holding the same lengths (all of them, unless a
        model-wide policy gave layers different lengths)."""
        key = (K, self.rows()[layer])
        if key not in self._masks and T == 1 and min(key[1]) + 1 == K:
            self._masks[key] = None  # one query per row, every row at the same length: every key is visible
        elif key not in self._masks:
            limit = to_device(torch.tensor(key[1]), device)[:, None] + torch.arange(T, device=device)  # [B, T]
            self._masks[key] = (torch.arange(K, device=device)[None, None, :] <= limit[:, :, None])[:, None]
        return self._masks[key]


def skipkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, Hq, T, D]; key/value [B, H, K, D] slot views. Returns ([B, T, Hq, D], None)."""
    ctx: StepContext = kwargs["skipkv_ctx"]
    layer = module.layer_idx
    B, Hq, T, D = query.shape
    H, K = key.shape[1], key.shape[2]
    plan = ctx.kernels(query)
    if ctx.queries is not None:
        ctx.queries.write(layer, ctx.start, query, ctx.positions, ctx.real)
    if ctx.store.head_split:
        return _head_split_attention(ctx, layer, query, key, value, scaling)
    if T == K:
        # A fresh prefill (every slot was empty): plain causal attention is exact for the real tokens of
        # right-padded rows, and needs no [B, 1, T, K] mask, so SDPA can take its fused, O(T)-memory path.
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=H != Hq)
        if ctx.accumulate:
            # H2O: the attention each key receives, summed in query blocks, so no [T, T] matrix per head is held
            # (at 8K the whole one made the prefill 14x the full cache's, 563 vs 39 s; blocked, 5.3x: 290 vs
            # 55 s, benchmarks/probes/prefill_time.py; the rest is the fp32 product of every query with every key).
            _accumulate_causal(ctx, layer, query, key, scaling)
        return out.transpose(1, 2).contiguous(), None
    mask = ctx.mask(layer, T, K, query.device)
    if mask is None and not ctx.accumulate and ctx.max_probs is None and plan.sdpa:
        # Every key visible to the one query of every row (batch 1, or rows of equal length), 16-bit: the very
        # call transformers' SDPA attention makes for such a step (GQA in the kernel, no mask), so it rounds as
        # transformers does; on CUDA and on CPUs with AMX it is also the faster one (kernels.decode_sdpa: on a
        # CPU without AMX it is 2-10x slower and the grouped path below runs). In fp32 the grouped matmul below
        # wins from ~1K keys on (613 vs 1424 us at 4K). fp64 (the exactness tests) always takes this call.
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=H != Hq)
        return out.transpose(1, 2).contiguous(), None
    # Grouped attention: the G query heads of a kv head share one matmul against its keys. torch's SDPA with
    # `enable_gqa` and a mask falls back on CPU to a path that repeats K/V per query head, which made a decode
    # step 10x slower at 4K cached tokens (63 vs 6.3 ms per 24 layers, Qwen2.5-0.5B shape; see
    # benchmarks/probes/attention_gqa.py). q.k and the softmax are computed in fp32: a bf16 q.k rounds the logits, and
    # greedy outputs drifted apart from transformers' after ~90 tokens. p.V takes the probabilities in the model's
    # dtype, as torch's fused CPU kernel does (_probs_times_values).
    # A forward of many queries over many keys (the rest of each prompt after a shared prefix, a later prefill
    # chunk) runs in blocks of rows whose fp32 logits stay within GROUPED_BLOCK_BYTES (one row at least). 50
    # MATH-500 prompts in the r1think recipe (~1K tokens, one of 1675, padded to it past a shared prefix) held
    # several [50, 2, 7*T, K] fp32 tensors at once: a 19.4 GiB peak, and two such runs could not share 23.5 GiB
    # (25 of them: 9.9 GiB peak whole, 8.1 GiB blocked, benchmarks/probes/grouped_blocks_ab.py; all 50 blocked:
    # 10.3 GiB). Each row's products are the same matmuls either way: the same bits (tests/test_share_prefix.py).
    per_row = Hq * T * K * 4
    step = max(1, GROUPED_BLOCK_BYTES // per_row) if T > 1 else B
    if step >= B:
        out = _grouped_attention(ctx, layer, query, key, value, mask, 0, scaling)
    else:
        out = torch.cat([_grouped_attention(ctx, layer, query[s:s + step], key[s:s + step], value[s:s + step],
                                            None if mask is None else mask[s:s + step], s, scaling)
                         for s in range(0, B, step)])
    return out.transpose(1, 2).contiguous(), None


GROUPED_BLOCK_BYTES = 512 << 20  # fp32 logits of one block of rows of a multi-token grouped forward, at most


def _grouped_attention(ctx: StepContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None, first: int, scaling: float | None) -> torch.Tensor:
    """Grouped attention of rows [first, first + B) of this forward (skipkv_attention). Returns [B, Hq, T, D]."""
    B, Hq, T, D = query.shape
    H, K = key.shape[1], key.shape[2]
    G = Hq // H
    scale = scaling if scaling is not None else D**-0.5
    # [B, H, G*T, K]
    acc = torch.promote_types(query.dtype, torch.float32)  # fp32, or fp64 for an fp64 model (the exactness tests)
    logits = torch.matmul(query.reshape(B, H, G * T, D).to(acc), key.to(acc).transpose(-1, -2)) * scale
    logits = logits.view(B, H, G, T, K)
    if mask is not None:  # None: every key is visible to every query
        logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if ctx.max_probs is not None:
        ctx.max_probs.setdefault(layer, []).append(probs.amax(dim=(2, 3)))
    start = ctx.start + first
    if ctx.accumulate:
        real = to_device(ctx.real[first:first + B], query.device)
        real_q = torch.arange(T, device=query.device)[None, :] < real[:, None]  # [B, T]
        received = (probs * real_q[:, None, None, :, None]).sum(dim=(2, 3))  # [B, H, K]
        ctx.store.aux["attn"][layer][start:start + B, :, :K] += received
    room = ctx.store.v[layer][start:start + B]
    return _probs_times_values(probs.view(B, H, G * T, K), value, ctx.kernels(query), room).view(B, Hq, T, D)


def _probs_times_values(probs: torch.Tensor, value: torch.Tensor, plan: KernelPlan,
                        room: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 probabilities [.., M, K] x values [.., K, D] in the values' dtype. A 16-bit model's probabilities are
    rounded to its dtype and multiplied with the stored values as they are, as torch's fused CPU kernel does
    (fp32 accumulation inside the gemm; plan.pv, kernels.decode_pv: `SKIPKV_DECODE_PV=fp32` converts the values
    instead).
    fp32 and fp64 models multiply in their own dtype, exactly as before.

    `room`: the store rows `value` is the first K entries of ([.., capacity, D], same storage and strides). A 16-bit
    product on a CPU then runs over key_bucket(K) keys (capped at the capacity), the probabilities past K being
    zeros: oneDNN creates a primitive for every new 16-bit matmul shape and caches it by shape, paid at every step
    (the cache grows by one entry) and, where layers keep different counts (LaProx, PyramidKV, head-split), in every
    layer (kernels.pv_buckets: the costs, and the probe that turns it on only where the bits stay the same). The
    zero columns add exact zeros to every sum: the store is zero-filled and holds only finite values."""
    if value.dtype in (torch.float32, torch.float64) or plan.pv_fp32:
        return torch.matmul(probs, value.to(probs.dtype)).to(value.dtype)
    K = value.shape[-2]
    if (room is not None and value.device.type == "cpu" and room.data_ptr() == value.data_ptr()
            and room.stride() == value.stride()):
        padded = min(key_bucket(K), room.shape[-2]) if plan.pv_buckets.value else K
        if padded > K:
            p = probs.new_zeros(*probs.shape[:-1], padded, dtype=value.dtype)
            p[..., :K] = probs
            return torch.matmul(p, room[..., :padded, :])
    return torch.matmul(probs.to(value.dtype), value)


def _head_split_attention(ctx: StepContext, layer: int, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, scaling: float | None) -> tuple[torch.Tensor, None]:
    """Attention over a head-split store: kv head h of `layer` (unit u = layer*H + h, its own length per row)
    with its G query heads. query [B, Hq, T, D]; key/value [B, H, T, D] are this forward's new entries only
    (SlotCache.update wrote them into the units). Returns ([B, T, Hq, D], None). The same arithmetic as the
    uniform path, one kv head at a time: fused SDPA where every key is visible and the uniform path would take it
    (fp64, or 16-bit where kernels.decode_sdpa says it is faster), else the grouped matmuls with the unit's
    mask."""
    if ctx.accumulate:
        raise RuntimeError("accumulated attention (store aux 'attn') is not kept in a head-split store")
    B, Hq, T, D = query.shape
    H = key.shape[1]
    G = Hq // H
    rows = ctx.rows()
    units = range(layer * H, (layer + 1) * H)
    if all(max(rows[u]) == 0 for u in units):
        # A fresh prefill: every unit of every row was empty, so this is the uniform path's causal SDPA.
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=H != Hq)
        return out.transpose(1, 2).contiguous(), None
    store, s0 = ctx.store, ctx.start
    scale = scaling if scaling is not None else D**-0.5
    plan = ctx.kernels(query)
    fused = plan.sdpa
    outs = []
    for h, u in enumerate(units):
        K = max(rows[u]) + T
        k, v = store.k[u][s0:s0 + B, :, :K], store.v[u][s0:s0 + B, :, :K]  # [B, 1, K, D]
        q = query[:, h * G:(h + 1) * G]  # [B, G, T, D]: the query heads that read kv head h
        mask = ctx.mask(u, T, K, query.device)
        if mask is None and fused:
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=G > 1))
            continue
        acc = torch.promote_types(q.dtype, torch.float32)
        logits = (torch.matmul(q.reshape(B, 1, G * T, D).to(acc), k.to(acc).transpose(-1, -2)) * scale)
        logits = logits.view(B, 1, G, T, K)
        if mask is not None:
            logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        pv = _probs_times_values(probs.view(B, 1, G * T, K), v, plan, store.v[u][s0:s0 + B])
        outs.append(pv.view(B, G, T, D))
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None


ACCUMULATE_BLOCK_BYTES = 1 << 28  # fp32 logits of one query block in _accumulate_causal (256 MiB)


def _accumulate_causal(ctx: StepContext, layer: int, query: torch.Tensor, key: torch.Tensor,
                       scaling: float | None) -> None:
    """Add to store.aux["attn"] the causal attention probabilities each key receives over a fresh prefill,
    summed over the real queries and the query heads of its kv group: what the masked path below adds, one
    block of queries at a time (block i0..i1 sees keys < i1)."""
    B, Hq, T, D = query.shape
    H = key.shape[1]
    G = Hq // H
    scale = scaling if scaling is not None else D**-0.5
    real = to_device(ctx.real, query.device)
    acc = ctx.store.aux["attn"][layer]
    block = max(1, min(T, ACCUMULATE_BLOCK_BYTES // (4 * B * Hq * T)))
    keys_f = key.float().transpose(-1, -2)  # [B, H, D, T]
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        c = i1 - i0
        q = query[:, :, i0:i1].float().reshape(B, H, G * c, D)
        logits = (torch.matmul(q, keys_f[..., :i1]) * scale).view(B, H, G, c, i1)
        rows = torch.arange(i0, i1, device=query.device)
        # keys before the block are visible to all of its queries: only the diagonal block needs the mask
        above = rows[None, :] > rows[:, None]  # [c, c]
        logits[..., i0:i1].masked_fill_(above, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        real_q = rows[None, :] < real[:, None]  # [B, c]
        acc[ctx.start:ctx.start + B, :, :i1] += (probs * real_q[:, None, None, :, None]).sum(dim=(2, 3))


# Registered when this module is imported, so that models.patches.routed finds it (models/ sits below attention).
AttentionInterface.register(BACKEND, skipkv_attention)
