"""The model runner: batched prefill and decode forwards over slot rows, compression, slot bookkeeping.

Slot layout: decoding requests sit in slots [0, n): `running[i]` owns slot i. A group of newly admitted
requests (the cohort) is prefilled in the slots right after them, one chunk per engine step, while the
running requests keep decoding; when its prompts are done the group joins `running` (moved down if
requests finished meanwhile). A finished request's slot is refilled by moving the last running request
into it, so forwards read plain views of the store. The store's shape (slots x per-layer capacities) is what
engine/memory.py says the live requests need (`fit`); admission there keeps it within the KV memory cap.

Host syncs: lengths live on the host, small index tensors go to the device through pinned memory
(`to_device`), so a decode step that does not compress syncs once, when sampling reads the tokens.
A compression step reads a few device values (the queries buffered, the policy's selection).

Head-split policies (`Policy.head_split`) get a head-split store (cache/store.py): every loop over the store's
layers below then runs over (layer, kv head) units, and `_observe` maps a unit back to its model layer, its
query heads and its attention module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skipkv.attention import QueryBuffer, StepContext
from skipkv.cache import KVStore, SlotCache
from skipkv.cache.store import to_device
from skipkv.engine.compression import Compression
from skipkv.engine.graphs import GraphStep
from skipkv.engine.memory import KVMemory, chunk_width, running_need
from skipkv.engine.request import Request
from skipkv.engine.sampler import sample
from skipkv.engine.step import FixedStep
from skipkv.errors import SkipKVError
from skipkv.models import unpad
from skipkv.models.patches import ModelPatches
from skipkv.policies.base import Policy
from skipkv.steering.hook import ResidualAdd

# Handing HF a ready mask mapping skips its mask construction; the skipkv backend builds its own per layer.
NO_MASKS = {"full_attention": None, "sliding_attention": None}


class ModelRunner(Compression):
    def __init__(self, bundle, policy: Policy, num_slots: int = 0, prefill_chunk: int = 0,
                 steering: ResidualAdd | None = None, trace: bool = False, kv_memory: int = 0,
                 share_prefix: int = 0, unpad_prefill: bool = True, enforce_eager: bool = False,
                 patches: ModelPatches | None = None) -> None:
        """`policy`: what to capture for (queries, attention sums, hidden states); each request brings its own
        (Request.policy, of this policy's type). `kv_memory`: the cap its KVMemory admits under (0 = none).
        `share_prefix`: EngineConfig.share_prefix (see `shared_prefix`). `unpad_prefill`:
        EngineConfig.unpad_prefill (models/unpad.py), the MLPs unpadded through `patches` (the Engine's
        models/patches.ModelPatches; by default one of the runner's own, never removed). Every kernel follows the
        model's plan (`bundle.plan`, plan.py): decode steps over a uniform store run as its `step` says (the HF
        modules, engine/step.py's fixed step eager or compiled, or engine/graphs.py's replayed one), eager where
        `enforce_eager` (EngineConfig.enforce_eager)."""
        self.model = bundle.model
        self.plan = bundle.plan.eager(enforce_eager)
        self.patches = patches or ModelPatches(bundle.model)
        self.unpad_prefill = unpad_prefill and self.patches.unpad_mlps() > 0
        self.tokenizer = bundle.tokenizer
        self.prefill_chunk = prefill_chunk
        self.share_prefix = share_prefix
        self.steering = steering
        self.trace = trace  # record retention per compression (engine/trace.py); off: no recording code runs
        cfg = bundle.model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if prefill_chunk and not policy.chunked_prefill:
            raise SkipKVError(f"policy {policy.name or type(policy).__name__} scores the whole prompt at once; "
                              "chunked prefill (--prefill-chunk) is not supported with it")
        needs = policy.requirements()
        self.need_hidden = "hidden" in needs
        if policy.head_split and "attn" in needs:
            raise SkipKVError(f"policy {type(policy).__name__}: a head-split store keeps no accumulated attention")
        self.store = KVStore(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, self.head_dim, 0,
                             bundle.dtype, bundle.device, aux=("attn",) if "attn" in needs else (),
                             head_split=policy.head_split)
        self.queries = (QueryBuffer(cfg.num_hidden_layers, num_slots, cfg.num_attention_heads, policy.query_window,
                                    self.head_dim, bundle.dtype, bundle.device) if "queries" in needs else None)
        self.cache = SlotCache(self.store)
        self.memory = KVMemory(self.store.num_layers, self.store.bytes_per_entry, prefill_chunk, kv_memory,
                               heads=self.store.split)
        self.layers = bundle.model.model.layers
        self.running: list[Request] = []  # decoding, slots [0, n)
        self.cohort: list[Request] = []  # prefilling, slots [cohort_start, cohort_start + k)
        self.cohort_start = 0
        self._chunk_at = 0  # prompt offset of the cohort's next chunk
        self._cohort_len = 0  # longest prompt of the cohort
        self._shared = 0  # prompt tokens the whole cohort shares and prefills once (shared_prefix)
        self.shared_prefix_tokens = 0  # prompt tokens not prefilled thanks to a shared prefix, cumulative
        self._last_hidden: list[torch.Tensor | None] = []
        self.compressions = 0  # rows compressed, cumulative
        self.compress_seconds = 0.0  # wall time in compress(), cumulative (aborted requests' share included)
        self._reshape_due = True  # something changed what the store must hold since the last fit()
        mode = self.plan.step.value
        self.fixed: FixedStep | GraphStep | None = None
        if mode != "hf":
            fixed = FixedStep(bundle.model, self.plan, compile=mode == "compiled",
                              bucket_keys=mode == "graph")
            self.fixed = GraphStep(fixed) if mode == "graph" else fixed
        self._fitted_exact: bool | None = None

    @property
    def entry_bytes(self) -> int:
        """Bytes of one slot entry over all layers (K + V): the unit of reservations."""
        return self.store.bytes_per_entry * self.store.num_layers

    # ------------------------------------------------------------------------------------ forwards
    def _forward(self, start: int, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """One forward of rows [start, start+B): ids/positions [B, T]; real [B] host. Returns hidden [B, T, E]."""
        ctx = StepContext(self.store, start, real, positions, self.queries, "attn" in self.store.aux_names,
                          plan=self.plan)
        self.cache.bind(start, positions)
        index = unpad.padding_index(real, ids.shape[1]) if self.unpad_prefill else None
        with unpad.real_positions(None if index is None else to_device(index, ids.device)), self.plan.sdpa_context():
            out = self.model.model(input_ids=ids, position_ids=positions, attention_mask=NO_MASKS,
                                   cache=self.cache, use_cache=True, skipkv_ctx=ctx)
        self.store.advance(start, real)
        return out.last_hidden_state

    def _fixed_forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decode step of rows [0, B) through the fixed-shape step (engine/step.py). Returns hidden [B, 1, E]."""
        assert self.fixed is not None
        steer = None
        if self.steering is not None and self.steering.scale is not None:
            steer = (self.steering.layer, self.steering.vector, self.steering.scale)
            self.steering.scale = None  # consumed, as the hook does
        hidden = self.fixed(self.store, tokens, positions, self.queries, "attn" in self.store.aux_names, steer)
        self.store.advance(0, torch.ones(tokens.shape[0], dtype=torch.long))
        return hidden[:, None]

    @staticmethod
    def _host_hidden(hidden: torch.Tensor) -> torch.Tensor:
        """A forward's hidden states as policies observe them: on the host, in fp32 (fp64 for an fp64 model), in
        one copy for all rows (one device sync per forward instead of one per request on a GPU)."""
        return hidden.detach().to("cpu", torch.promote_types(hidden.dtype, torch.float32))

    def _logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """[B, V] in the model's dtype: `sample` converts only the rows it samples (a greedy pick reads them as
        they are), so a batch-64 step does not write a [64, V] fp32 copy it only takes the argmax of."""
        return self.model.lm_head(hidden_last)

    def _note_memory(self, start: int, requests: list[Request], decoding: bool) -> list[int]:
        """Update each request's peaks; returns the entries each now holds per kv head (largest layer).
        Total bytes add the entries' positions and accumulators and the request's share of the query buffer."""
        lengths = self.store.lengths[:, start:start + len(requests)]
        tokens = lengths.amax(dim=0).tolist()
        entries = lengths.sum(dim=0)
        nbytes = (entries * self.store.bytes_per_entry).tolist()
        qbytes = self.queries.slot_bytes() if self.queries is not None else 0
        total = (entries * self.store.total_bytes_per_entry + qbytes).tolist()
        for r, t, b, tb in zip(requests, tokens, nbytes, total):
            r.note_memory(t, b, decoding, tb)
        return tokens

    # ------------------------------------------------------------------------------------ store shape
    def _prepare(self, reqs: Sequence[Request]) -> None:
        for r in reqs:
            self.memory.plan(r)  # once; the engine's scheduler has planned queued requests already

    def running_need(self) -> torch.Tensor:
        """Entries [L] each layer must hold for the decoding requests from now on (memory.running_need)."""
        return running_need(self.store.lengths, self.running)

    def needed_shape(self) -> tuple[int, list[int]]:
        """(slots, per-layer capacities) that the live requests need now: the decoding requests what they hold
        plus their remaining growth (memory.running_need), the group being prefilled what it holds plus its
        next chunk (staged whole in every row, see KVStore.append). Admission bounded all of it (memory.py)."""
        slots = self.cohort_start + len(self.cohort) if self.cohort else len(self.running)
        caps = self.running_need()
        if self.cohort:
            nxt = min(chunk_width(self.prefill_chunk, self._cohort_len), self._cohort_len - self._chunk_at)
            rows = self.store.lengths[:, self.cohort_start:slots]
            top = rows.amax(dim=1) if rows.shape[1] else torch.zeros_like(caps)  # slots not yet allocated hold 0
            caps = torch.maximum(caps, top + nxt)
        held = self.store.lengths[:, :min(slots, self.store.num_slots)]
        if held.numel():
            caps = torch.maximum(caps, held.amax(dim=1))
        return slots, caps.tolist()

    def fit(self, exact: bool) -> None:
        """Shape the store for the live requests: exactly (freeing memory at once), or only growing where it
        is too small (a slot about to be refilled is not freed and reallocated)."""
        # Between events that change what the live requests need (admission, a prompt chunk, a compression, a
        # release) a decode step only fills capacity that was reserved for it: nothing to recompute.
        if not self._reshape_due and exact == self._fitted_exact:
            return
        self._reshape_due, self._fitted_exact = False, exact
        slots, caps = self.needed_shape()
        if not exact and slots <= self.store.num_slots and all(c <= h for c, h in zip(caps, self.store.capacities)):
            return
        self.store.reshape(slots, caps)
        if self.queries is not None and self.queries.q.shape[1] != slots:
            self.queries.resize(slots)

    # ------------------------------------------------------------------------------------ prefill
    def start_cohort(self, new: list[Request]) -> None:
        """Admit `new` into the slots after the running requests; `prefill_step` then prefills them."""
        if self.cohort:
            raise RuntimeError("a cohort is still prefilling")
        self._prepare(new)
        self._reshape_due = True
        self.cohort = list(new)
        self.cohort_start = len(self.running)
        self._chunk_at = 0
        self._cohort_len = max(r.prompt_len for r in new)
        self._shared = self.shared_prefix(new)
        self._last_hidden = [None] * len(new)
        self.fit(exact=False)
        for i in range(len(new)):
            self.store.clear(self.cohort_start + i)
            if self.queries is not None:
                self.queries.clear(self.cohort_start + i)

    def shared_prefix(self, new: Sequence[Request]) -> int:
        """Prompt tokens that every request of `new` starts with and that one forward prefills for all of them
        (EngineConfig.share_prefix): 0 unless sharing is on, the group has two or more requests and they share
        at least `share_prefix` tokens. Every request keeps its last prompt token for its own forward (its
        first token's logits), and the prefix stays within the first chunk (chunked prefill stages and
        compresses per chunk, as without sharing)."""
        if self.share_prefix <= 0 or len(new) < 2:
            return 0
        lens = [r.prompt_len for r in new]
        n = min(min(lens) - 1, chunk_width(self.prefill_chunk, max(lens)))
        first = new[0].prompt_ids
        for r in new[1:]:
            ids = r.prompt_ids
            i = 0
            while i < n and ids[i] == first[i]:
                i += 1
            n = i
        return n if n >= self.share_prefix else 0

    def _prefill_shared(self, new: list[Request], n: int) -> None:
        """Prefill the cohort's shared prefix (`n` tokens) in its first row alone and copy that row's entries,
        accumulators and queries into the others: every row then holds what its own forward of those tokens
        would have written (the same tokens at the same positions, attending only to each other)."""
        device, start, k = self.store.device, self.cohort_start, len(new)
        ids = to_device(torch.tensor([new[0].prompt_ids[:n]]), device)
        hidden = self._forward(start, ids, torch.arange(n, device=device)[None], torch.tensor([n]))
        others = slice(start + 1, start + k)
        self.store.copy_slot(start, others)
        if self.queries is not None:
            self.queries.copy_slot(start, others)
        if self.need_hidden:
            host_ids, host = torch.tensor(new[0].prompt_ids[:n]), self._host_hidden(hidden[0])
            for r in new:
                r.policy.observe(r.state, host_ids, host)
        self.shared_prefix_tokens += n * (k - 1)

    def prefill_step(self) -> tuple[int, list[tuple[Request, int]]]:
        """Prefill the cohort's next chunk. Returns (real prompt tokens processed, [(request, first token)]
        for every cohort request once the whole cohort is done, else []). A shared prefix (`shared_prefix`) is
        the first part of the first chunk: prefilled once, then the rest of the chunk in every row."""
        device = self.store.device
        new, start, k = self.cohort, self.cohort_start, len(self.cohort)
        c0 = self._chunk_at
        c1 = min(c0 + chunk_width(self.prefill_chunk, self._cohort_len), self._cohort_len)
        # Each chunk is staged whole before compression brings the request back to its budget; layers that a
        # model-wide policy left shorter grow only by the chunk. Growing reshapes the store exactly (never
        # on top of capacity kept from requests that left), so it stays within what admission counted.
        self._reshape_due = True
        self.fit(exact=False)
        processed = 0
        if c0 == 0 and self._shared:
            self._prefill_shared(new, self._shared)
            c0, processed = self._shared, self._shared
        lens = torch.tensor([r.prompt_len for r in new])
        real = (lens - c0).clamp(0, c1 - c0)
        ids = torch.full((k, c1 - c0), self.pad_id, dtype=torch.long)
        for i, r in enumerate(new):
            if real[i] > 0:
                ids[i, : int(real[i])] = torch.tensor(r.prompt_ids[c0:c0 + int(real[i])])
        host_ids, ids = ids, to_device(ids, device)
        positions = torch.arange(c0, c1, device=device).expand(k, -1)
        if c1 > c0:
            hidden = self._forward(start, ids, positions, real)
            host = self._host_hidden(hidden) if self.need_hidden else None
            for i, r in enumerate(new):
                if c0 <= r.prompt_len - 1 < c1:
                    self._last_hidden[i] = hidden[i, r.prompt_len - 1 - c0]
                if host is not None and real[i] > 0:
                    r.policy.observe(r.state, host_ids[i, : int(real[i])], host[i, : int(real[i])])
        self._reshape_due = True  # the chunk is in: what the store must hold changed again
        held = self._note_memory(start, new, decoding=False)
        self.compress([(start + i, r) for i, (r, n) in enumerate(zip(new, held))
                       if r.policy.should_compress(n, True, r.state)],
                      is_prefill=True)
        self._chunk_at = c1
        processed += int(real.sum())
        if c1 < self._cohort_len:
            return processed, []
        last = [h for h in self._last_hidden if h is not None]
        assert len(last) == len(self._last_hidden), "every row of the cohort has its last hidden state now"
        tokens = sample(self._logits(torch.stack(last)), new)
        # Join the running requests: slots [n, n + k), moved down if requests finished while it prefilled.
        n = len(self.running)
        for i in range(k):
            if start + i != n + i:
                self._move(start + i, n + i)
        for r in new:
            r.fed = r.prompt_len
        self.running.extend(new)
        self.cohort, self._last_hidden = [], []
        return processed, list(zip(new, tokens))

    def prefill(self, new: list[Request]) -> list[int]:
        """Admit `new` and prefill it whole (all chunks) now; returns the first tokens, in the order of `new`."""
        self.start_cohort(new)
        done: list[tuple[Request, int]] = []
        while not done:
            done = self.prefill_step()[1]
        self.fit(exact=True)  # back to the reservations once long prompts were staged and compressed
        return [t for _, t in done]

    # ------------------------------------------------------------------------------------ decode
    def decode(self) -> list[int]:
        """One decode step over every running request; returns the next token of each."""
        device = self.store.device
        B = len(self.running)
        last = torch.tensor([r.output_ids[-1] for r in self.running])
        ids = to_device(last[:, None], device)
        positions = to_device(torch.tensor([[r.next_position] for r in self.running]), device)
        if self.steering is not None:
            self.steering.prepare(last, [r.state for r in self.running])
        if self.fixed is not None and FixedStep.supports(self.model, self.store)[0]:
            hidden = self._fixed_forward(ids[:, 0], positions[:, 0])
        else:
            hidden = self._forward(0, ids, positions, torch.ones(B, dtype=torch.long))
        for r in self.running:
            r.fed += 1
        held = self._note_memory(0, self.running, decoding=True)
        if self.need_hidden:
            host = self._host_hidden(hidden)
            for i, r in enumerate(self.running):
                r.policy.observe(r.state, last[i:i + 1], host[i])
        tokens = sample(self._logits(hidden[:, -1]), self.running)
        self.compress([(i, r) for i, (r, n) in enumerate(zip(self.running, held))
                       if r.policy.should_compress(n, False, r.state)],
                      is_prefill=False)
        return tokens

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else 0)

    # ------------------------------------------------------------------------------------ slots
    def _move(self, src: int, dst: int) -> None:
        for buf in (self.store, self.queries):
            if buf is not None:
                buf.move(src, dst)  # also clears `src`

    def _clear(self, slot: int) -> None:
        for buf in (self.store, self.queries):
            if buf is not None:
                buf.clear(slot)

    def release(self, finished: list[Request]) -> None:
        """Drop finished (or aborted) requests, running or still prefilling, keeping each group contiguous:
        the last request of its group moves into the freed slot."""
        self._reshape_due = True
        for r in finished:
            group, base = (self.running, 0) if any(x is r for x in self.running) else (self.cohort, self.cohort_start)
            i = next(j for j, x in enumerate(group) if x is r)
            r.head_kv_tokens = self.store.head_lengths(base + i)
            # per layer: its heads' mean (rounded), the same as every head's count unless head-split
            r.layer_kv_tokens = [round(sum(h) / len(h)) for h in r.head_kv_tokens]
            last = len(group) - 1
            if last != i:
                self._move(base + last, base + i)
            else:
                self._clear(base + i)
            if group is self.cohort:
                self._last_hidden[i] = self._last_hidden[last]
                self._last_hidden.pop()
            group[i] = group[last]
            group.pop()
        if not self.cohort:
            self._last_hidden = []
