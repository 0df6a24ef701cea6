"""The model runner: batched prefill and decode forwards over slot rows, compression, slot bookkeeping.

Running requests always sit in slots [0, n): `running[i]` owns slot i. A finished request's slot is
refilled by moving the last running request into it, so forwards read plain views of the store.
"""

from __future__ import annotations

import time

import torch

from skipkv.attention import QueryBuffer, StepContext
from skipkv.cache import KVStore, SlotCache
from skipkv.engine.hooks import ResidualAdd
from skipkv.engine.request import Request
from skipkv.engine.sampler import sample
from skipkv.errors import SkipKVError
from skipkv.policies.base import Observation, Policy

# Handing HF a ready mask mapping skips its mask construction; the skipkv backend builds its own per layer.
NO_MASKS = {"full_attention": None, "sliding_attention": None}


class ModelRunner:
    def __init__(self, bundle, policy: Policy, num_slots: int, prefill_chunk: int = 0,
                 steering: ResidualAdd | None = None) -> None:
        self.model = bundle.model
        self.tokenizer = bundle.tokenizer
        self.policy = policy
        self.prefill_chunk = prefill_chunk
        self.steering = steering
        if policy.model_wide:
            # Compression groups rows by one length and scores layer by layer; a model-wide top-k (LaProx)
            # leaves layers at different lengths, which needs that grouping per layer first.
            raise SkipKVError(f"policy {type(policy).__name__} selects model-wide, which this engine does not run yet")
        cfg = bundle.model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        needs = policy.requirements()
        self.need_hidden = "hidden" in needs
        self.store = KVStore(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, self.head_dim, 0,
                             bundle.dtype, bundle.device, aux=("attn",) if "attn" in needs else ())
        self.queries = (QueryBuffer(cfg.num_hidden_layers, num_slots, cfg.num_attention_heads, policy.query_window,
                                    self.head_dim, bundle.dtype, bundle.device) if "queries" in needs else None)
        self.cache = SlotCache(self.store)
        self.layers = bundle.model.model.layers
        self.running: list[Request] = []

    # ------------------------------------------------------------------------------------ forwards
    def _forward(self, start: int, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """One forward of rows [start, start+B): ids/positions [B, T]; real [B] host. Returns hidden [B, T, E]."""
        ctx = StepContext(self.store, start, real, positions, self.queries, "attn" in self.store.aux_names)
        self.cache.bind(start, positions)
        out = self.model.model(input_ids=ids, position_ids=positions, attention_mask=NO_MASKS, cache=self.cache,
                               use_cache=True, skipkv_ctx=ctx)
        self.store.advance(start, real)
        return out.last_hidden_state

    def _logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden_last).float()

    def _note_memory(self, start: int, requests: list[Request], decoding: bool) -> list[int]:
        """Update each request's peaks; returns the entries each now holds per kv head (largest layer)."""
        lengths = self.store.lengths[:, start:start + len(requests)]
        tokens = lengths.amax(dim=0).tolist()
        nbytes = (lengths.sum(dim=0) * self.store.bytes_per_entry).tolist()
        for r, t, b in zip(requests, tokens, nbytes):
            r.note_memory(t, b, decoding)
        return tokens

    def target_capacity(self, extra: list[Request] = ()) -> int:
        reqs = list(self.running) + list(extra)
        return max(self.policy.capacity(r.prompt_len, r.sampling.max_new_tokens) for r in reqs)

    def prefill(self, new: list[Request]) -> list[int]:
        """Admit `new` into slots [n, n+k), prefill them together, return their first tokens."""
        device = self.store.device
        start, k = len(self.running), len(new)
        lens = torch.tensor([r.prompt_len for r in new])
        T = int(lens.max())
        chunk = self.prefill_chunk if 0 < self.prefill_chunk < T else T
        self.store.ensure_capacity(self.target_capacity(new))
        self.running.extend(new)
        for i, r in enumerate(new):
            self.store.clear(start + i)
            if self.queries is not None:
                self.queries.clear(start + i)
        ids = torch.full((k, T), self.pad_id, dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, : r.prompt_len] = torch.tensor(r.prompt_ids)
        ids = ids.to(device)
        last_hidden = [None] * k
        for c0 in range(0, T, chunk):
            c1 = min(c0 + chunk, T)
            real = (lens - c0).clamp(0, c1 - c0)
            positions = torch.arange(c0, c1, device=device).expand(k, -1)
            # Each chunk is staged whole before compression brings the request back to its budget.
            self.store.ensure_capacity(int(self.store.lengths[:, start:start + k].max()) + c1 - c0)
            hidden = self._forward(start, ids[:, c0:c1], positions, real)
            held = self._note_memory(start, new, decoding=False)
            for i, r in enumerate(new):
                if c0 <= r.prompt_len - 1 < c1:
                    last_hidden[i] = hidden[i, r.prompt_len - 1 - c0]
                if self.need_hidden and real[i] > 0:
                    self.policy.observe(r.state, ids[i, c0:c0 + int(real[i])], hidden[i, : int(real[i])])
            self.compress([start + i for i, n in enumerate(held) if self.policy.should_compress(n, True, new[i].state)],
                          is_prefill=True)
        self.store.resize(max(self.target_capacity(), int(self.store.lengths.max())))
        return sample(self._logits(torch.stack(last_hidden)), new)

    def decode(self) -> list[int]:
        """One decode step over every running request; returns the next token of each."""
        device = self.store.device
        B = len(self.running)
        ids = torch.tensor([[r.output_ids[-1]] for r in self.running], device=device)
        positions = torch.tensor([[r.next_position] for r in self.running], device=device)
        if self.steering is not None:
            self.steering.prepare(ids[:, 0], [r.state for r in self.running])
        hidden = self._forward(0, ids, positions, torch.ones(B, dtype=torch.long))
        held = self._note_memory(0, self.running, decoding=True)
        if self.need_hidden:
            for i, r in enumerate(self.running):
                self.policy.observe(r.state, ids[i], hidden[i])
        tokens = sample(self._logits(hidden[:, -1]), self.running)
        self.compress([i for i, n in enumerate(held) if self.policy.should_compress(n, False, self.running[i].state)],
                      is_prefill=False)
        return tokens

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else 0)

    # ------------------------------------------------------------------------------------ compression
    def compress(self, rows: list[int], is_prefill: bool) -> None:
        """Bring each slot in `rows` down to the budget. Rows of equal length are scored together."""
        if not rows:
            return
        t0 = time.perf_counter()
        by_len: dict[int, list[int]] = {}
        for s in rows:
            by_len.setdefault(int(self.store.lengths[0, s]), []).append(s)
        for n, group in by_len.items():
            slots = torch.tensor(group, device=self.store.device)
            states = [self.running[s].state for s in group]
            self.policy.before_compress(states, is_prefill)  # once per compression, not per layer
            keeps = [self.policy.select(self._observe(l, slots, n, is_prefill, states))
                     for l in range(self.store.num_layers)]
            for l, keep in enumerate(keeps):
                self.store.compact(l, slots, keep)
        share = (time.perf_counter() - t0) / len(rows)
        for s in rows:
            self.running[s].compressions += 1
            self.running[s].compress_seconds += share

    def _observe(self, layer: int, slots: torch.Tensor, n: int, is_prefill: bool, states: list) -> Observation:
        queries = None
        if self.queries is not None:
            seen = int((self.queries.qpos[slots] >= 0).sum(dim=-1).min())
            queries = self.queries.recent(layer, slots, min(self.policy.query_window, seen))
        attn = self.store.aux["attn"][layer, slots, :, :n] if "attn" in self.store.aux else None
        return Observation(layer=layer, keys=self.store.k[layer][slots, :, :n], values=self.store.v[layer][slots, :, :n],
                           positions=self.store.pos[layer, slots, :, :n], queries=queries, attn=attn,
                           module=self.layers[layer].self_attn, is_prefill=is_prefill, states=states)

    # ------------------------------------------------------------------------------------ slots
    def release(self, finished: list[Request]) -> None:
        """Drop finished requests, moving the last running ones into their slots."""
        for r in finished:
            slot = self.running.index(r)
            last = len(self.running) - 1
            for buf in (self.store, self.queries):
                if buf is None:
                    continue
                if last != slot:
                    buf.move(last, slot)  # also clears `last`
                else:
                    buf.clear(slot)
            self.running[slot] = self.running[last]
            self.running.pop()
